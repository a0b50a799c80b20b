"""yatt_lightning.distributed.wire: the byte model (tier 1, pure) and the counter on 2 gloo processes (tier 2)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

from tests.helpers import spawn_gloo
from yatt_lightning.distributed import wire


def _f32(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float32)


def test_byte_model_of_each_primitive_for_four_ranks():
    """W = 4 ranks, b = 1000 bytes (250 float32):
    broadcast: the root sends b to each of 3 others (3000), a non-root receives b;
    gather: the reverse; all_gather / reduce_scatter: 3 pieces of 1000 each way;
    all_reduce = reduce-scatter + all-gather: 2 * 3/4 * b = 1500 each way;
    all_to_all_single with splits [1, 2, 3, 4] rows of 4 bytes at rank 2: keeps 3 rows, sends 7 (28 B)."""
    b = _f32(250)
    assert wire.bytes_of("broadcast", (b,), {"src": 0}, 4, 0) == (3000, 0)
    assert wire.bytes_of("broadcast", (b,), {"src": 0}, 4, 2) == (0, 1000)
    assert wire.bytes_of("gather", (b,), {"dst": 1}, 4, 1) == (0, 3000)
    assert wire.bytes_of("gather", (b,), {"dst": 1}, 4, 3) == (1000, 0)
    assert wire.bytes_of("scatter", (b, None), {"src": 0}, 4, 3) == (0, 1000)
    assert wire.bytes_of("all_gather", ([_f32(250)] * 4, b), {}, 4, 1) == (3000, 3000)
    assert wire.bytes_of("all_gather_into_tensor", (_f32(1000), b), {}, 4, 1) == (3000, 3000)
    assert wire.bytes_of("reduce_scatter_tensor", (b, _f32(1000)), {}, 4, 0) == (3000, 3000)
    assert wire.bytes_of("all_reduce", (b,), {}, 4, 3) == (1500, 1500)
    assert wire.bytes_of("all_to_all_single", (_f32(10), _f32(10), [1, 2, 3, 4], [1, 2, 3, 4]), {}, 4, 2) == (28, 28)
    assert wire.bytes_of("send", (b,), {"dst": 1}, 4, 0) == (1000, 0)
    assert wire.bytes_of("irecv", (b,), {"src": 0}, 4, 1) == (0, 1000)
    assert wire.bytes_of("barrier", (), {}, 4, 0) == (0, 0)
    assert wire.bytes_of("all_reduce", (b,), {}, 1, 0) == (0, 0)  # a group of one moves nothing


def test_an_unknown_category_is_refused():
    with pytest.raises(ValueError, match="'images' is not one of rollout, gradients, control"):
        with wire.category("images"):
            pass


def test_install_wraps_and_uninstall_restores():
    original, inner = dist.all_reduce, dist.distributed_c10d.all_gather
    wire.install()
    try:
        assert dist.all_reduce is not original and dist.all_reduce.__wrapped__ is original
        assert dist.distributed_c10d.all_gather is not inner  # what the object collectives call, by module global
    finally:
        wire.uninstall()
    assert dist.all_reduce is original and dist.distributed_c10d.all_gather is inner and not wire.installed()


# ---------------------------------------------------------------------------------------------- 2 processes
def _rank_main(rank: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    wire.install()
    wire.reset()
    with wire.category("rollout"):
        dist.broadcast(_f32(1000), src=0)  # 4000 B
        dist.gather_object(b"x" * (100 if rank == 0 else 300), [None, None] if rank == 0 else None, dst=0)
    with wire.category("gradients"):
        dist.all_reduce(_f32(1024))  # 4096 B
    dist.all_to_all_single(torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long))  # 64 B
    if rank == 0:
        dist.send(_f32(16), dst=1)  # send calls isend inside: counted once
    else:
        dist.recv(_f32(16), src=0)
    dist.barrier()
    counted = wire.snapshot()
    wire.uninstall()
    dist.all_reduce(_f32(1024))  # not counted any more
    after = wire.snapshot()
    dist.destroy_process_group()
    queue.put((rank, (counted, after)))


def test_two_ranks_count_exact_bytes_per_category():
    """Expected, per rank (W = 2):
    rollout: broadcast of 4000 B (rank 0 sends it, rank 1 receives it); gather_object = an all-gather of
    the sizes (8 B each way) + a gather of both pickles padded to the larger, p = len(pickle(b"x" * 300));
    gradients: all_reduce of 4096 B = 2 * 1/2 * 4096 each way;
    control: all_to_all_single of 64 B (half stays), send/recv of 64 B, a barrier (0 B)."""
    p = len(pickle.dumps(b"x" * 300))
    results = spawn_gloo(_rank_main)
    (c0, a0), (c1, a1) = results[0], results[1]
    assert (c0.sent["rollout"], c0.received["rollout"]) == (4000 + 8, 8 + p)
    assert (c1.sent["rollout"], c1.received["rollout"]) == (8 + p, 4000 + 8)
    for c in (c0, c1):
        assert (c.sent["gradients"], c.received["gradients"]) == (4096, 4096)
        assert c.calls == {"rollout": 3, "gradients": 1, "control": 3, "weights": 0}
    assert (c0.sent["control"], c0.received["control"]) == (32 + 64, 32)
    assert (c1.sent["control"], c1.received["control"]) == (32, 32 + 64)
    assert a0 == c0 and a1 == c1
