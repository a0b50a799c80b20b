"""The built-in models' cache: a damaged folder is moved aside and rebuilt; concurrent builds all get a whole folder.

Why a build once left a folder holding only the tokenizer's files: transformers 5.19's ``save_pretrained``
writes nothing on a rank other than 0 of an initialised process group, and the tokenizer's still writes; a
judge built on rank 1 renamed that half folder into the cache, and every later build failed on it
(``OSError: [Errno 39] Directory not empty``). The 4-process test below builds under such a group.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tests.helpers import spawn_gloo

pytestmark = pytest.mark.distributed


def _build_rounds(rank: int, port: int, queue) -> None:
    """Rank ``rank`` of 4 builds the tiny model at the same moment as the others, on an empty cache, 10 times."""
    import json

    import torch.distributed as dist
    from safetensors import safe_open

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    from yatt_lightning.models import build_cache, tiny

    root = Path(os.environ["YATT_TEST_ROOT"])
    results = []
    for round_ in range(10):
        os.environ["YATT_CACHE"] = str(root / f"round{round_}")
        dist.barrier()  # every rank starts its build at once
        try:
            folder = tiny.build_tiny_qwen2()
            problem = build_cache.incomplete(folder)
            with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
                tensors = len(list(f.keys()))
            config = json.loads((folder / "config.json").read_text())["model_type"]
            results.append((problem, tensors, config, sorted(p.name for p in folder.iterdir())))
        except Exception as err:  # reported, not raised: the other ranks must not wait in the barrier
            results.append((f"{type(err).__name__}: {err}", 0, None, []))
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, results))


def test_four_processes_building_at_once_on_an_empty_cache_all_get_a_whole_folder_ten_times(tmp_path, monkeypatch):
    monkeypatch.setenv("YATT_TEST_ROOT", str(tmp_path))
    results = spawn_gloo(_build_rounds, world=4, timeout=240)
    expected = [".yatt-build.json", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json"]  # fmt: skip
    for rank, rounds in results.items():
        assert len(rounds) == 10
        for round_, (problem, tensors, model_type, files) in enumerate(rounds):
            assert problem is None, f"rank {rank}, round {round_}: {problem}"
            assert (tensors, model_type, files) == (27, "qwen2", expected), f"rank {rank}, round {round_}"
    for round_ in range(10):  # one folder per round: nothing moved aside, no temporary folder left over
        folders = [p.name for p in (tmp_path / f"round{round_}").iterdir() if p.is_dir()]
        assert len(folders) == 1 and folders[0].startswith("tiny-qwen2-"), folders


def test_a_damaged_folder_is_moved_aside_and_rebuilt(tmp_path, monkeypatch, caplog):
    """The folder such a build left (only the tokenizer's files, no manifest), and one whose weights were
    truncated after it was built: each is moved aside, named in the log, and built again."""
    from yatt_lightning.models import build_cache, tiny

    monkeypatch.setenv("YATT_CACHE", str(tmp_path))
    folder = tiny.build_tiny_qwen2()
    good = (folder / "model.safetensors").read_bytes()
    for damage in ("only the tokenizer", "truncated weights"):
        if damage == "only the tokenizer":
            for name in ("config.json", "generation_config.json", "model.safetensors", build_cache.BUILD_MANIFEST):
                (folder / name).unlink()
            why = "no build manifest; it holds tokenizer.json, tokenizer_config.json"
        else:
            (folder / "model.safetensors").write_bytes(good[: len(good) // 2])
            why = f"model.safetensors is {len(good) // 2} bytes, not {len(good)}"
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="yatt_lightning.models.build_cache"):
            assert tiny.build_tiny_qwen2() == folder
        warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warning) == 1 and f"is incomplete ({why}): moved it aside to" in warning[0], warning
        aside = Path(warning[0].split("moved it aside to ")[1].split(";")[0])
        assert aside.is_dir() and aside.parent == tmp_path and aside.name.startswith(folder.name + ".incomplete-")
        assert build_cache.incomplete(folder) is None and (folder / "model.safetensors").read_bytes() == good
    assert tiny.build_tiny_qwen2() == folder  # whole: nothing moved, nothing built
    assert len([p for p in tmp_path.iterdir() if ".incomplete-" in p.name]) == 2


def test_a_build_that_writes_no_weights_is_refused_and_leaves_nothing(tmp_path):
    from yatt_lightning.models import build_cache

    def tokenizer_only(folder: Path) -> None:
        (folder / "tokenizer.json").write_text("{}")

    with pytest.raises(RuntimeError, match=r"wrote no config\.json, weights \(it holds tokenizer\.json\)"):
        build_cache.build_once(tmp_path / "model", tokenizer_only)
    assert [p.name for p in tmp_path.iterdir()] == ["model.lock"]
