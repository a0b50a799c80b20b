"""How a million-row Parquet file starts: the first open, and what each data-parallel rank pays for its share.

Writes a GSM8K-shaped Parquet file in verl's column layout (``data_source``, ``prompt`` as chat messages,
``reward_model.ground_truth``, ``extra_info``) with ``datasets``, then:

* **first open**: a fresh process opens it through ``PromptDataModule`` as ``yatt fit``'s preflight does
  (the one conversion to memory-mapped Arrow, into the yatt cache) and reads a row;
* **each rank**: ``--ranks`` fresh processes at once, each its data-parallel share (the sampler of rank r of
  R), open the data module, build the data loader and draw ``--batches`` batches of 16 rows: the seconds from
  before the open to the first batch, and the growth of the process's anonymous memory (``RssAnon``: what the
  rank holds itself; the mapped file's pages are the OS's shared page cache, which it drops under pressure)
  over the open and the batches. Reading every row into a list, as a JSON-lines file is read, holds about a
  kilobyte per row in every rank.

    python bench/data_scale.py [--rows 1000000] [--ranks 2] [--batches 20] [--smoke]

Last line: ``rows=N first_open_s=A rank_first_batch_s=B rank_anon_mb=C``, B and C the largest over the ranks;
targets for a million rows: A + B under 30 s, C under 200. ``--smoke``: 100,000 rows (a list of them would hold
about 100 MB per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUESTION = ("Natalia sold clips to {i} of her friends in April, and then she sold half as many clips in May. How many "
            "clips did Natalia sell altogether in April and May? Let's think step by step and output the final "
            "answer after \"####\".")  # fmt: skip


def write(path: Path, rows: int) -> None:
    import datasets

    datasets.disable_progress_bars()

    def gen():
        for i in range(rows):
            yield {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": QUESTION.format(i=i)}],
                   "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + i // 2)},
                   "extra_info": {"split": "train", "index": i}}  # fmt: skip

    datasets.Dataset.from_generator(gen, cache_dir=str(path.parent / "gen")).to_parquet(str(path))


def anon_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def child(path: str, replicas: int, rank: int, batches: int) -> None:
    """One process: open the data module as rank ``rank`` of ``replicas`` and draw ``batches`` batches."""
    from yatt_lightning.datamodules.prompt import PromptDataModule

    before, t0 = anon_kb(), time.perf_counter()
    data = PromptDataModule(path=path, batch_size=16, seed=0)
    data.shard = lambda: (replicas, rank)  # noqa: E731 (the sampler's share, without a trainer)
    data.setup("fit")
    loader = iter(data.train_dataloader())
    first = next(loader)
    first_s = time.perf_counter() - t0
    for _ in range(batches - 1):
        next(loader)
    assert first[0]["answer"] and first[0]["messages"], first[0]
    print(json.dumps({"first_batch_s": first_s, "anon_mb": (anon_kb() - before) / 1024}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--child", nargs=4)
    args = p.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]), int(args.child[3]))
        return
    if args.smoke:
        args.rows = 100_000
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "YATT_CACHE": str(Path(tmp) / "cache"), "OMP_NUM_THREADS": "1"}
        path = Path(tmp) / "train.parquet"
        t0 = time.perf_counter()
        write(path, args.rows)
        print(f"wrote {args.rows} rows, {path.stat().st_size / 1e6:.1f} MB of Parquet in {time.perf_counter() - t0:.1f} s",
              flush=True)  # fmt: skip
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--child", str(path), "1", "0", "1"], env=env, check=True,
                       capture_output=True)  # fmt: skip
        first_open = time.perf_counter() - t0
        procs = [subprocess.Popen([sys.executable, __file__, "--child", str(path), str(args.ranks), str(r),
                                   str(args.batches)], env=env, stdout=subprocess.PIPE, text=True)  # fmt: skip
                 for r in range(args.ranks)]
        ranks = [json.loads(proc.communicate()[0].strip().splitlines()[-1]) for proc in procs]
    for r, figures in enumerate(ranks):
        print(f"rank {r}: first batch {figures['first_batch_s']:.2f} s after opening, anonymous memory "
              f"+{figures['anon_mb']:.1f} MB over {args.batches} batches")  # fmt: skip
    print(f"(first open: a process's start, imports and the conversion to Arrow: {first_open:.1f} s)")
    print(f"rows={args.rows} first_open_s={first_open:.2f} rank_first_batch_s={max(f['first_batch_s'] for f in ranks):.2f} "
          f"rank_anon_mb={max(f['anon_mb'] for f in ranks):.1f}")  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
