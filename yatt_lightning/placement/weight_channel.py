"""Disaggregated placement's weight channel: the trainers publish policy versions, the rollout ranks apply them.

One trainer (global rank 0, the head of data-parallel rank 0's model-parallel group) broadcasts on a
group of itself and the rollout ranks. Every message starts with a fixed-size header (kind, version, the
trainer's consumed step, the size of what follows), so a rollout rank can post the header's receive and
poll it between its own steps without blocking. A ``WEIGHTS`` message then carries its tensor index (only
when it differs from the last one sent: a policy's names and shapes do not change from version to
version, so the header's size is ``SAME_INDEX`` and the buckets follow it at once) and the tensors packed
into buckets (one broadcast each) that grow from ``FIRST_BUCKET`` to ``bucket_bytes``, so the first
one is on the wire after a short copy and each later copy overlaps the send before it; an ``ACK`` carries
nothing (a step whose batch was dropped: no new version, but the producer learns the trainer moved on);
a ``FAILURE`` carries the trainer's cause; a ``DECISION`` carries the trainers' :class:`SaveDecision` of a
step (checkpoint and stop, or go on), which the rollout ranks follow at their own safe point. The trainer's broadcasts are asynchronous (gloo runs them on
its own threads), so training goes on while the bytes move.

Why not ``megatron.core.resharding`` (``swap_model_weights``): it copies between two Megatron models of
different parallelism. The destination here is a vLLM engine, which loads Hugging Face names through its
own loader (``reload_weights``), so the trainer exports Hugging Face tensors once (TP shards gathered) and
broadcasts them; vLLM shards them for its own tensor parallelism.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from yatt_lightning.distributed import wire
from yatt_lightning.distributed.failures import RankFailure

WEIGHTS, ACK, DECISION, FAILURE = 1, 0, 2, 3
SAME_INDEX = -1  # a WEIGHTS header's size: the index is the one of the last WEIGHTS message
ALIGN = 16  # bytes
FIRST_BUCKET = 1 << 20  # bytes; each next bucket may be twice the one before, up to ``bucket_bytes``


@dataclass
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SaveDecision:
    """What the trainers decided at the safe point after their RL step ``step``: whether every rank saves
    (the checkpoint is named by the trainers' ``global_step``) and whether the run stops (on ``signal``).
    ``updates`` is the trainers' policy version then; ``final``: the trainers' last decision of the run."""

    step: int
    global_step: int
    save: bool
    signal: int | None = None
    updates: int = 0
    final: bool = False

    @property
    def stop(self) -> bool:
        return self.signal is not None


def layout(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int, first_bytes: int | None = None
) -> tuple[list[_Entry], list[int]]:
    """Where each tensor goes in flat byte buckets (a tensor bigger than its bucket's cap gets a bucket of
    its own), each tensor aligned so its bytes can be viewed as its dtype again; and each bucket's size.
    Bucket k holds at most ``min(bucket_bytes, first_bytes * 2**k)`` (``first_bytes`` defaults to
    ``bucket_bytes``: every cap equal). Reads only shapes: the index is sent before any bucket is filled."""
    cap = bucket_bytes if first_bytes is None else min(first_bytes, bucket_bytes)
    entries, sizes, size = [], [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        offset = size + (-size % ALIGN)
        if size and offset + nbytes > cap:
            sizes.append(size)
            cap = min(2 * cap, bucket_bytes)
            offset = 0
        entries.append(_Entry(name, tuple(tensor.shape), tensor.dtype, len(sizes), offset, nbytes))
        size = offset + nbytes
    if entries:
        sizes.append(size)
    return entries, sizes


def pack(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[list[_Entry], list[torch.Tensor]]:
    """The tensors as flat byte buckets (:func:`layout`), each a copy (the trainer may step on while it
    is sent), and the index that unpacks them."""
    entries, sizes = layout(named, bucket_bytes)
    buffers = (torch.empty(size, dtype=torch.uint8) for size in sizes)
    return entries, list(fill(named, entries, sizes, buffers))


def fill(named, entries: list[_Entry], sizes: list[int], buffers) -> Iterator[torch.Tensor]:
    """Each bucket in turn, filled from ``named`` (read lazily, tensor by tensor) into the next of
    ``buffers`` (one of each bucket's size); ``named`` must be the index's tensors in order, no more."""
    tensors = iter(named)
    for these, out in zip(_by_bucket(entries, len(sizes)), buffers, strict=True):
        yield _fill_next(tensors, these, out)
    if next(tensors, None) is not None:
        raise RuntimeError(f"the policy exports more tensors than the {len(entries)} of its first version")


def _by_bucket(entries: list[_Entry], buckets: int) -> list[list[_Entry]]:
    out: list[list[_Entry]] = [[] for _ in range(buckets)]
    for e in entries:
        out[e.bucket].append(e)
    return out


def _fill_next(tensors, entries: list[_Entry], out: torch.Tensor) -> torch.Tensor:
    """One bucket from the next tensors of ``tensors``, which must be the index's ``entries`` in order
    (a policy's names, shapes and dtypes are the same in every version)."""
    for e in entries:
        name, tensor = next(tensors, (None, None))
        if name != e.name or tuple(tensor.shape) != e.shape or tensor.dtype != e.dtype:
            got = "nothing" if name is None else f"{name} {tuple(tensor.shape)} {tensor.dtype}"
            raise RuntimeError(
                f"the policy's export changed since its first version: expected {e.name} {e.shape} {e.dtype}, got {got}"
            )
        out[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(tensor.detach())
    return out


def unpack(entries: list[_Entry], buckets: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [
        (e.name, buckets[e.bucket][e.offset : e.offset + e.nbytes].view(e.dtype).reshape(e.shape)) for e in entries
    ]


class WeightPublisher:
    """The trainer's end. ``publish`` returns at once; the previous message's sends finish in the background."""

    def __init__(self, group, src: int, bucket_bytes: int) -> None:
        self.group, self.src, self.bucket_bytes = group, src, bucket_bytes
        self.pending: list = []  # (work, tensor): kept alive until sent
        self.pool = _Pool()  # buckets already sent, refilled by the next version (its layout is the same)
        self._sent_index: tuple | None = None  # (entries, bucket sizes) of the first version: sent once

    def publish(
        self, kind: int, version: int, consumed: int, named=None, cause: str = "", decision: SaveDecision | None = None
    ) -> float:
        """Send one message; returns the seconds spent here (packing and posting, not the transfer).

        ``named`` (``WEIGHTS``) may be a lazy iterator (``export_hf``): once the index is known it is read
        bucket by bucket, so exporting the next tensors overlaps the send of the bucket before them."""
        t0 = time.perf_counter()
        self._reap()
        header_size = None  # the payload's
        if kind == WEIGHTS:
            if self._sent_index is None:  # the first version: its shapes make the index, sent once
                named = list(named)
                entries, sizes = layout(named, self.bucket_bytes, FIRST_BUCKET)
                self._sent_index = (entries, sizes)
                body = pickle.dumps(entries)
            else:
                body, header_size = b"", SAME_INDEX
        elif kind == DECISION:
            body = pickle.dumps(decision)
        else:
            body = cause.encode()
        payload = torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else torch.zeros(0, dtype=torch.uint8)
        header = torch.tensor([kind, version, consumed, payload.numel() if header_size is None else header_size], dtype=torch.int64)
        with wire.category("weights"):
            self._send(header)
            self._send(payload)
            if kind == WEIGHTS:
                entries, sizes = self._sent_index
                buffers = (self.pool.get(size) for size in sizes)
                for bucket in fill(named, entries, sizes, buffers):  # bucket k is on the wire (gloo's thread)
                    self._send(bucket)  # while k + 1 fills
        return time.perf_counter() - t0

    def _send(self, tensor: torch.Tensor) -> None:
        if tensor.numel():
            work = torch.distributed.broadcast(tensor, src=self.src, group=self.group, async_op=True)
            self.pending.append((work, tensor))

    def _reap(self) -> None:
        done = [t for w, t in self.pending if w.is_completed()]
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]
        self.pool.put(done)

    def flush(self, timeout_s: float) -> None:
        """Wait until every message was received (the end of the run; a rank that left fails this)."""
        deadline = time.monotonic() + timeout_s
        for work, _ in self.pending:
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.src} waited {timeout_s:.0f} s for the rollout ranks to take its weights")
                time.sleep(0.001)
        self._reap()


@dataclass
class Received:
    """What the rollout rank has heard from the trainer so far."""

    versions: dict[int, list[tuple[str, torch.Tensor]]] = field(default_factory=dict)  # version -> tensors
    consumed: int = -1  # the last step the trainer has consumed
    latest: int = 0  # the newest version announced
    decisions: list[SaveDecision] = field(default_factory=list)  # not yet followed, oldest first


class WeightReceiver:
    """A rollout rank's end: polls the trainer's messages between its own steps."""

    def __init__(self, group, src: int) -> None:
        self.group, self.src = group, src
        self.state = Received()
        self.pool = _Pool()  # buckets of versions the engine has copied in
        self.buckets: dict[int, list[torch.Tensor]] = {}  # version -> the buckets its tensors view
        self.spent: list[torch.Tensor] = []  # the buckets of the version taken last
        self.index: list[_Entry] = []  # of the last WEIGHTS message (a next one may say it is the same)
        self._post()

    def _post(self) -> None:
        self.header = torch.zeros(4, dtype=torch.int64)
        self.work = torch.distributed.broadcast(self.header, src=self.src, group=self.group, async_op=True)

    def poll(self) -> bool:
        """Take every message that has arrived; True if any did."""
        got = False
        while self.work.is_completed():
            self.work.wait()
            kind, version, consumed, size = self.header.tolist()
            payload = torch.empty(max(size, 0), dtype=torch.uint8)
            with wire.category("weights"):
                if size > 0:
                    torch.distributed.broadcast(payload, src=self.src, group=self.group)
                if kind == FAILURE:
                    raise RankFailure(self.src, payload.numpy().tobytes().decode(), agreed=False,
                                      how="the trainer publishing the weights failed")  # fmt: skip
                if kind == DECISION:
                    self.state.decisions.append(pickle.loads(payload.numpy().tobytes()))
                if kind == WEIGHTS:
                    if size != SAME_INDEX:
                        self.index = pickle.loads(payload.numpy().tobytes())
                    entries = self.index
                    sizes: dict[int, int] = {}
                    for e in entries:
                        sizes[e.bucket] = max(sizes.get(e.bucket, 0), e.offset + e.nbytes)
                    buckets = [self.pool.get(sizes[b]) for b in sorted(sizes)]
                    works = [torch.distributed.broadcast(b, src=self.src, group=self.group, async_op=True) for b in buckets]
                    for work in works:  # all posted at once: the buckets stream without a round trip each
                        work.wait()
                    self.state.versions[version] = unpack(entries, buckets)
                    self.buckets[version] = buckets
                    self.state.latest = max(self.state.latest, version)
            self.state.consumed = max(self.state.consumed, consumed)
            got = True
            self._post()
        return got

    def wait(self, ready, what: str, timeout_s: float) -> float:
        """Poll until ``ready(state)``; returns the seconds waited. Raises after ``timeout_s`` naming ``what``."""
        t0 = time.monotonic()
        self.poll()
        while not ready(self.state):
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"rollout rank waited {timeout_s:.0f} s for {what} from trainer rank {self.src}")
            time.sleep(0.0005)
            self.poll()
        return time.monotonic() - t0

    def take(self, version: int) -> list[tuple[str, torch.Tensor]]:
        """Version ``version``'s tensors; older versions are forgotten. The engine copies them in (vLLM's weight
        loaders do) before the next ``take``, which then reuses their buckets for a later version."""
        named = self.state.versions[version]
        self.state.versions = {v: t for v, t in self.state.versions.items() if v > version}
        self.pool.put(self.spent)  # the version taken before: the engine has copied it in
        self.spent = self.buckets.pop(version, [])
        for old in [v for v in self.buckets if v < version]:  # never taken
            self.pool.put(self.buckets.pop(old))
        return named


class _Pool:
    """Byte buffers by size, reused: a version's buckets have the sizes of the last one, and fresh pages
    cost a fault each on first touch (about as much as the copy into them on this machine)."""

    def __init__(self) -> None:
        self.free: dict[int, list[torch.Tensor]] = {}

    def get(self, size: int) -> torch.Tensor:
        spare = self.free.get(size)
        return spare.pop() if spare else torch.empty(size, dtype=torch.uint8)

    def put(self, buffers: list[torch.Tensor]) -> None:
        for b in buffers:
            if b.dim() == 1 and b.dtype == torch.uint8 and b.numel() > 1 << 16:  # buckets, not headers
                self.free.setdefault(b.numel(), []).append(b)
