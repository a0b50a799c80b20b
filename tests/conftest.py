"""Test hygiene: no process group or environment change leaks between tests; shared tiny model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _restore_environment():
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from yatt_lightning.models.tiny import build_tiny_qwen2

    return build_tiny_qwen2()


@pytest.fixture
def python() -> str:
    return sys.executable


def pytest_collection_modifyitems(config, items):
    """The slow tests (real runs, 20-150 s each) first, in their files' order, then the rest: pytest-xdist's
    workers then end together on short tests, where slow tests collected last (the soak test, validation, the
    user models) left one worker alone on a minutes-long test while the other idled (an idle core is a quarter of
    a 2-core machine's suite)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
