"""yatt_lightning.models.expert_gather: the shared-memory exchange of experts gives what the all-gather gives
(tier 2: 3 gloo processes, every exchange after the parameters moved), overwrites nothing a slow rank still
reads, and leaves no file in /dev/shm."""

from __future__ import annotations

import glob
import os
import time

import torch
import torch.distributed as dist

from tests.helpers import spawn_gloo
from yatt_lightning.models.expert_gather import ExpertExchange, gather_experts

LOCAL = 2  # experts a rank


def _local_experts(rank: int, step: int) -> list[tuple[str, torch.Tensor]]:
    out = []
    for layer in range(2):
        for i in range(LOCAL):
            for proj, shape in (("linear_fc1", (4, 3)), ("linear_fc2", (3, 2))):
                name = f"decoder.layers.{layer}.mlp.experts.local_experts.{i}.{proj}.weight"
                value = 1000.0 * rank + 100.0 * layer + 10.0 * i + step
                out.append((name, torch.full(shape, value) + torch.arange(shape[0] * shape[1]).view(shape) / 100))
    return out


def _rank_main(rank: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    exchange, out = ExpertExchange(dist.group.WORLD), {"same": [], "files": None}
    for step in range(3):  # the parameters move between pushes, as training moves them
        named = _local_experts(rank, step)
        shared = list(exchange.gather(named, LOCAL))
        if step == 0:
            out["files"] = glob.glob(f"/dev/shm/yatt-experts-{os.getpid()}-*")
        reference = list(gather_experts(_local_experts(rank, step), LOCAL, dist.group.WORLD))
        out["same"].append(
            [n for n, _ in shared] == [n for n, _ in reference]
            and all(torch.equal(a, b) for (_, a), (_, b) in zip(shared, reference, strict=True))
        )
    # Another rank's experts are views of its file: it writes them again only once every rank has finished
    # iterating. Rank 0 reads slowly; ranks 1 and 2 go straight on to their next exchange with new values.
    expected = {n: t.clone() for n, t in gather_experts(_local_experts(rank, 7), LOCAL, dist.group.WORLD)}
    seen = {}
    for name, tensor in exchange.gather(_local_experts(rank, 7), LOCAL):
        if rank == 0:
            time.sleep(0.02)
        seen[name] = tensor
    out["held"] = all(torch.equal(seen[n], expected[n]) for n in expected) if rank == 0 else True
    list(exchange.gather(_local_experts(rank, 8), LOCAL))
    out["shared"] = exchange.shared
    out["names"] = sorted({n.split(".local_experts.")[1].split(".")[0] for n, _ in shared}, key=int)
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, out))


def test_three_ranks_exchange_their_experts_through_shared_memory_as_the_all_gather_would():
    results = spawn_gloo(_rank_main, world=3)
    for rank, out in results.items():
        assert out["shared"], rank  # gloo, one host: the shared-memory transport
        assert out["same"] == [True, True, True], rank
        assert out["held"], rank  # no rank overwrote what rank 0 was still reading
        assert out["names"] == [str(e) for e in range(3 * LOCAL)], rank  # every expert under its global number
        assert out["files"] == [], rank  # each rank's file is unlinked once all have mapped it
