"""Tier 1: how many torch threads a process of a run gets."""

from __future__ import annotations

import pytest

from yatt_lightning.distributed.threads import FROM_USER, available_cores, threads_per_process


def test_a_process_gets_the_cores_shared_by_the_processes_on_its_node():
    cores = available_cores()
    assert threads_per_process(1, {}) == (cores, f"{cores} cores / 1 process on this node")
    assert threads_per_process(2, {})[0] == max(1, cores // 2)
    assert threads_per_process(3 * cores, {})[0] == 1  # never 0
    # Lightning's launcher sets OMP_NUM_THREADS for the ranks it starts: not the user's choice
    assert threads_per_process(1, {"OMP_NUM_THREADS": "1", FROM_USER: "0"})[0] == cores


def test_the_users_omp_num_threads_wins_and_a_bad_one_is_named():
    assert threads_per_process(1, {"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS")
    assert threads_per_process(4, {"OMP_NUM_THREADS": "3", FROM_USER: "1"}) == (3, "OMP_NUM_THREADS")
    with pytest.raises(ValueError, match="`OMP_NUM_THREADS`='two' is not a number"):
        threads_per_process(1, {"OMP_NUM_THREADS": "two"})
    with pytest.raises(ValueError, match="must be >= 1"):
        threads_per_process(1, {"OMP_NUM_THREADS": "0"})
