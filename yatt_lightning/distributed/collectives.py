"""Moving Python objects between ranks point to point, without routing them through one rank."""

from __future__ import annotations

import pickle
from typing import Any

import torch


def exchange_objects(outgoing: list, group=None) -> tuple[list, int]:
    """All-to-all of Python objects: ``outgoing[d]`` goes to the group's rank ``d``.

    Returns the objects received (index = source rank in the group) and the bytes this rank received
    from others. Two ``all_to_all_single`` calls: sizes, then the pickled payloads.
    """
    size = torch.distributed.get_world_size(group)
    me = torch.distributed.get_rank(group)
    if len(outgoing) != size:
        raise ValueError(f"exchange_objects: {len(outgoing)} outgoing objects for a group of {size}")
    payloads = [pickle.dumps(o) for o in outgoing]
    send_sizes = torch.tensor([len(p) for p in payloads], dtype=torch.long)
    recv_sizes = torch.empty_like(send_sizes)
    torch.distributed.all_to_all_single(recv_sizes, send_sizes, group=group)
    send = (
        torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
        if send_sizes.sum()
        else torch.empty(0, dtype=torch.uint8)
    )
    recv = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8)
    torch.distributed.all_to_all_single(
        recv, send, output_split_sizes=recv_sizes.tolist(), input_split_sizes=send_sizes.tolist(), group=group
    )
    received, offset = [], 0
    for n in recv_sizes.tolist():
        received.append(pickle.loads(recv[offset : offset + n].numpy().tobytes()))
        offset += n
    return received, int(recv_sizes.sum() - recv_sizes[me])


def exchange_tensors(outgoing: list[dict[str, torch.Tensor]], group=None) -> tuple[list[dict[str, torch.Tensor]], int]:
    """All-to-all of tensors, no pickling: ``outgoing[d]`` (a dict of tensors) goes to the group's rank ``d``.

    Every rank sends the same keys with the same dtypes and trailing shapes; only the first dimension
    may differ. Returns the dicts received (index = source rank) and the bytes received from others.
    One ``all_to_all_single`` for the sizes, then one per key.
    """
    size = torch.distributed.get_world_size(group)
    me = torch.distributed.get_rank(group)
    if len(outgoing) != size:
        raise ValueError(f"exchange_tensors: {len(outgoing)} outgoing dicts for a group of {size}")
    keys = sorted(outgoing[0])
    send_sizes = torch.tensor([[len(o[k]) for k in keys] for o in outgoing], dtype=torch.long)
    recv_sizes = torch.empty_like(send_sizes)
    torch.distributed.all_to_all_single(recv_sizes, send_sizes, group=group)
    received: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    nbytes = 0
    for j, key in enumerate(keys):
        send = torch.cat([o[key] for o in outgoing]).contiguous()
        counts = recv_sizes[:, j].tolist()
        recv = torch.empty((sum(counts), *send.shape[1:]), dtype=send.dtype)
        torch.distributed.all_to_all_single(
            recv, send, output_split_sizes=counts, input_split_sizes=send_sizes[:, j].tolist(), group=group
        )
        for src, part in enumerate(torch.split(recv, counts)):
            received[src][key] = part
            if src != me:
                nbytes += part.numel() * part.element_size()
    return received, nbytes


# ---------------------------------------------------------------------------------------------- point to point
def isend_object(obj, dst: int, group=None) -> list:
    """Send a pickled object to ``dst`` without waiting: its size, then its bytes. Returns the requests
    (wait on them before reusing anything the object shares)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.long)
    return [torch.distributed.isend(size, dst, group=group), torch.distributed.isend(payload, dst, group=group)]


def recv_object(src: int, group=None) -> Any:
    """Receive one object :func:`isend_object` sent from ``src``."""
    return PendingObject(src, group).take()


class PendingObject:
    """An object being received from ``src``: its size is posted at once, so :meth:`ready` can poll."""

    def __init__(self, src: int, group=None) -> None:
        self.src, self.group = src, group
        self.size = torch.empty(1, dtype=torch.long)
        self.request = torch.distributed.irecv(self.size, src, group=group)

    def ready(self) -> bool:
        return self.request.is_completed()

    def take(self) -> Any:
        self.request.wait()
        payload = torch.empty(int(self.size), dtype=torch.uint8)
        torch.distributed.recv(payload, self.src, group=self.group)
        return pickle.loads(payload.numpy().tobytes())


# ---------------------------------------------------------------------------------------------- through one rank
def gather_objects(obj, dst: int = 0) -> list | None:
    """Every rank's ``obj`` at ``dst`` (index = rank; ``None`` elsewhere)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [obj]
    out = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == dst else None
    torch.distributed.gather_object(obj, out, dst=dst)
    return out


def scatter_objects(parts: list | None, src: int = 0) -> Any:
    """``parts[r]`` (given on ``src``, ``None`` elsewhere) to each rank ``r``."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return parts[0]
    received = [None]
    torch.distributed.scatter_object_list(received, parts, src=src)
    return received[0]
