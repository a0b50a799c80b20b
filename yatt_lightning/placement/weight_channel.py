"""Disaggregated placement's weight channel: the trainers publish policy versions, the rollout ranks apply them.

One trainer (global rank 0, the head of data-parallel rank 0's model-parallel group) broadcasts on a
group of itself and the rollout ranks. Every message starts with a fixed-size header (kind, version, the
trainer's consumed step, the size of what follows); a rollout rank receives them on a thread and takes what
has arrived between its own steps. The buckets travel on a second group of the same ranks (``data_group``),
where each rollout rank keeps the receives of the next version posted from the moment the last one started
arriving: a version's bytes move as soon as the trainer posts them, not a header's round trip later (the
cost: the next version's buffers, one more copy of the weights in the rollout rank's host memory; the
trainer sends zeros into receives that the next message cannot use: a new index, ``END``, ``FAILURE``). The
rollout rank renames a version to the engine's names when it takes it (:meth:`WeightReceiver.take`). A
``WEIGHTS`` message then carries its tensor index (only
when it differs from the last one sent: a policy's names and shapes do not change from version to
version, so the header's size is ``SAME_INDEX`` and the buckets follow it at once) and the buckets, one
broadcast each (:mod:`~yatt_lightning.placement.weight_buckets`: packed; with ``direct_bytes``, large
storages as they are); an ``ACK`` carries nothing (a step whose batch was dropped: no new version, but the producer
learns the trainer moved on); a ``FAILURE`` carries the trainer's cause; a ``DECISION`` carries the
trainers' :class:`SaveDecision` of a step (checkpoint and stop, or go on), which the rollout ranks follow
at their own safe point; ``END`` (nothing) is the trainer's last message. The trainer's broadcasts are
asynchronous (gloo runs them on its own threads), so training goes on while the bytes move.

Why not ``megatron.core.resharding`` (``swap_model_weights``): it copies between two Megatron models of
different parallelism. The destination here is a vLLM engine, which loads Hugging Face names through its
own loader (``reload_weights``), so the trainer exports Hugging Face tensors once (TP shards gathered) and
broadcasts them; vLLM shards them for its own tensor parallelism. A trainer of one model-parallel rank
sends its parameters as they are instead (one storage, one message) with the renaming to Hugging Face
names (:class:`~yatt_lightning.models.hf_names.HFNames`), which the rollout rank applies as it takes a version.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from yatt_lightning.distributed import wire
from yatt_lightning.distributed.failures import RankFailure
from yatt_lightning.placement.weight_buckets import BufferPool, fill, layout, parts, unpack

WEIGHTS, ACK, DECISION, FAILURE, END = 1, 0, 2, 3, 4
SAME_INDEX = -1  # a WEIGHTS header's size: the index is the one of the last WEIGHTS message
FIRST_BUCKET = 1 << 20  # bytes; each next packed bucket may be twice the one before, up to ``bucket_bytes``
PART = None  # bytes: a bucket may travel in parts of this size (None: whole). Parts let a receiver use the
# first tensors while the rest arrive, but each costs a broadcast, and while its renaming ran on the receiving
# thread the transfer of a 46 MiB message in 8 MiB parts took ~3 ms more than one broadcast (2026-12-05)


@dataclass(frozen=True)
class SaveDecision:
    """What the trainers decided at the safe point after their RL step ``step``: whether every rank saves
    (the checkpoint is named by the trainers' ``global_step``) and whether the run stops (on ``signal``).
    ``updates`` is the trainers' policy version then; ``final``: the trainers' last decision of the run;
    ``after_failure``: the one they took when their rollout rank failed (also their last)."""

    step: int
    global_step: int
    save: bool
    signal: int | None = None
    updates: int = 0
    final: bool = False
    after_failure: bool = False  # taken after the rollout rank failed: the last one

    @property
    def stop(self) -> bool:
        return self.signal is not None


class WeightPublisher:
    """The trainer's end. ``publish`` returns at once; the sends finish in the background (gloo's threads).

    A ``WEIGHTS`` message of a list of tensors (a model-parallel group of one: the parameters, views of one
    storage) with ``direct_bytes`` sends its large storages as they are
    (:mod:`~yatt_lightning.placement.weight_buckets`), so the trainer must :meth:`flush` before it next
    changes its parameters; a lazy iterator (gathered shards, built as they are read) is read bucket by
    bucket as it is sent, against the first version's index."""

    def __init__(
        self, group, src: int, bucket_bytes: int, direct_bytes: int | None = None, part_bytes: int | None = PART,
        data_group=None,
    ) -> None:  # fmt: skip
        self.group, self.src, self.bucket_bytes, self.direct_bytes = group, src, bucket_bytes, direct_bytes
        self.part_bytes = part_bytes  # the receivers' must be the same
        self.ahead = data_group is not None  # the receivers post the next version's receives ahead
        self.data_group = group if data_group is None else data_group  # the buckets' group
        self.posted: list[int] | None = None  # the bucket sizes the receivers have their next receives posted for
        self.pending: list = []  # (works, tensor, kind): a "packed" bucket the pool reuses once sent, a "direct"
        # storage (the trainer's own: it waits before changing it) or a "message" (header, index)
        self.pool = BufferPool()  # packed buckets already sent, refilled by the next version (same layout)
        self._sent_index: tuple | None = None  # (entries, bucket sizes, rename) of the last index sent
        self.sent_bytes = 0  # the buckets' bytes of the last WEIGHTS message

    def publish(
        self,
        kind: int,
        version: int,
        consumed: int,
        named=None,
        cause: str = "",
        decision: SaveDecision | None = None,
        rename=None,
    ) -> float:
        """Send one message; returns the seconds spent here (packing and posting, not the transfer). ``rename``
        (a picklable callable, sent with the index): the rollout rank turns each received (name, tensor) into
        the engine's (name, tensor) pairs with it (the trainer sends its parameters as they are)."""
        t0 = time.perf_counter()
        self._reap()
        header_size = None  # the payload's
        if kind == WEIGHTS:
            index = None
            if isinstance(named, list):  # views: its index is cheap to take again (the storages may move)
                index = (*layout(named, self.bucket_bytes, FIRST_BUCKET, self.direct_bytes), rename)
            elif self._sent_index is None:  # lazy: the first version's shapes make the index, sent once
                named = list(named)
                index = (*layout(named, self.bucket_bytes, FIRST_BUCKET, self.direct_bytes), rename)
            if index is None or index == self._sent_index:
                body, header_size = b"", SAME_INDEX
            else:
                self._sent_index, body = index, pickle.dumps(index)
                self._fill_posted()  # posted for the old index's buckets
        elif kind == DECISION:
            body = pickle.dumps(decision)
        else:
            body = cause.encode()
            if kind in (END, FAILURE):  # the receivers' thread ends at this message
                self._fill_posted()
        payload = torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else torch.zeros(0, dtype=torch.uint8)
        header = torch.tensor([kind, version, consumed, payload.numel() if header_size is None else header_size], dtype=torch.int64)
        with wire.category("weights"):
            self._send(header)
            self._send(payload)
            if kind == WEIGHTS:
                entries, sizes, _ = self._sent_index
                self.sent_bytes = sum(sizes)
                checked = not isinstance(named, list)  # a list's index was just taken of it
                for bucket, packed in fill(named, entries, sizes, self.pool.get, checked):  # bucket k is on the wire
                    self._send(bucket, "packed" if packed else "direct", data=True)  # while k + 1 fills
                if self.ahead:
                    self.posted = list(sizes)  # the receivers post the next version's receives now
        return time.perf_counter() - t0

    def _fill_posted(self) -> None:
        """Zeros into the receives the rollout ranks posted ahead, which the next message does not fill."""
        for size in self.posted or []:
            self._send(torch.zeros(size, dtype=torch.uint8), data=True)
        self.posted = None

    def _send(self, tensor: torch.Tensor, kind: str = "message", data: bool = False) -> None:
        group = self.data_group if data else self.group
        if tensor.numel():
            works = [torch.distributed.broadcast(part, src=self.src, group=group, async_op=True)
                     for part in parts(tensor, self.part_bytes)]  # fmt: skip
            self.pending.append((works, tensor, kind))

    def _reap(self) -> None:
        pending, done = [], []
        for works, tensor, kind in self.pending:
            if not all(work.is_completed() for work in works):
                pending.append((works, tensor, kind))
            elif kind == "packed":
                done.append(tensor)
        self.pending = pending
        self.pool.put(done)

    def flush(self, timeout_s: float, only_direct: bool = False) -> float:
        """Wait until every message was sent (``only_direct``: the storages sent as they are, before the trainer
        changes them; at the end of the run, all; a rank that left fails this). Returns the seconds waited."""
        t0 = time.monotonic()
        for works, _, kind in self.pending:
            if only_direct and kind != "direct":
                continue
            for work in works:
                while not work.is_completed():
                    if time.monotonic() - t0 > timeout_s:
                        raise TimeoutError(f"rank {self.src} waited {timeout_s:.0f} s for the rollout ranks to take its weights")
                    time.sleep(0.0005)
        self._reap()
        return time.monotonic() - t0


@dataclass
class Received:
    """What the rollout rank has heard from the trainer so far."""

    versions: dict[int, list[tuple[str, torch.Tensor]]] = field(default_factory=dict)  # version -> tensors
    consumed: int = -1  # the last step the trainer has consumed
    latest: int = 0  # the newest version announced
    decisions: list[SaveDecision] = field(default_factory=list)  # not yet followed, oldest first
    ended: bool = False  # the trainer sent END: nothing more comes


class WeightReceiver:
    """A rollout rank's end: a thread receives the trainer's messages as they come, and the rank takes what
    has arrived between its own steps (:meth:`poll`).

    Receiving in a thread, not in the rank's polls, means a version is taken off the wire whatever the rank
    is doing (generating without in-flight updates, in a callback's collective at the end of the run): the
    trainer, which holds its next update until the storages it sent as they are have left
    (``direct_bytes``), never waits for the rollout rank's next poll. The thread blocks in gloo (the GIL
    released) between messages and ends at the trainer's ``END`` or ``FAILURE``."""

    def __init__(self, group, src: int, part_bytes: int | None = PART, data_group=None) -> None:
        self.group, self.src, self.part_bytes = group, src, part_bytes
        self.ahead = data_group is not None  # the next version's receives are posted ahead
        self.data_group = group if data_group is None else data_group  # the buckets' group
        self._ahead: tuple | None = None  # (buckets, works): the next version's receives, posted
        self.state = Received()
        self.pool = BufferPool()  # buckets of versions the engine has copied in (the thread takes from it)
        self.held: dict[int, tuple[list[torch.Tensor], object]] = {}  # version -> the buckets its tensors view,
        # and the renaming they need (None: none)
        self.spent: list[torch.Tensor] = []  # the buckets of the version taken last
        self.index: tuple = ([], [], None)  # of the last WEIGHTS message: entries, sizes, rename
        self._arrived: queue.Queue = queue.Queue()  # (kind, version, consumed, what) in order of arrival
        self._thread = threading.Thread(target=self._receive, name=f"yatt-weights-from-{src}", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        try:
            while True:
                header = torch.zeros(4, dtype=torch.int64)
                with wire.category("weights"):
                    torch.distributed.broadcast(header, src=self.src, group=self.group)
                    kind, version, consumed, size = header.tolist()
                    payload = torch.empty(max(size, 0), dtype=torch.uint8)
                    if size > 0:
                        torch.distributed.broadcast(payload, src=self.src, group=self.group)
                    what = payload.numpy().tobytes()
                    if kind == WEIGHTS:
                        if size != SAME_INDEX:
                            self._drain_ahead()  # posted for the old index: the trainer fills them with zeros
                            self.index = pickle.loads(what)
                        entries, sizes, rename = self.index
                        receives, self._ahead = self._ahead or self._post(sizes), None
                        if self.ahead:  # the next version's, while this one's bytes arrive (the rank then
                            self._ahead = self._post(sizes)  # takes this one without waiting for the GIL)
                        what = (*self._weights(entries, receives), rename)
                self._arrived.put((kind, version, consumed, what))
                if kind in (END, FAILURE):
                    with wire.category("weights"):
                        self._drain_ahead()
                    return
        except Exception as err:  # the channel broke (the trainer died): the rank raises it at its next poll
            self._arrived.put((FAILURE, -1, -1, f"{type(err).__name__}: {err}".encode()))

    def _post(self, sizes: list[int]) -> tuple[list[torch.Tensor], list]:
        """Receives for a version's buckets, every part posted at once (they stream without a round trip each)."""
        buckets = [self.pool.get(size) for size in sizes]
        works = [torch.distributed.broadcast(part, src=self.src, group=self.data_group, async_op=True)
                 for bucket in buckets for part in parts(bucket, self.part_bytes)]  # fmt: skip
        return buckets, works

    def _drain_ahead(self) -> None:
        if self._ahead is not None:
            buckets, works = self._ahead
            self._ahead = None
            for work in works:
                work.wait()
            self.pool.put(buckets)

    def _weights(self, entries, receives) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
        """Receive a version's buckets (``receives``: :meth:`_post`'s). Returns the trainer's tensors (views of
        the buckets) and the buckets (reused once the engine took them). The renaming's copies run in
        :meth:`take`, on the rank's own thread as its engine takes the version, not on this one while the bytes
        arrive (on a machine of few cores they slowed the transfer down)."""
        buckets, works = receives
        named = unpack(entries, buckets)  # views, read once the bytes have arrived
        for work in works:
            work.wait()
        return named, buckets

    def poll(self, block_s: float = 0.0) -> bool:
        """Take every message that has arrived (waiting up to ``block_s`` for the first); True if any did."""
        got = False
        while True:
            try:
                if block_s > 0 and not got:
                    kind, version, consumed, what = self._arrived.get(timeout=block_s)
                else:
                    kind, version, consumed, what = self._arrived.get_nowait()
            except queue.Empty:
                return got
            if kind == FAILURE:
                raise RankFailure(self.src, what.decode(), agreed=False, how="the trainer publishing the weights failed")
            if kind == DECISION:
                self.state.decisions.append(pickle.loads(what))
            if kind == WEIGHTS:
                named, buckets, rename = what
                self.state.versions[version], self.held[version] = named, (buckets, rename)
                self.state.latest = max(self.state.latest, version)
            self.state.ended = self.state.ended or kind == END
            self.state.consumed = max(self.state.consumed, consumed)
            got = True

    def wait(self, ready, what: str, timeout_s: float) -> float:
        """Take messages as they arrive until ``ready(state)``; returns the seconds waited. Raises after
        ``timeout_s`` naming ``what``."""
        t0 = time.monotonic()
        self.poll()
        while not ready(self.state):
            left = timeout_s - (time.monotonic() - t0)
            if left <= 0:
                raise TimeoutError(f"rollout rank waited {timeout_s:.0f} s for {what} from trainer rank {self.src}")
            self.poll(block_s=min(left, 1.0))  # wakes as the receiving thread hands a message over
        return time.monotonic() - t0

    def take(self, version: int) -> list[tuple[str, torch.Tensor]]:
        """Version ``version``'s tensors under the engine's names; older versions are forgotten. The engine
        copies them in (vLLM's weight loaders do) before the next ``take``, which then reuses their buckets
        (and the renaming's copies) for a later version."""
        named = self.state.versions[version]
        self.state.versions = {v: t for v, t in self.state.versions.items() if v > version}
        self.pool.put(self.spent)  # the version taken before: the engine has copied it in
        self.spent, rename = self.held.pop(version, ([], None))
        for old in [v for v in self.held if v < version]:  # never taken
            self.pool.put(self.held.pop(old)[0])
        if rename is not None:
            named, copies = renamed(named, rename, self.pool)
            self.spent = self.spent + copies
        return named

    def join(self, timeout_s: float) -> None:
        """After ``END``: the receiving thread is done (before the process group goes)."""
        self._thread.join(timeout_s)


def renamed(named, rename, pool: BufferPool) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
    """The engine's tensors of the trainer's (``rename``'s views), and the buffers of ``pool`` it copied into:
    a q, k or v of a fused QKV weight comes as a view by query group (one dimension more than the fused
    tensor), flattened into a buffer the rank reuses (a fresh one would fault in every page of it again)."""
    out, copies = [], []
    for name, tensor in named:
        for engine_name, view in rename(name, tensor, grouped=True):
            if view.dim() > tensor.dim():
                flat = (-1, *view.shape[2:])
                if view.is_contiguous():
                    view = view.view(flat)
                else:
                    copies.append(pool.get(view.numel() * view.element_size()))
                    view = copies[-1].view(view.dtype).view(view.shape).copy_(view).view(flat)
            out.append((engine_name, view))
    return out, copies


class LiveWeights:
    """A rollout rank's engine's weights: the version it holds and, when ``live``, the newer versions it applies
    between its own steps in the middle of a generation (the engine's :class:`~yatt_lightning.engines.base.WeightFeed`).

    A generation that spans an update goes on from the keys and values it computed with the older weights,
    and each of its samples records the first and last version of its tokens (as in-flight updates do:
    PipelineRL, AReaL's interruptible generation without the recompute)."""

    def __init__(self, live: bool) -> None:
        self.live = live
        self.receiver: WeightReceiver | None = None  # once the channel exists
        self.version: int | None = 0  # the engine starts from the policy's own folder (None: resumed, not yet)
        self.applied = 0  # versions applied in the middle of a generation, over the run

    def newer(self) -> list[tuple[str, torch.Tensor]] | None:
        if not self.live or self.receiver is None or self.version is None:
            return None
        self.receiver.poll()
        newest = max(self.receiver.state.versions, default=-1)
        if newest <= self.version:
            return None
        self.version, self.applied = newest, self.applied + 1
        return self.receiver.take(newest)
