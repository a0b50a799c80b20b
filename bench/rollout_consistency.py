"""Does the rollout engine sample from the policy being trained?

Trains a few GRPO steps on the tiny config, then, with the engine holding the pushed weights, samples
completions and scores the sampled tokens with the Megatron policy. In fp32 on CPU the two logprobs
must agree (< 1e-3). For contrast it loads the *initial* weights into the engine (what a missed push
would leave) and repeats: that difference is large.

    python bench/rollout_consistency.py [--smoke] [--trainer.max_steps 5] [--trainer.devices 2 ...]

``--smoke``: 2 training steps.

Last line: ``max_abs_logprob_diff=<float>``.
"""

from __future__ import annotations

import sys

from _common import all_reduce_max, build_cli, pop_smoke
from lightning.pytorch import Callback


class ConsistencyProbe(Callback):
    def __init__(self) -> None:
        self.result: list[float] | None = None

    def on_train_end(self, trainer, module) -> None:
        from safetensors.torch import load_file
        from yatt_lightning.datamodules.tasks import AlphabetTask

        from yatt_lightning.diagnostics import rollout_consistency, stale_engine_consistency

        task = AlphabetTask()
        rows = [dict(task.row(c), _id=i) for i, c in enumerate("afkpuz")]
        fresh = rollout_consistency(module, rows)
        initial = load_file(str(module.model_path / "model.safetensors"))
        stale = stale_engine_consistency(module, rows, initial.items())
        self.result = all_reduce_max(
            [fresh["max_abs_logprob_diff"], fresh["mean_abs_logprob_diff"], stale["max_abs_logprob_diff"],
             stale["mean_abs_logprob_diff"], float(fresh["tokens"]), float(trainer.global_step)]
        )  # fmt: skip


def main() -> None:
    argv = sys.argv[1:]
    steps = "2" if pop_smoke(argv) else "5"
    cli = build_cli(["--trainer.max_steps", steps, *argv])
    probe = ConsistencyProbe()
    cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if cli.trainer.is_global_zero:
        fresh_max, fresh_mean, stale_max, stale_mean, tokens, steps = probe.result
        print(f"trained steps: {int(steps)}; sampled tokens compared: {int(tokens)}")
        print(f"{'engine weights':<28}{'max |dlogp|':>14}{'mean |dlogp|':>14}")
        print(f"{'pushed (current policy)':<28}{fresh_max:>14.3e}{fresh_mean:>14.3e}")
        print(f"{'stale (initial weights)':<28}{stale_max:>14.3e}{stale_mean:>14.3e}")
        print(f"max_abs_logprob_diff={fresh_max:.3e}", flush=True)


if __name__ == "__main__":
    main()
