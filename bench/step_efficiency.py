"""How close does a step come to the speed of its parts?

Runs ``configs/grpo_small.yaml`` (a ~13M-parameter Qwen2-shaped model, 8 prompts x 4 samples x 128 new
tokens, one process, one thread) and, side by side in the same run, the bare parts on the same inputs:

* **bare vLLM**: after each step, the same engine (still holding the weights the step sampled with)
  generates the step's prompts with the same sampling parameters and seeds through ``LLM.generate``,
  outside the framework; the tokens must come out identical (``same_tokens``).
* **bare Megatron**: the step's sequences (the same token ids, right-padded into the same micro-batches)
  go through the Megatron model's forward and backward directly (no schedule, no optimizer, a plain
  masked log-likelihood loss); the gradients are discarded.

Figures, over the measured steps (the first two are warm-up):

* ``rollout_over_bare_vllm`` = the step's rollout phase / bare vLLM time;
* ``train_over_bare_megatron`` = the step's train phase / bare forward+backward time;
* ``overhead_share`` = the share of the step's wall time (Lightning's hooks included) spent neither in
  the engine's generation steps, nor in Megatron's forward/backward and optimizer step, nor in the
  weight push.

    python bench/step_efficiency.py [--smoke] [--trainer.max_steps 8] [any yatt fit override]

Last line: ``rollout_over_bare_vllm=<r> train_over_bare_megatron=<t> overhead_share=<o>``; targets
r <= 1.1, t <= 1.15, o <= 0.10.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from _common import REPO, build_cli, pop_smoke
from lightning.pytorch import Callback

from yatt_lightning.training.batch import TrainingBatch

WARMUP = 2
SMALL = str(REPO / "configs" / "grpo_small.yaml")


class _Timer:
    """Accumulates the wall time of calls to a wrapped function."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0

        return timed


class StepEfficiency(Callback):
    """Times each step and its parts inside the run, then runs the bare parts on the step's inputs."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.generation, self.compute = _Timer(), _Timer()
        self.requests: list[tuple] = []  # (prompts, sampling, seeds) the engine was asked for this step

    def on_train_start(self, trainer, module) -> None:
        engine = trainer.strategy.engine
        llm_engine = engine.llm.llm_engine
        llm_engine.step = self.generation.wrap(llm_engine.step)
        stream = engine.generate_stream

        def recording_stream(prompts, sampling, seeds, max_new_tokens=None, images=None):
            self.requests.append((list(prompts), sampling, list(seeds)))
            return stream(prompts, sampling, seeds, max_new_tokens, images)

        engine.generate_stream = recording_stream
        module.policy.forward_backward = self.compute.wrap(module.policy.forward_backward)
        module.policy.optimizer_step = self.compute.wrap(module.policy.optimizer_step)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.generation.total = self.compute.total = 0.0
        self.requests = []
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step_s = time.perf_counter() - self.started
        times = {k: outputs["stats"].scalars[f"time/{k}"] for k in ("rollout", "sync", "train")}
        row = {
            "step": step_s, "rollout": times["rollout"], "sync": times["sync"], "train": times["train"],
            "generation": self.generation.total, "compute": self.compute.total,
        }  # fmt: skip
        row["bare_vllm"], row["same_tokens"] = self._bare_vllm(trainer.strategy.engine, module.last_rollouts)
        row["bare_megatron"] = self._bare_megatron(module, module.last_rollouts)
        if batch_idx >= WARMUP:
            self.rows.append(row)

    def _bare_vllm(self, engine, rollouts) -> tuple[float, bool]:
        """The step's requests again, through vLLM's own ``LLM.generate``, with the weights they were sampled with."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seconds, tokens = 0.0, []
        for prompts, sampling, seeds in self.requests:
            params = [
                SamplingParams(n=sampling.n, max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                               top_p=sampling.top_p, top_k=sampling.top_k, logprobs=0, seed=seed, detokenize=False)
                for seed in seeds
            ]  # fmt: skip
            inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            t0 = time.perf_counter()
            outs = engine.llm.generate(inputs, params, use_tqdm=False)
            seconds += time.perf_counter() - t0
            tokens += [list(c.token_ids) for out in outs for c in out.outputs]
        return seconds, sorted(map(tuple, tokens)) == sorted(map(tuple, rollouts.completion_ids))

    def _bare_megatron(self, module, rollouts) -> float:
        """Forward and backward of the step's micro-batches straight through the Megatron model."""
        from yatt_lightning.models.cpu import megatron_cpu_context

        mbs = module.microbatches(TrainingBatch.of(rollouts), list(range(len(rollouts))))
        model = module.policy.model
        model.train(True)
        t0 = time.perf_counter()
        with megatron_cpu_context():
            for mb in mbs:
                ids = mb["input_ids"]
                seq = ids.shape[1]
                positions = torch.arange(seq).unsqueeze(0).expand_as(ids)
                causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
                logits = model(ids, positions, causal)[:, :-1].float()
                logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
                (-(logprobs * mb["loss_mask"]).sum() / mb["loss_mask"].sum()).backward()
        seconds = time.perf_counter() - t0
        module.policy.zero_grad_buffers()  # discard: the next update starts from zero gradients anyway
        return seconds


def summarise(rows: list[dict]) -> dict[str, float]:
    """Ratios of sums over the measured steps (a long step weighs what it costs)."""
    total = {k: sum(r[k] for r in rows) for k in rows[0]}
    inside = total["generation"] + total["compute"] + total["sync"]
    return {
        "rollout_over_bare_vllm": total["rollout"] / total["bare_vllm"],
        "train_over_bare_megatron": total["train"] / total["bare_megatron"],
        "overhead_share": max(0.0, total["step"] - inside) / total["step"],
        "same_tokens": float(all(r["same_tokens"] for r in rows)),
    }


def main() -> None:
    argv = sys.argv[1:]
    smoke = pop_smoke(argv)
    size = (
        ["--trainer.max_steps", str(WARMUP + 1), "--model.sampling.max_new_tokens", "16"]
        if smoke
        else ["--trainer.max_steps", str(WARMUP + 6)]
    )
    cli = build_cli(["--trainer.devices", "1", *size, *argv], config=SMALL)
    meter = StepEfficiency()
    cli.trainer.callbacks.append(meter)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rows = meter.rows
    print(f"config {Path(SMALL).name}; {len(rows)} steps measured after {WARMUP} warm-up; per step (ms):")
    keys = ("step", "rollout", "generation", "bare_vllm", "sync", "train", "compute", "bare_megatron")
    print("".join(f"{k:>14}" for k in keys))
    for r in rows:
        print("".join(f"{r[k] * 1000:>14.0f}" for k in keys))
    print("".join(f"{statistics.mean(r[k] for r in rows) * 1000:>14.0f}" for k in keys) + "   (mean)")
    f = summarise(rows)
    print(f"same tokens as the bare engine: {bool(f['same_tokens'])}")
    print(
        f"rollout_over_bare_vllm={f['rollout_over_bare_vllm']:.3f} "
        f"train_over_bare_megatron={f['train_over_bare_megatron']:.3f} overhead_share={f['overhead_share']:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
