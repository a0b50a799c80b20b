"""Rank 0's bytes and memory as data-parallel ranks grow, with an image of about 1 MB in every prompt.

Trains a few GRPO steps of ``configs/grpo_vlm_tiny.yaml`` (the tiny LLaVA) with 1, 2 and 4 data-parallel
processes (4 on 2 cores is fine: this measures bytes and memory, not speed) under both controllers, on
the same rows: every prompt names a PNG of random noise of about 1 MB on disk (600 x 600 px).

- ParallelController: each rank draws its rows, reads its own images and keeps them; its engine gets the
  decoded images of its prompts, its training forward the pixels of its samples.
- SingleController as a driver design runs it (``driver_loads_rows``): rank 0 loads every rank's rows and
  generates every prompt, so it reads every rank's images; the ranks get their rows' references from it
  (never pixels) and read their own images for training.

Bytes are counted at the process-group level by :mod:`yatt_lightning.distributed.wire` (every collective and
point-to-point call), both directions, per step after one warm-up step, at rank 0; memory is rank 0's
peak resident set (``ru_maxrss``).

    python bench/multimodal_controller.py [--smoke] [--steps 3] [--sizes 1,2,4]

Last line: ``rank0_peak_mem_growth=<peak at the most ranks / at 1 rank, parallel> single_controller_growth=
<the same, single>``; target at most 1.1 for the parallel controller. ``--smoke``: sizes 1 and 2, one
measured step, 64 KB images, the parallel controller only (``single_controller_growth=nan``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from controller_scaling import WARMUP, _child, measure

BATCH = 4  # prompts per data-parallel rank per step
VLM = str(Path(__file__).resolve().parents[1] / "configs" / "grpo_vlm_tiny.yaml")
MODES = {
    "parallel": ["--trainer.strategy.controller", "yatt_lightning.rollout.controller.ParallelController"],
    "single": ["--trainer.strategy.controller", "yatt_lightning.rollout.controller.SingleController",
               "--trainer.strategy.controller.driver_loads_rows", "true"],
}  # fmt: skip


def write_rows(folder: Path, num_rows: int, side: int) -> Path:
    """``num_rows`` rows, each with its own PNG of random noise (``side`` px square, ~3 bytes a pixel)."""
    import numpy as np
    from PIL import Image

    (folder / "img").mkdir(parents=True)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(num_rows):
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(folder / "img" / f"{i}.png")
        lines.append(json.dumps({"prompt": "<image>\ncolour:", "images": [f"img/{i}.png"], "answer": "red"}))
    (folder / "rows.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "rows.jsonl"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sizes", default="1,2,4")
    p.add_argument("--child", nargs=argparse.REMAINDER)
    args = p.parse_args()
    if args.child:
        _child(Path(args.child[0]), args.child[1:], config=VLM)
        return
    side, modes = 600, MODES
    if args.smoke:  # the parallel controller only (the suite's time): the single one runs at full size
        args.steps, args.sizes, side, modes = 1, "1,2", 150, {"parallel": MODES["parallel"]}
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows = write_rows(Path(tmp) / "data", BATCH * max(sizes) * (args.steps + WARMUP), side)
        mb = (Path(tmp) / "data" / "img" / "0.png").stat().st_size / 1e6
        print(f"rank 0, per step ({args.steps} measured after {WARMUP} warm-up; {BATCH} prompts per rank, one "
              f"{mb:.2f} MB image each); bytes sent + received", flush=True)  # fmt: skip
        print(f"{'controller':<9} {'dp':>2} {'total':>12} {'rollout':>12} {'gradients':>12} {'control':>10}  peak RSS")
        for mode, flags in modes.items():
            for dp in sizes:
                overrides = [
                    "--trainer.max_steps", str(args.steps + WARMUP), "--trainer.devices", str(dp),
                    *flags, "--data.path", str(rows), "--data.task", "null", "--data.batch_size", str(BATCH),
                    "--data.max_image_pixels", str(side * side),
                ]  # fmt: skip
                results[(mode, dp)] = measure(Path(__file__), Path(tmp), mode, dp, overrides)
    growth = {m: results[(m, max(sizes))]["peak_rss_mib"] / results[(m, min(sizes))]["peak_rss_mib"] for m in modes}
    single = f"{growth['single']:.3f}" if "single" in growth else "nan"
    print(f"rank0_peak_mem_growth={growth['parallel']:.3f} single_controller_growth={single}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
