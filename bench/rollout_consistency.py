"""Does the rollout engine sample from the policy being trained?

Trains a few GRPO steps on the tiny config, then, with the engine holding the pushed weights, samples
completions and scores the sampled tokens with the Megatron policy. In fp32 on CPU the two logprobs
must agree (< 1e-3). For contrast it loads the *initial* weights into the engine (what a missed push
would leave) and repeats: that difference is large.

    python bench/rollout_consistency.py [--smoke] [--vlm | --multiturn] [--trainer.max_steps 5] [--trainer.devices 2 ...]

``--smoke``: 2 training steps. ``--vlm``: the image case: configs/grpo_vlm_tiny.yaml (the tiny LLaVA,
whose vision tower and projector train too), compared on held-out colour-task rows with their images.
``--multiturn``: an agent's episodes (configs/agent_guess_tiny.yaml, up to 5 turns with the game's replies
between them), compared on the tokens the model sampled in every turn (the observations' are not sampled).

Last line: ``max_abs_logprob_diff=<float>`` (``max_abs_logprob_diff_vlm=`` with ``--vlm``,
``multiturn_logprob_diff=`` with ``--multiturn``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from _common import REPO, TINY, all_reduce_max, build_cli, pop_smoke
from lightning.pytorch import Callback
from yatt_lightning.datamodules.images import images_of

from yatt_lightning.training.batch import TrainingBatch


def rollout_consistency(module, rows: list[dict]) -> dict[str, float]:
    """Sample ``rows`` through the strategy (which pushes the current weights), then score the sampled
    tokens with the Megatron policy. Returns the largest and mean absolute logprob difference.

    Collective: call on every rank at the same point.
    """
    rollouts = module.rollout(rows)
    ours = module.compute_logprobs(module.policy, TrainingBatch.of(rollouts), list(range(len(rollouts))))
    engine = rollouts.rollout_logprobs
    if rollouts.turns is not None and ours is not None:  # an agent's episodes: the tokens the model sampled
        masks = [torch.tensor(t.mask, dtype=torch.bool) for t in rollouts.turns]
        ours, engine = [a[m] for a, m in zip(ours, masks, strict=True)], [b[m] for b, m in zip(engine, masks, strict=True)]
    return _compare(ours, engine)


def stale_engine_consistency(module, rows: list[dict], stale_weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """The same comparison after loading ``stale_weights`` into the engine instead of the policy's weights:
    shows the size of the error a missed weight push would leave. Marks the engine stale afterwards."""
    strategy = module.trainer.strategy
    strategy.engine.push_weights(stale_weights)
    prompt_ids = [module.tokenize_prompt(r) for r in rows]
    groups = strategy.engine.generate(prompt_ids, module.sampling, module.sample_seeds(rows), images=images_of(rows))
    strategy.rollout.mark_weights_stale()
    from yatt_lightning.rollout.batch import RolloutBatch

    n = module.sampling.n
    comps = [c for g in groups for c in g]
    rollouts = RolloutBatch(
        prompts=[r["prompt"] for r in rows for _ in range(n)],
        prompt_ids=[p for p in prompt_ids for _ in range(n)],
        completion_ids=[c.token_ids for c in comps],
        completions=[""] * len(comps),
        rows=[r for r in rows for _ in range(n)],
        group_ids=torch.arange(len(rows)).repeat_interleave(n),
        rollout_logprobs=[torch.tensor(c.logprobs) for c in comps],
        finish_reasons=[c.finish_reason for c in comps],
    )
    ours = module.compute_logprobs(module.policy, TrainingBatch.of(rollouts), list(range(len(rollouts))))
    return _compare(ours, rollouts.rollout_logprobs)


def _compare(ours: list[torch.Tensor] | None, engine: list[torch.Tensor]) -> dict[str, float]:
    if ours is None:  # not the last pipeline stage
        return {"max_abs_logprob_diff": float("nan"), "mean_abs_logprob_diff": float("nan"), "tokens": 0}
    diffs = torch.cat([(a - b).abs() for a, b in zip(ours, engine, strict=True) if len(a)])
    return {
        "max_abs_logprob_diff": float(diffs.max()) if diffs.numel() else 0.0,
        "mean_abs_logprob_diff": float(diffs.mean()) if diffs.numel() else 0.0,
        "tokens": int(diffs.numel()),
    }


class ConsistencyProbe(Callback):
    def __init__(self, images: bool = False, multiturn: bool = False) -> None:
        self.images, self.multiturn = images, multiturn
        self.result: list[float] | None = None

    def rows(self) -> list[dict]:
        """Alphabet prompts, (``images``) colour-task rows with their images, or (``multiturn``) guessing-game
        rows, not seen in training."""
        if self.multiturn:
            from yatt_lightning.datamodules.tasks import GuessTask

            return [dict(row, _id=i) for i, row in enumerate(GuessTask(num_rows=6, seed=777).rows())]
        if self.images:
            from yatt_lightning.datamodules.image_prompt import ImagePromptDataModule
            from yatt_lightning.datamodules.tasks import ColourTask

            held = ImagePromptDataModule(task=ColourTask(num_rows=6, seed=777), shuffle=False)
            held.setup("fit")
            return [held.dataset[i] for i in range(6)]
        from yatt_lightning.datamodules.tasks import AlphabetTask

        task = AlphabetTask()
        return [dict(task.row(c), _id=i) for i, c in enumerate("afkpuz")]

    def on_train_end(self, trainer, module) -> None:
        from safetensors.torch import load_file

        rows = self.rows()
        fresh = rollout_consistency(module, rows)
        initial = load_file(str(module.model_path / "model.safetensors"))
        stale = fresh if self.multiturn else stale_engine_consistency(module, rows, initial.items())
        self.result = all_reduce_max(
            [fresh["max_abs_logprob_diff"], fresh["mean_abs_logprob_diff"], stale["max_abs_logprob_diff"],
             stale["mean_abs_logprob_diff"], float(fresh["tokens"]), float(trainer.global_step)]
        )  # fmt: skip


def main() -> None:
    argv = sys.argv[1:]
    steps = "2" if pop_smoke(argv) else "5"
    images, multiturn = "--vlm" in argv, "--multiturn" in argv
    argv = [a for a in argv if a not in ("--vlm", "--multiturn")]
    config = str(REPO / "configs" / "grpo_vlm_tiny.yaml") if images else TINY
    config = str(REPO / "configs" / "agent_guess_tiny.yaml") if multiturn else config
    cli = build_cli(["--trainer.max_steps", steps, *argv], config=config)
    probe = ConsistencyProbe(images, multiturn)
    cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if cli.trainer.is_global_zero:
        fresh_max, fresh_mean, stale_max, stale_mean, tokens, steps = probe.result
        print(f"trained steps: {int(steps)}; sampled tokens compared: {int(tokens)}")
        print(f"{'engine weights':<28}{'max |dlogp|':>14}{'mean |dlogp|':>14}")
        print(f"{'pushed (current policy)':<28}{fresh_max:>14.3e}{fresh_mean:>14.3e}")
        if not multiturn:
            print(f"{'stale (initial weights)':<28}{stale_max:>14.3e}{stale_mean:>14.3e}")
        name = "multiturn_logprob_diff" if multiturn else f"max_abs_logprob_diff{'_vlm' if images else ''}"
        print(f"{name}={fresh_max:.3e}", flush=True)


if __name__ == "__main__":
    main()
