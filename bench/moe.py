"""A Qwen3-MoE's training step at EP=2 against DP=2, its colocated push against vLLM's own load, and the
engine-vs-policy logprob mismatch.

Two runs of `configs/grpo_qwen3_moe_tiny.yaml`'s settings on 2 processes, each in processes of its own, the same
model (``builtin:small-qwen3-moe``: hidden 256, 4 layers, 8 experts of 512, top 2; the experts are 12M of its 13M
parameters; the smoke size: ``builtin:tiny-qwen3-moe``):

* ``ep_over_dp_step`` = the median training phase (``time/train``) after warm-up at EP=2 (4 experts a rank,
  tokens to their experts by all-to-all) / the same at DP=2 with every expert on each rank; the same prompts
  and seeds, so the same work.
* ``push_over_vllm_load`` = at the end of the EP=2 run (and, printed above it, the DP=2 run's), one colocated
  push (the export, with every rank's experts exchanged over the expert-parallel group: through ``/dev/shm`` on
  one host, models/expert_gather.py; + the engine's reload and its repacking of the experts) / the engine's
  reload of the same tensors exported beforehand; best of ``--repeats`` each, alternating, both ranks starting
  each timed part at a barrier.
* ``moe_logprob_diff`` = the largest ``rollout/logprob_diff_max`` over the EP=2 run's steps (the engine's logprobs
  of its samples against the policy's first training forward; both route each token themselves).
* ``moe_logprob_diff_replay``: ``nan``. Replaying the engine's routing needs its routed experts, which vLLM 0.32
  returns only under its Model Runner V2 (``enable_return_routed_experts``: "AuxOutput Connector requires Model
  Runner V2"), which needs Triton: not on this CPU stack.
* ``experts_pushed_bytes`` = the bytes of expert tensors one rank's push sends into its engine (all experts of
  every layer: 2x what the rank holds at EP=2).

Last line: ``ep_over_dp_step=X push_over_vllm_load=U moe_logprob_diff=D moe_logprob_diff_replay=R
experts_pushed_bytes=B``.

    python bench/moe.py [--steps 12] [--repeats 7] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "grpo_qwen3_moe_tiny.yaml")


def _child(out: Path, mode: str, repeats: int, overrides: list[str]) -> None:
    import torch
    from _common import build_cli
    from lightning.pytorch import Callback

    class Measure(Callback):
        def __init__(self) -> None:
            self.rows, self.end = [], {}

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            s = outputs["stats"].scalars
            self.rows.append({"train": s["time/train"], "diff": s["rollout/logprob_diff_max"], "reward": s["reward/mean"]})

        def on_train_end(self, trainer, module) -> None:
            self.end = _push_over_load(trainer.strategy.engine, module.policy, repeats)
            if trainer.global_rank == 0:
                out.write_text(json.dumps({"rows": self.rows, **self.end}))

    cli = build_cli(overrides, config=CONFIG)
    cli.trainer.callbacks.append(Measure())
    torch.manual_seed(0)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)


def _push_over_load(engine, policy, repeats: int) -> dict:
    """The colocated push (export + reload) against the reload of the same tensors, exported beforehand."""
    import torch

    pushes, loads = [], []
    named = [(n, t.clone()) for n, t in policy.export_hf()]
    for _ in range(repeats):  # both ranks start each timed part together: a late peer is not the push's cost
        torch.distributed.barrier()
        t0 = time.perf_counter()
        engine.push_weights(policy.export_hf())
        pushes.append(time.perf_counter() - t0)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        engine.push_weights(named)
        loads.append(time.perf_counter() - t0)
    experts = sum(t.numel() * t.element_size() for n, t in named if ".mlp.experts." in n)
    return {"push_s": min(pushes), "load_s": min(loads), "experts_bytes": experts}


def _run(tmp: Path, mode: str, args: argparse.Namespace) -> dict:
    overrides = [f"--trainer.max_steps={args.steps}", f"--model.init_args.policy.path={args.model}",
                 f"--trainer.strategy.init_args.expert_model_parallel_size={2 if mode == 'ep2' else 1}"]  # fmt: skip
    out = tmp / f"{mode}.json"
    proc = subprocess.run([sys.executable, __file__, "--child", str(out), mode, str(args.repeats), *overrides],
                          capture_output=True, text=True, cwd=REPO)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        sys.path.insert(0, str(REPO / "bench"))
        _child(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--model", default="builtin:small-qwen3-moe")
    p.add_argument("--smoke", action="store_true", help="the tiny Qwen3-MoE, the EP=2 run only (ep_over_dp_step "
                   "nan), 3 steps, 2 repeats")  # fmt: skip
    args = p.parse_args()
    if args.smoke:
        args.model, args.steps, args.warmup, args.repeats = "builtin:tiny-qwen3-moe", 3, 1, 2
    with tempfile.TemporaryDirectory() as tmp:
        runs = {mode: _run(Path(tmp), mode, args) for mode in (("ep2",) if args.smoke else ("ep2", "dp2"))}
    train = {m: statistics.median(r["train"] for r in runs[m]["rows"][args.warmup :]) for m in runs}
    ep2 = runs["ep2"]
    for mode, run in runs.items():
        print(f"{mode}: train phase median {train[mode]:.3f} s, rewards {[round(r['reward'], 3) for r in run['rows']]}")
        print(f"{mode}: push {run['push_s']:.4f} s, engine load of the same tensors {run['load_s']:.4f} s "
              f"({run['push_s'] / run['load_s']:.3f})")  # fmt: skip
    ratio = train["ep2"] / train["dp2"] if "dp2" in train else float("nan")
    print(
        f"ep_over_dp_step={ratio:.3f} push_over_vllm_load={ep2['push_s'] / ep2['load_s']:.3f} "
        f"moe_logprob_diff={max(r['diff'] for r in ep2['rows']):.3g} moe_logprob_diff_replay=nan "
        f"experts_pushed_bytes={ep2['experts_bytes']}"
    )


if __name__ == "__main__":
    main()
