"""Tier 1: checkpoint files written past the page cache are byte-exact, durable, and described as written."""

import os
import zlib

import pytest
import torch

from yatt_lightning.checkpoint import direct_io
from yatt_lightning.checkpoint.direct_io import CHUNK, DirectFile, take_description
from yatt_lightning.checkpoint.verify import _crc32


@pytest.mark.parametrize("direct", [True, False])
def test_every_size_is_written_exactly_and_described_as_written(direct, tmp_path, monkeypatch):
    if not direct:  # as where O_DIRECT does not exist: the same stream through the page cache
        monkeypatch.delattr(os, "O_DIRECT")
    root = tmp_path
    rng = torch.Generator().manual_seed(0)
    for size in (0, 1, 4095, CHUNK - 1, CHUNK, CHUNK + 5, 2 * CHUNK + 4097):
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=rng).numpy().tobytes()
        path = os.path.join(root, f"yatt-direct-{os.getpid()}-{size}.bin")
        try:
            f = DirectFile(path)
            for i in range(0, size, 1000_003):  # writes that straddle chunks
                f.write(data[i : i + 1000_003])
            assert f.tell() == size
            f.close()
            with open(path, "rb") as r:
                assert r.read() == data
            assert take_description(path) == (size, zlib.crc32(data)) == (size, _crc32(path))
            assert take_description(path) is None  # given once: a later write of that path is described anew
        finally:
            os.unlink(path)
    assert f.direct == direct


def test_torch_save_through_it_loads_back_and_a_changed_file_is_read_again(tmp_path):
    tensors = {"a": torch.randn(1000, 300), "b": torch.arange(7)}
    path = tmp_path / "t.pt"
    f = DirectFile(path)
    torch.save(tensors, f)
    f.close()
    back = torch.load(path)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    with open(path, "ab") as g:
        g.write(b"x")  # changed after it was closed: its recorded size no longer matches
    assert take_description(path) is None
    assert not direct_io._described
