"""The writer of asynchronous checkpoints on CPU: a thread of the training process, not a fork of it.

Megatron-Core's asynchronous ``dist_checkpointing`` forks the training process for each save (and forks
again per write bucket). On CPU the trainer is ~2 GB and its next optimizer steps and weight push touch
every page the child shares, so each is copied on write: a save then costs the run as much as a
synchronous one. Here a thread writes them bucket after bucket (file writes, ``fsync`` and CRC-32
release the GIL), from the training tensors themselves until the next optimizer step and from host
copies of what is left then (:class:`LiveSnapshot`). On GPU, Megatron's own queue (device-to-host copy, then a forked writer) is
used unchanged. Written against megatron-core 0.16.1 (``models/cpu.py`` pins it): the position of the
write buckets in the request's arguments, ``write_preloaded_data.__wrapped__`` and the results format.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from yatt_lightning.checkpoint.direct_io import DirectFile
from yatt_lightning.models import live_state
from yatt_lightning.models.cpu import cpu_mode

log = logging.getLogger("yatt_lightning.checkpoint.folder")


def async_calls_queue() -> Any:
    """Megatron's queue of asynchronous saves (at most one is in flight: the callback finalises before it
    schedules the next). On GPU, Megatron's own: device-to-host copy in the step, then a forked writer.

    On CPU a forked writer would cost the run as much as a synchronous save: the trainer is ~2 GB and its
    next optimizer steps touch every page the child shares (parameters, gradients, Adam state), so each is
    copied on write. Here a thread of this process writes them, bucket after bucket, from the training
    tensors until the next optimizer step copies what is left (:class:`LiveSnapshot`)."""
    if not cpu_mode():
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        return AsyncCallsQueue(persistent=False)
    return _thread_calls_queue_class()()


_PENDING, _WRITING, _DONE, _COPIED = range(4)


class LiveSnapshot:
    """The tensors of one save, as the writer reads them: the training tensors themselves until the state
    changes, then host copies of what it had not read yet.

    On CPU, Megatron's ``preload_tensors`` returns the live training tensors (``tensor.to("cpu")`` copies
    nothing), and the views it would clone are deferred to the writer (``models/cpu.py``). Copying all of
    them in the step that saves costs that step a memcpy of the whole state (~0.15-0.2 s for 582 MiB
    here). They change only in an optimizer step, and the next one comes after the next rollout, so the
    writer reads the training tensors (through aliases of their storage, which CPU offload leaves
    untouched) and :meth:`settle` runs in :func:`~yatt_lightning.models.live_state.before_update`: it
    copies into host buffers (reused by the next save) only the tensors not yet written and waits for
    the one being written. ``copied_bytes`` says how much that was.
    """

    def __init__(self) -> None:
        self._buffers: dict = {}
        self._items: dict = {}  # of the current save: item index -> [write item, tensor (alias or copy), state]
        self._pairs: list = []  # the current save's generators of (write item, tensor), one per bucket
        self._closed = True
        self._cond = threading.Condition()
        self.writer: threading.Thread | None = None  # the thread that reads the tensors now
        self.copied_bytes = 0
        self.settle_s = 0.0  # of the current save: the training thread's time in settle (copies and the wait)
        self.write_s = 0.0  # of the last save that ended: from take to close (the writer's whole span)
        self._taken_at = 0.0

    def take(self, write_buckets: list) -> list:
        if self.writer is not None:
            self.writer.join()  # never hand out a buffer a writer still reads (the callback joined it already)
        with self._cond:
            items: dict = {}
            self._items, self._closed, self.copied_bytes, self._pairs = items, False, 0, []
            self.settle_s, self._taken_at = 0.0, time.perf_counter()
            staged = []
            for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
                keys = []
                for item, tensor in tensor_data:
                    # An alias: its own sizes over the same storage, so an offload that swaps the training
                    # tensor's storage out (``MegatronPolicy.offload`` on CPU) does not change what is read.
                    items[item.index] = [item, tensor.detach(), _PENDING]
                    keys.append(item.index)
                self._pairs.append(self._iterate(items, keys))
                staged.append((file_name, storage_key, (bytes_data, self._pairs[-1])))
        live_state.register(self)
        return staged

    def _iterate(self, items: dict, keys: list) -> Iterator[tuple[Any, torch.Tensor]]:
        """The (write item, tensor) pairs of one bucket of the save whose entries are ``items``, for
        Megatron's writer loop: a pair counts as written once the loop asks for the next one (or ends)."""
        current = None
        try:
            for key in keys:
                with self._cond:
                    self._finish(items, current)
                    entry = items[key]
                    if entry[2] == _PENDING:
                        entry[2] = _WRITING
                    current, pair = key, (entry[0], entry[1])
                if pair[1] is None:
                    raise RuntimeError("the checkpoint's snapshot was closed before its writer read every tensor")
                yield pair
        finally:
            with self._cond:
                self._finish(items, current)

    def _finish(self, items: dict, key) -> None:
        if key is not None:
            entry = items[key]
            entry[1], entry[2] = None, _DONE
            self._cond.notify_all()

    def settle(self) -> None:
        """Before the training state changes: copy every tensor the writer has not reached, then wait for
        the one it is writing (it reads the copies from now on). Returns at once once the writer is done or
        failed (:meth:`close`)."""
        with self._cond:
            if self._closed:
                return
            t0 = time.perf_counter()
            buffers = {}
            for key, entry in self._items.items():
                if entry[2] != _PENDING or entry[1] is None:
                    continue
                tensor, buf = entry[1], self._buffers.get(key)
                if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                    buf = torch.empty(tensor.shape, dtype=tensor.dtype)
                buffers[key] = buf.copy_(tensor)
                entry[1], entry[2] = buf, _COPIED
                self.copied_bytes += tensor.numel() * tensor.element_size()
            self._buffers = buffers
            while not self._closed and any(entry[2] == _WRITING for entry in self._items.values()):
                self._cond.wait()
            self.settle_s += time.perf_counter() - t0

    def close(self) -> None:
        """The writer is done, or failed (perhaps in the middle of a tensor): nothing is read any more."""
        live_state.unregister(self)
        for pairs in self._pairs:  # a writer that failed left its bucket's generator paused: end it
            pairs.close()
        with self._cond:
            if not self._closed:
                self.write_s = time.perf_counter() - self._taken_at
            self._closed, self._pairs = True, []
            for entry in self._items.values():
                entry[1], entry[2] = None, _DONE
            self._cond.notify_all()


@functools.cache
def _thread_calls_queue_class() -> type:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCaller, AsyncCallsQueue

    class ThreadAsyncCaller(AsyncCaller):
        """Megatron's ``TemporalAsyncCaller`` (same agreement between ranks on when every rank is done)
        with a thread for the process and :class:`LiveSnapshot` for the device-to-host copy."""

        def __init__(self, snapshot: LiveSnapshot) -> None:
            self.snapshot = snapshot
            self.thread: threading.Thread | None = None

        def schedule_async_call(self, async_req) -> None:
            if async_req.async_fn is None:
                return
            args = list(async_req.async_fn_args)
            if async_req.preload_fn:
                args[1] = self.snapshot.take(args[1])  # the write buckets (see AsyncRequest.execute_sync)
            # The thread inherits the caller's signal mask: the callback blocks the preemption signals here,
            # so they are delivered to the main thread, whose handlers take them.
            self.thread = threading.Thread(
                target=_run_writer, args=(async_req.async_fn, args, async_req.async_fn_kwargs, self.snapshot),
                name="yatt-checkpoint-writer", daemon=True,
            )  # fmt: skip
            self.snapshot.writer = self.thread
            self.thread.start()

        def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
            is_alive = int(self.thread is not None and self.thread.is_alive())
            is_done = not is_alive if no_dist else self.sync_all_async_calls(is_alive)
            if is_done or blocking:
                self.close()
                is_done = True
            return is_done

        def close(self, abort: bool = False) -> None:
            if self.thread is not None:
                self.thread.join()  # a thread cannot be killed; `abort` waits too
                self.thread = None

        def __del__(self) -> None:
            pass

    class ThreadCallsQueue(AsyncCallsQueue):
        def __init__(self) -> None:
            super().__init__(persistent=False)
            self.snapshot = LiveSnapshot()

        def _get_async_caller(self) -> AsyncCaller:
            return ThreadAsyncCaller(self.snapshot)

    return ThreadCallsQueue


WRITER_NICE = 19


@contextlib.contextmanager
def without_zip_crc() -> Iterator[None]:
    """Megatron writes each tensor with ``torch.save``, whose zip container gets a CRC-32 of every record:
    one more pass over every byte of the checkpoint, which ``torch.load`` never checks (a corrupted byte
    loads silently); what a resume checks is the manifest's CRC-32 of every file
    (``checkpoint/verify.py``), computed as the file is written (``direct_io``). Process-wide while it lasts (torch has one switch): a ``torch.save``
    elsewhere in the process meanwhile writes records without it, which load the same."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def _run_writer(fn, args, kwargs, snapshot: LiveSnapshot) -> None:
    """The writer thread. Megatron's writes report failures through the results queue and ours through
    ``error_rank<r>.txt``; finalisation raises them on every rank. This only keeps a traceback in the
    library output's log (not on the terminal: the failure's one screen comes from finalisation).

    The thread runs at the lowest priority (Linux keeps a nice value per thread): where the cores are
    busy (another job, an engine beside the trainer) training goes first and the writer takes what is
    left; that delays only its own end, which the next save (or the run's end) waits for."""
    _lower_priority()
    try:
        fn(*args, **kwargs)
    except BaseException:
        with contextlib.suppress(OSError, ValueError):  # that log may be on the disk that just filled
            print("the checkpoint writer thread failed:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
    finally:
        snapshot.close()


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not Linux, or not permitted: the default priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)


def _write_buckets_in_order(transform_list, use_msc, rank: int, write_buckets: list, results_queue) -> None:
    """``FileSystemWriterAsync.write_preloaded_data_multiproc`` of megatron-core 0.16.1 without its fork
    of one process per bucket: the buckets are written one after another in the calling (writer) thread,
    each file past the page cache and fsynced (:mod:`~yatt_lightning.checkpoint.direct_io`), and the
    results reach ``results_queue`` in the same form (a dict of each bucket's results, or the first
    exception)."""
    results: dict | Exception = {}
    for i, bucket in enumerate(write_buckets):
        try:
            results[i] = _write_bucket(transform_list, bucket, use_msc)
        except Exception as err:  # Megatron's writer reports a failure this way, finalisation raises it
            log.debug("checkpoint bucket %d of rank %d failed: %s", i, rank, err)
            results = err
            break
    results_queue.put(results)


def _write_bucket(transform_list, bucket, use_msc: bool) -> list:
    """One bucket's file as Megatron's ``write_preloaded_data`` writes it (its items in order through torch
    DCP's ``_write_item``; the same write results), into a :class:`~yatt_lightning.checkpoint.direct_io.DirectFile`."""
    import inspect

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    _write_item = filesystem_async._write_item  # torch DCP's, as Megatron calls it (``models/cpu.py`` wraps it)
    if use_msc:  # Megatron's multi-storage client: its own writer, through the page cache
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        # Unwrapped from Megatron's `_disable_gc`, which would switch the garbage collector of the whole
        # process off and on from this thread while the training thread runs.
        local, count = queue.Queue(), queue.Queue()
        count.put(0)
        FileSystemWriterAsync.write_preloaded_data.__wrapped__(transform_list, 0, bucket, local, count, True, use_msc=True)
        result = local.get()[1]
        if isinstance(result, Exception):
            raise result
        return result
    extra = {}
    if "serialization_format" in inspect.signature(_write_item).parameters:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        extra["serialization_format"] = SerializationFormat.TORCH_SAVE
    file_name, storage_key, (bytes_data, tensor_data) = bucket
    stream = DirectFile(file_name)
    try:
        results = [_write_item(*transform_list, stream, data, item, storage_key, **extra) for item, data in bytes_data]
        for item, tensor in tensor_data:
            results.append(_write_item(*transform_list, stream, tensor, item, storage_key, **extra))
    finally:
        stream.close()
    return results
