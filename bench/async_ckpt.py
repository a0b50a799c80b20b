"""How long does saving block the training loop: asynchronous versus synchronous checkpoints?

One training run of a random-initialised Qwen2-style model (``--size medium``: ~50M parameters,
checkpoints of ~600 MB with the Adam state; ``--size small``: the ~18M built-in ``small-qwen2``, ~210 MB)
saves in a repeating 4-step pattern: an asynchronous save, a step without a save (the writers finish
in the background and the save is finalised at the safe point), a synchronous save, a step without a
save. The blocked time of an asynchronous save is everything the step loop spent in checkpoint code for
it (scheduling, the fork, finalisation); the time of a synchronous save is the whole save. Side by side
in one run, same model, same state sizes.

    python bench/async_ckpt.py [--size medium|small] [--trainer.max_steps 18]

Last line: ``stall_ratio=<blocked time of async saves / time of sync saves>``; target below 0.2.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import build_cli
from lightning.pytorch import Callback
from yatt_lightning.callbacks import AsyncCheckpoint

WARMUP = 2
MEDIUM = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12,
          "num_key_value_heads": 4, "head_dim": 64}  # fmt: skip


class Alternate(Callback):
    """Runs after AsyncCheckpoint in the callback list: schedules the saves and times the loop's share."""

    def __init__(self, saver: AsyncCheckpoint) -> None:
        self.saver = saver
        self.async_blocked: list[float] = []
        self.sync_times: list[float] = []
        self._stall_before = 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._stall_before = self.saver.stall_seconds

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        finalize = self.saver.stall_seconds - self._stall_before  # the saver's own safe-point work
        phase = (batch_idx - WARMUP) % 4
        if batch_idx < WARMUP:
            return
        if phase == 1:  # the step after an async save: its finalisation belongs to that save
            self.async_blocked[-1] += finalize
        t0 = time.perf_counter()
        if phase == 0:
            self.saver.save(trainer, asynchronous=True)
            self.async_blocked.append(time.perf_counter() - t0)
        elif phase == 2:
            self.saver._finalize(trainer, blocking=True)  # never needed in practice; counted if it were
            self.async_blocked[-1] += time.perf_counter() - t0
            t1 = time.perf_counter()
            self.saver.save(trainer, asynchronous=False)
            self.sync_times.append(time.perf_counter() - t1)


def main() -> None:
    from yatt_lightning.models.tiny import SMALL_QWEN2, TINY_QWEN2_SHAPE, build_tiny_qwen2

    args = sys.argv[1:]
    size = "medium"
    if "--size" in args:
        i = args.index("--size")
        size = args[i + 1]
        del args[i : i + 2]
    model = SMALL_QWEN2 if size == "small" else str(build_tiny_qwen2(shape={**TINY_QWEN2_SHAPE, **MEDIUM}))
    with tempfile.TemporaryDirectory() as tmp:
        cli = build_cli(
            ["--model.policy.path", model, "--trainer.max_steps", "18", "--data.batch_size", "8",
             "--model.sampling.n", "4", *args]
        )  # fmt: skip
        saver = AsyncCheckpoint(dirpath=tmp, every_n_steps=None, keep_last=2, save_at_end=False)
        alt = Alternate(saver)
        cli.trainer.callbacks.extend([saver, alt])
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        if not cli.trainer.is_global_zero:
            return
        newest = max(Path(tmp).glob("step-*"), key=lambda p: p.name)
        size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
    a, s = statistics.mean(alt.async_blocked), statistics.mean(alt.sync_times)
    print(
        f"checkpoint size: {size / 2**20:.0f} MiB; saves measured: {len(alt.async_blocked)} async, {len(alt.sync_times)} sync"
    )
    print(
        f"async: loop blocked {a * 1000:8.1f} ms per save  (each: {', '.join(f'{x * 1000:.0f}' for x in alt.async_blocked)})"
    )
    print(
        f"sync:  loop blocked {s * 1000:8.1f} ms per save  (each: {', '.join(f'{x * 1000:.0f}' for x in alt.sync_times)})"
    )
    print(f"stall_ratio={a / s:.3f}", flush=True)


if __name__ == "__main__":
    main()
