"""How a policy's tensors travel between ranks: an index (where each tensor's bytes are) and the buckets.

A tensor travels one of two ways:

* **as it is**: a tensor whose storage is large (``direct_bytes`` or more), mostly its own tensors' and of one
  dtype is sent as its storage's bytes, without a copy. The index keeps its offset and strides, so the
  receiver views it again (the q, k and v of a fused QKV weight are three views of one storage, sent
  once). The sender must not change such a storage until its send is done: the trainer holds its next
  update until then (:meth:`WeightPublisher.flush <yatt_lightning.placement.weight_channel.WeightPublisher>`).
* **packed**: the others are copied into flat byte buckets (each tensor 16-byte aligned) that grow from
  ``first_bytes`` to ``bucket_bytes``, so the first one is on the wire after a short copy.

The buckets are numbered in the order they are complete while the export is read in order (a storage at
its last tensor, a packed bucket when the next tensor does not fit), so a lazy export's buckets can be
sent as it goes, each as soon as it is complete.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

ALIGN = 16  # bytes


@dataclass
class Entry:
    """Where one tensor is: ``nbytes`` bytes at byte ``offset`` of bucket ``bucket``; ``stride`` is None for a
    packed (contiguous) tensor, and its strides for one viewed in its own storage's bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int
    offset: int
    nbytes: int
    stride: tuple[int, ...] | None = None


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _sent_as_they_are(named: list[tuple[str, torch.Tensor]], direct_bytes: int | None) -> dict[int, int]:
    """The storages whose tensors go as they are, each with the position of its last tensor in ``named``."""
    if direct_bytes is None:
        return {}
    covered: dict[int, int] = {}
    dtypes: dict[int, set] = {}
    size: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, (_, tensor) in enumerate(named):
        if tensor.device.type != "cpu":  # a GPU's tensors are copied to host buckets (gloo's wire is host memory)
            continue
        key, size[key] = _storage(tensor)
        covered[key] = covered.get(key, 0) + tensor.numel() * tensor.element_size()
        dtypes.setdefault(key, set()).add(tensor.dtype)
        last[key] = i
    return {
        key: last[key]
        for key in covered
        if key and size[key] >= direct_bytes and 2 * covered[key] >= size[key] and len(dtypes[key]) == 1
    }


def layout(
    named: list[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    first_bytes: int | None = None,
    direct_bytes: int | None = None,
) -> tuple[list[Entry], list[int]]:
    """The index of ``named`` and each bucket's size in bytes. A packed bucket k holds at most
    ``min(bucket_bytes, first_bytes * 2**k)`` (``first_bytes`` defaults to ``bucket_bytes``; a tensor bigger than
    its cap gets a bucket of its own); with ``direct_bytes``, the storages it picks go as they are. Reads only
    shapes and storages: the index is sent before any bucket is filled."""
    direct = _sent_as_they_are(named, direct_bytes)
    cap = bucket_bytes if first_bytes is None else min(first_bytes, bucket_bytes)
    entries: list[Entry] = []
    sizes: list[int] = []
    packed: list[Entry] = []  # the open packed bucket's entries
    size = 0
    viewed: dict[int, list[Entry]] = {}  # storage -> its entries so far
    for i, (name, tensor) in enumerate(named):
        nbytes = tensor.numel() * tensor.element_size()
        key, storage_bytes = _storage(tensor)
        if key in direct:
            entry = Entry(name, tuple(tensor.shape), tensor.dtype, -1, tensor.storage_offset() * tensor.element_size(),
                          nbytes, tuple(tensor.stride()))  # fmt: skip
            viewed.setdefault(key, []).append(entry)
            if i == direct[key]:  # its last tensor: the storage is complete
                for e in viewed.pop(key):
                    e.bucket = len(sizes)
                sizes.append(storage_bytes)
        else:
            offset = size + (-size % ALIGN)
            if size and offset + nbytes > cap:
                for e in packed:
                    e.bucket = len(sizes)
                sizes.append(size)
                packed, cap, offset = [], min(2 * cap, bucket_bytes), 0
            entry = Entry(name, tuple(tensor.shape), tensor.dtype, -1, offset, nbytes)
            packed.append(entry)
            size = offset + nbytes
        entries.append(entry)
    if packed:
        for e in packed:
            e.bucket = len(sizes)
        sizes.append(size)
    return entries, sizes


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s whole storage, as a flat uint8 tensor (no copy)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),))


def fill(
    named, entries: list[Entry], sizes: list[int], new_buffer: Callable[[int], torch.Tensor], check: bool = True
) -> Iterator[tuple[torch.Tensor, bool]]:
    """Each bucket in the index's order, with whether it was packed (a copy the sender may reuse once sent)
    or is a storage's own bytes: ``named`` is read lazily, tensor by tensor, and a bucket comes as soon as
    its last tensor was read. ``named`` must be the index's tensors in order, no more (a policy's names,
    shapes and dtypes are the same in every version); ``check: False`` when the index was just taken of
    ``named`` itself."""
    remaining = [0] * len(sizes)
    for e in entries:
        remaining[e.bucket] += 1
    tensors = iter(named)
    open_: dict[int, torch.Tensor] = {}
    ready: dict[int, tuple[torch.Tensor, bool]] = {}
    next_out = 0
    for e in entries:
        name, tensor = next(tensors, (None, None))
        if check:
            _check(e, name, tensor, sizes)
        if e.stride is not None:
            bucket = open_.get(e.bucket)
            if bucket is None:
                bucket = open_[e.bucket] = storage_bytes(tensor)
            if bucket.data_ptr() != tensor.untyped_storage().data_ptr():
                raise RuntimeError(f"the policy's export changed since its first version: {e.name} is in another storage")
        else:
            bucket = open_.get(e.bucket)
            if bucket is None:
                bucket = open_[e.bucket] = new_buffer(sizes[e.bucket])
            bucket[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(tensor.detach())
        remaining[e.bucket] -= 1
        if not remaining[e.bucket]:
            ready[e.bucket] = (open_.pop(e.bucket), e.stride is None)
        while next_out in ready:
            yield ready.pop(next_out)
            next_out += 1
    if next(tensors, None) is not None:
        raise RuntimeError(f"the policy exports more tensors than the {len(entries)} of its first version")


def _check(e: Entry, name, tensor, sizes: list[int]) -> None:
    same = name == e.name and tuple(tensor.shape) == e.shape and tensor.dtype == e.dtype
    if same and e.stride is not None:
        same = (tuple(tensor.stride()) == e.stride and tensor.storage_offset() * tensor.element_size() == e.offset
                and tensor.untyped_storage().nbytes() == sizes[e.bucket])  # fmt: skip
    if not same:
        got = "nothing" if name is None else f"{name} {tuple(tensor.shape)} {tensor.dtype}"
        raise RuntimeError(
            f"the policy's export changed since its first version: expected {e.name} {e.shape} {e.dtype}, got {got}"
        )


def pack(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[list[Entry], list[torch.Tensor]]:
    """The tensors as flat byte buckets (:func:`layout`), each a copy, and the index that unpacks them."""
    entries, sizes = layout(named, bucket_bytes)
    new = lambda size: torch.empty(size, dtype=torch.uint8)  # noqa: E731
    return entries, [bucket for bucket, _ in fill(named, entries, sizes, new)]


def parts(bucket: torch.Tensor, part_bytes: int | None) -> list[torch.Tensor]:
    """``bucket`` as the consecutive slices of at most ``part_bytes`` it travels in (one broadcast each; None:
    whole). Both ends split alike."""
    return list(bucket.split(part_bytes)) if part_bytes is not None and bucket.numel() > part_bytes else [bucket]


def unpack(entries: list[Entry], buckets: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of the index, viewing the received buckets (no copy)."""
    out = []
    for e in entries:
        bucket = buckets[e.bucket]
        if e.stride is None:
            tensor = bucket[e.offset : e.offset + e.nbytes].view(e.dtype).reshape(e.shape)
        else:
            tensor = bucket.view(e.dtype).as_strided(e.shape, e.stride, e.offset // e.dtype.itemsize)
        out.append((e.name, tensor))
    return out


class BufferPool:
    """Byte buffers by size, reused: a version's buckets have the sizes of the last one, and fresh pages
    cost a fault each on first touch (about as much as the copy into them on this machine). Thread-safe (a
    rollout rank's receiving thread takes, the rank puts back what its engine copied in)."""

    def __init__(self) -> None:
        self.free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def get(self, size: int) -> torch.Tensor:
        with self._lock:
            spare = self.free.get(size)
            if spare:
                return spare.pop()
        return torch.empty(size, dtype=torch.uint8)

    def put(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for b in buffers:
                self.free.setdefault(b.numel(), []).append(b)
