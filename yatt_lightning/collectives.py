"""Moving Python objects between ranks point to point, without routing them through one rank."""

from __future__ import annotations

import pickle

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
