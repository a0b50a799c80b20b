"""yatt_lightning.distributed.failures (one way to fail together) and collectives.exchange_tensors: tier 1 on one
process, tier 2 on 2 gloo processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers import spawn_gloo
from yatt_lightning.distributed.collectives import exchange_tensors
from yatt_lightning.distributed.failures import RankFailure, agree, fail_together


def test_one_process_has_nobody_to_tell():
    agree(None)
    with pytest.raises(KeyError, match="answer"):  # the error itself, not a wrapper
        with fail_together():
            raise KeyError("answer")


def _rank_main(rank: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    try:
        with fail_together():
            if rank == 1:
                raise ValueError("prompt 3 is too long")
    except RankFailure as err:
        out["first"] = (err.origin, err.cause, err.agreed, str(err), type(err.__cause__).__name__)
    # Rank 0 heard of rank 1's failure by a message (the stream) before rank 1 reports its own error.
    heard = RankFailure(1, "RewardError: judge crashed", agreed=False) if rank == 0 else None
    own = RuntimeError("judge crashed") if rank == 1 else None
    try:
        agree(heard or own)
    except RankFailure as err:
        out["second"] = (err.origin, err.cause, err.agreed)
    agree(None)  # nobody failed: returns on both
    # Rank 0 sends 1 sample to itself and 2 to rank 1; rank 1 sends 0 to rank 0 and 3 to itself.
    counts = [1, 2] if rank == 0 else [0, 3]
    outgoing = [
        {"ids": torch.arange(n, dtype=torch.long) + 10 * rank, "pair": torch.full((n, 2), float(rank))} for n in counts
    ]
    received, nbytes = exchange_tensors(outgoing)
    out["exchange"] = ([r["ids"].tolist() for r in received], [tuple(r["pair"].shape) for r in received], nbytes)
    dist.destroy_process_group()
    queue.put((rank, out))


def test_two_ranks_fail_together_naming_the_origin_and_exchange_tensors():
    results = spawn_gloo(_rank_main)
    r0, r1 = results[0], results[1]
    assert r0["first"] == (1, "ValueError: prompt 3 is too long", True,
                           "another rank failed (rank 1): ValueError: prompt 3 is too long", "NoneType")  # fmt: skip
    assert r1["first"] == (1, "ValueError: prompt 3 is too long", True,
                           "rank 1 failed: ValueError: prompt 3 is too long", "ValueError")  # fmt: skip
    # The rank with an error of its own is the origin, whatever the other heard.
    assert r0["second"] == r1["second"] == (1, "RuntimeError: judge crashed", True)
    assert r0["exchange"] == ([[0], []], [(1, 2), (0, 2)], 0)
    assert r1["exchange"] == ([[0, 1], [10, 11, 12]], [(2, 2), (3, 2)], 2 * 8 + 2 * 2 * 4)


def test_a_non_finite_loss_names_which_loss():
    """One process: a NaN in the critic's value loss is reported as the critic's, the policy's as the policy's."""
    import pytest
    import torch

    from yatt_lightning.distributed.failures import NonFiniteLossError, check_finite

    with pytest.raises(NonFiniteLossError, match=r"^the critic's value loss is NaN/inf at step 3 \(1 micro-batches\)"):
        check_finite(
            [{"finite": torch.tensor(False)}, {"finite": torch.tensor(True)}], 3, what="the critic's value loss"
        )
    with pytest.raises(NonFiniteLossError, match=r"^the policy loss is NaN/inf at step 0"):
        check_finite([{"finite": torch.tensor(False)}], 0)


def test_the_watchdog_names_the_rank_that_never_arrives_and_its_stage_within_its_deadline():
    """Tier 2: rank 1 is stuck in its reward stage; rank 0 waits in a collective. Both exit 1 within the
    deadline plus a bound; rank 0's screen names rank 1 and the stage; rank 1's stack shows where it is."""
    import re
    import socket
    import subprocess
    import sys
    import time

    from tests.helpers import SCRIPTS

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    deadline = 2.0
    procs = [
        subprocess.Popen([sys.executable, str(SCRIPTS / "watchdog_ranks.py"), str(rank), str(port), str(deadline)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        for rank in (0, 1)
    ]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=90))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError("the watchdog did not stop the ranks") from None
    ended = time.time()
    started = max(float(re.search(r"started (\S+)", out).group(1)) for out, _ in outs)
    assert [p.returncode for p in procs] == [1, 1], outs
    assert ended - started < deadline + 10
    screen = [line for line in outs[0][1].splitlines() if "watchdog:" in line and "rank 1 is still" in line]
    assert screen and re.search(r"rank 0 has waited \d+ s at 'train' of step 3 for its peers: rank 1 is still at 'reward' of step 3 "
                                r"\(for \d+ s\); it never arrived.*`trainer.strategy.watchdog_minutes`", screen[-1]), outs[0][1]  # fmt: skip
    assert "in stuck_reward" in outs[1][1] and "rank 1 is late" in outs[1][1], outs[1][1]  # its stack, in its log
    assert not any("rank 0 has waited" in line for line in outs[1][1].splitlines() if "yatt" in line)
