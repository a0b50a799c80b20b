"""Tier 1: the CPU checkpoint writer reads the training tensors until the state changes, then its copies."""

import threading
from collections import namedtuple

import torch

from yatt_lightning.checkpoint.writer import LiveSnapshot
from yatt_lightning.models import live_state

Item = namedtuple("Item", "index")


def _buckets(*tensors):
    return [("file", "key", ([], [(Item(i), t) for i, t in enumerate(tensors)]))]


def test_an_optimizer_step_before_the_writer_ends_changes_nothing_written():
    a, b, c = torch.zeros(4), torch.ones(4), torch.full((4,), 2.0)
    snapshot = LiveSnapshot()
    pairs = snapshot.take(_buckets(a, b, c))[0][2][1]
    item, first = next(pairs)  # the writer serialises `a` from the training tensor itself
    assert item.index == 0 and first.data_ptr() == a.data_ptr()
    settled = threading.Thread(target=live_state.before_update)  # the next optimizer step begins
    settled.start()
    settled.join(timeout=0.5)
    assert settled.is_alive(), "the step waits for the tensor being written"
    assert snapshot.copied_bytes == 2 * 4 * 4  # b and c, not yet reached, were copied
    _, second = next(pairs)  # `a` is written: the step may go on, and the writer reads the copy of `b`
    settled.join(timeout=5)
    assert not settled.is_alive()
    with torch.no_grad():
        for t in (a, b, c):
            t.add_(10)  # the optimizer step
    rest = [second, *(t for _, t in pairs)]
    assert [t.tolist() for t in rest] == [[1.0] * 4, [2.0] * 4]
    snapshot.close()
    live_state.before_update()  # nothing registered any more: nothing to wait for


def test_a_writer_that_finished_first_copies_nothing():
    a = torch.zeros(1000)
    snapshot = LiveSnapshot()
    pairs = snapshot.take(_buckets(a))[0][2][1]
    assert [t.data_ptr() for _, t in pairs] == [a.data_ptr()]
    live_state.before_update()
    assert snapshot.copied_bytes == 0
    snapshot.close()


def test_an_offload_of_the_training_tensor_does_not_change_what_is_read():
    """CPU offload swaps a tensor's storage out (``MegatronPolicy.offload``); the writer's alias keeps it."""
    a = torch.arange(6.0)
    snapshot = LiveSnapshot()
    pairs = snapshot.take(_buckets(a))[0][2][1]
    with torch.no_grad():
        a.set_(torch.empty(0))
    assert [t.tolist() for _, t in pairs] == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
    snapshot.close()


def test_a_writer_that_fails_in_the_middle_of_a_tensor_never_blocks_the_next_step():
    """A full disk while `a` is being written: the writer thread ends (close), and the optimizer step's
    settle returns at once instead of waiting for a tensor that will never be finished."""
    a, b = torch.zeros(4), torch.ones(4)
    snapshot = LiveSnapshot()
    pairs = snapshot.take(_buckets(a, b))[0][2][1]
    next(pairs)  # `a` is being written ... and the write fails: Megatron's loop is gone, the generator paused
    snapshot.close()  # what the writer thread does last, success or failure
    settled = threading.Thread(target=live_state.before_update)
    settled.start()
    settled.join(timeout=5)
    assert not settled.is_alive()


def test_a_new_save_is_not_touched_by_an_old_saves_paused_writer():
    snapshot = LiveSnapshot()
    old_pairs = snapshot.take(_buckets(torch.zeros(4)))[0][2][1]
    next(old_pairs)
    snapshot.close()
    a = torch.ones(4)
    pairs = snapshot.take(_buckets(a))[0][2][1]  # the same item index as the old save's
    old_pairs.close()  # what the garbage collector would do later
    item, tensor = next(pairs)
    assert tensor is not None and tensor.data_ptr() == a.data_ptr()
    snapshot.close()


def test_the_writer_thread_yields_to_training():
    """The writer runs at the lowest priority (a per-thread nice value): where the cores are busy, the
    training thread goes first. The calling thread keeps its own priority."""
    import os

    from yatt_lightning.checkpoint.writer import WRITER_NICE, _run_writer

    seen = []
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    writer = threading.Thread(
        target=_run_writer,
        args=(lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())), (), {}, LiveSnapshot()),
    )
    writer.start()
    writer.join(timeout=10)
    assert seen == [WRITER_NICE]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
