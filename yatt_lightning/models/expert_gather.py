"""Every expert of a mixture-of-experts layer, from the expert-parallel ranks that each hold some of them.

Each rank holds ``local`` whole experts (``...local_experts.<i>...``, expert ``rank * local + i``); an engine
needs them all. Two transports, one result (every rank gets every expert, under its global number, as
tensors of its own):

* **all-gather** (NCCL, or ranks on several hosts): one layer at a time (never the whole model on one rank at
  once), the layer's local expert tensors travel as one flat buffer in one all-gather over the
  expert-parallel group (per-tensor collectives cost a round trip each).
* **shared memory** (a gloo group whose ranks are all on this host): gloo's all-gather runs over TCP even
  between processes of one host (25 MB of experts a rank: 28-46 ms here, as much as the engine's own load of
  the whole model). Instead each rank writes its experts into a file of ``/dev/shm`` that every rank of the
  group has mapped, and reads the others' where they lie: one memory copy and two barriers (4-7 ms). The
  files are unlinked as soon as every rank has mapped them, so a rank that dies leaves nothing in ``/dev/shm``.

Like the parameters an export yields as they are (which the next optimizer step changes), another rank's
experts are views: that rank writes them again at the next exchange, which starts only once every rank has
finished iterating this one. Copy what you keep past it.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator

import torch

from yatt_lightning.models.hf_weights import global_expert

_SHM = "/dev/shm"


def _layer_of(name: str) -> str:
    return name.split(".local_experts.", 1)[0]


def _by_layer(named: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    layers: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        layers.setdefault(_layer_of(name), []).append((name, tensor))
    return list(layers.values())


def _named(tensors: list[tuple[str, torch.Tensor]], flat: torch.Tensor, first_expert: int) -> Iterator[tuple[str, torch.Tensor]]:
    offset = 0
    for name, t in tensors:
        yield global_expert(name, first_expert), flat[offset : offset + t.numel()].view(t.shape)
        offset += t.numel()


def gather_experts(named: list[tuple[str, torch.Tensor]], local: int, group) -> Iterator[tuple[str, torch.Tensor]]:
    """(Megatron name with the global expert number, full tensor) for every expert of every layer in ``named``
    (this rank's local expert tensors, in parameter order), by one all-gather a layer into new tensors;
    collective over ``group``."""
    ranks = torch.distributed.get_world_size(group)
    for tensors in _by_layer(named):
        flat = torch.cat([t.reshape(-1) for _, t in tensors])
        gathered = [torch.empty_like(flat) for _ in range(ranks)]
        torch.distributed.all_gather(gathered, flat, group=group)
        for rank, buffer in enumerate(gathered):
            yield from _named(tensors, buffer, rank * local)


class ExpertExchange:
    """The expert-parallel group's transport for :meth:`gather`, chosen at the first call (collective then):
    shared memory where the group is gloo's and all its ranks are on this host, else the all-gather."""

    def __init__(self, group) -> None:
        self.group = group
        self.rank = torch.distributed.get_rank(group)
        self.ranks = torch.distributed.get_world_size(group)
        self._shared: bool | None = None
        self._buffers: list[torch.Tensor] = []  # every rank's mapped file, this rank's included

    @property
    def shared(self) -> bool:
        if self._shared is None:
            here = [None] * self.ranks
            mine = (socket.gethostname(), os.path.isdir(_SHM))
            torch.distributed.all_gather_object(here, mine, group=self.group)
            self._shared = torch.distributed.get_backend(self.group) == "gloo" and all(h == mine and h[1] for h in here)
        return self._shared

    def gather(self, named: list[tuple[str, torch.Tensor]], local: int) -> Iterator[tuple[str, torch.Tensor]]:
        """What :func:`gather_experts` yields, through this host's shared memory where it can be."""
        dtypes = {t.dtype for _, t in named}
        if not named or not self.shared or len(dtypes) != 1 or any(t.device.type != "cpu" for _, t in named):
            yield from gather_experts(named, local, self.group)
            return
        layers = _by_layer(named)
        sizes = [sum(t.numel() for _, t in tensors) for tensors in layers]
        self._map(sum(sizes), dtypes.pop())
        torch.distributed.barrier(group=self.group)  # every rank has finished reading the previous exchange
        mine, offset = self._buffers[self.rank], 0
        for tensors in layers:
            for _, t in tensors:
                mine[offset : offset + t.numel()].view(t.shape).copy_(t)
                offset += t.numel()
        torch.distributed.barrier(group=self.group)  # every rank's experts are written
        offset = 0
        for tensors, size in zip(layers, sizes, strict=True):
            for rank, buffer in enumerate(self._buffers):
                if rank == self.rank:
                    for name, t in tensors:
                        yield global_expert(name, rank * local), t
                else:
                    yield from _named(tensors, buffer[offset : offset + size], rank * local)
            offset += size

    def _map(self, numel: int, dtype: torch.dtype) -> None:
        """Every rank's file of ``numel`` elements, mapped here (once; again if the size or dtype changes)."""
        if self._buffers and self._buffers[0].numel() == numel and self._buffers[0].dtype == dtype:
            return
        path = os.path.join(_SHM, f"yatt-experts-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        paths = [None] * self.ranks
        torch.distributed.all_gather_object(paths, path, group=self.group)
        own = torch.from_file(path, shared=True, size=numel, dtype=dtype)  # creates the file
        try:
            torch.distributed.barrier(group=self.group)  # every file exists
            self._buffers = [own if p == path else torch.from_file(p, shared=True, size=numel, dtype=dtype) for p in paths]
            torch.distributed.barrier(group=self.group)  # every rank has mapped every file
        finally:
            os.unlink(path)  # the mappings stay; the name goes
