"""The run's parallel layout, computed once and checked once, before any process group or engine.

``Layout(world, tp, pp)`` is frozen: the number of processes (``trainer.devices`` x ``trainer.num_nodes``)
and the tensor- and pipeline-parallel sizes. :meth:`MegatronStrategy.check_layout
<yatt_lightning.strategy.MegatronStrategy.check_layout>` builds it in preflight and hands it to the parts
that have a say (the model's shapes, the controller, the placement); each checks what it needs against it,
naming its key. Everything after reads the sizes from it instead of multiplying them again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Args:
    world: The run's processes.
    tp: Tensor-parallel size (``trainer.strategy.tensor_model_parallel_size``).
    pp: Pipeline-parallel size (``trainer.strategy.pipeline_model_parallel_size``).
    ep: Expert-parallel size (``trainer.strategy.expert_model_parallel_size``): the data-parallel ranks of a
        mixture-of-experts model split its experts (each rank holds ``num_experts / ep`` whole experts).
    """

    world: int
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one copy of the model (one engine serves them)."""
        return self.tp * self.pp

    def data_parallel(self, training_world: int | None = None) -> int:
        """Copies of the model among ``training_world`` training ranks (default: every rank trains)."""
        return (self.world if training_world is None else training_world) // self.model_parallel

    def check_divides(self, ranks: int, what: str) -> None:
        """Raise naming the keys when ``tp x pp`` does not divide ``ranks`` (``what`` names them)."""
        if ranks % self.model_parallel:
            raise ValueError(
                f"`trainer.strategy.tensor_model_parallel_size` ({self.tp}) x `pipeline_model_parallel_size` "
                f"({self.pp}) = {self.model_parallel} does not divide the {ranks} {what}."
            )
        if ranks % (self.ep * self.pp):
            raise ValueError(
                f"`trainer.strategy.expert_model_parallel_size` ({self.ep}) x `pipeline_model_parallel_size` "
                f"({self.pp}) = {self.ep * self.pp} does not divide the {ranks} {what}."
            )
