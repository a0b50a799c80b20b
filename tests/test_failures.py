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
