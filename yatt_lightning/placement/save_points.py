"""The save points of the disaggregated placement: how trainers and rollout ranks agree to checkpoint and stop.

With :class:`~yatt_lightning.callbacks.AsyncCheckpoint`, after each RL step ``s`` the
trainers decide (:meth:`decide`: the schedule, the timer, a signal on any rank) whether every rank saves and
whether the run stops, and tell the rollout ranks. A rollout rank follows the decision of step ``s`` at its
own safe point after producing step ``s + queue_size - 1`` (it cannot produce further before the trainers'
step ``s`` anyway): it marks the end of what it sent and joins the save. The checkpoint then holds the
trainers after step ``s``, the batches they have not trained on yet (steps ``s + 1 .. s + queue_size - 1``,
held in the trainers' state), and the rollout rank after producing them (its data position and RNG). On
resume the trainers publish their version first, and the rollout rank goes on from there. With ``fixed_lag``
a resumed run is bitwise the run that was never interrupted.
"""

from __future__ import annotations

import torch

from yatt_lightning.placement.base import rank
from yatt_lightning.placement.batch_channel import SaveMarker, StopRequest
from yatt_lightning.placement.weight_channel import DECISION, SaveDecision


class SavePoints:
    """:class:`~yatt_lightning.placement.disaggregated.Disaggregated`'s part in a checkpoint (AsyncCheckpoint
    calls these); it uses the placement's channels, steps and versions."""

    def decide(self, save: bool, signal: int | None, global_step: int, final: bool = False) -> SaveDecision:
        """Trainers, at the safe point after their step: agree (over the trainers) on saving and stopping,
        counting a signal a rollout rank reported, and tell the rollout ranks."""
        asked = 0 if final else (self.inbox.stop_requested or 0)  # the run ends here anyway
        flags = torch.tensor([int(save), signal or 0, asked], dtype=torch.int64)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self.controller.group)
        stop = int(max(flags[1], flags[2])) or None
        decision = SaveDecision(self.steps - 1, global_step, bool(flags[0]) or stop is not None, stop, self.updates, final)
        if self.publisher is not None:
            self.publisher.publish(DECISION, self.updates, self.steps - 1, decision=decision)
        return decision

    def decisions(self, final: bool = False) -> list[SaveDecision]:
        """Rollout rank, at its safe point: the trainers' decisions it follows now, oldest first: those of the
        trainers' steps up to ``queue_size - 1`` behind its own (``final``, at its end: the next ones, until
        ``trainers_done``)."""
        until = self.steps - self.queue_size  # the trainers' step whose decision this safe point follows
        if final:
            ready, what = (lambda s: bool(s.decisions)), "the trainers' next decision"
        elif until < 0:
            return []
        else:
            ready, what = (lambda s: any(d.step >= until for d in s.decisions)), f"the trainers' decision of step {until}"
        self.idle_at_safe_point += self.receiver.wait(ready, what, self.timeout_s)
        state = self.receiver.state
        taken = [d for d in state.decisions if final or d.step <= until]
        state.decisions = state.decisions[len(taken):]
        self.trainers_done = self.trainers_done or any(d.final for d in taken)
        return taken

    def after_failure(self, global_step: int, save: bool) -> SaveDecision:
        """Trainers whose rollout rank failed (:class:`~yatt_lightning.placement.batch_channel.ProducerFailed`:
        they trained every batch it sent): agree on saving the state they reached, and tell it. The
        checkpoint then holds the trainers after their last step and the rollout rank after the last batch
        it sent (the batch of its failed step is skipped on resume, as a colocated run skips it)."""
        flags = torch.tensor([int(save)], dtype=torch.int64)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN, group=self.controller.group)
        decision = SaveDecision(self.steps - 1, global_step, bool(flags[0]), None, self.updates, final=True,
                                after_failure=True)  # fmt: skip
        if self.publisher is not None:
            self.publisher.publish(DECISION, self.updates, self.steps - 1, decision=decision)
            self.publisher.flush(self.timeout_s)
        return decision

    def decisions_after_failure(self):
        """Rollout rank that failed: the trainers' decisions from here on, oldest first, until the one they
        took after its failure (or their last, or their end): it follows each, as at a safe point."""
        while True:
            what = "the trainers' decision after this rank's failure"
            self.receiver.wait(lambda s: bool(s.decisions) or s.ended, what, self.timeout_s)
            state = self.receiver.state
            if not state.decisions:
                return
            decision = state.decisions.pop(0)
            yield decision
            if decision.after_failure or decision.final:
                return

    def request_stop(self, signal: int) -> None:
        """Rollout rank that received ``signal``: the trainers stop and save at their next safe point."""
        for trainer in self._trainers_served():
            self.sender.send(StopRequest(signal), trainer)

    def join_save(self, decision: SaveDecision) -> None:
        """Rollout rank, before saving for ``decision``: what it sent so far belongs in the trainers' checkpoint."""
        self.saving_for = decision
        for trainer in self._trainers_served():
            self.sender.send(SaveMarker(self.steps - 1), trainer)

    def state_dict(self) -> dict:
        """This rank's part of a checkpoint: a trainer's holds the batches it has not trained on yet."""
        state = {"steps": self.steps, "updates": self.updates, "dropped": self.dropped}
        if rank() in self.rollout:
            state["resume_version"] = self.saving_for.updates if self.saving_for is not None else self.engine_version
        else:
            state["held"] = self.inbox.hold_until_marker(self.timeout_s)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.updates, self.dropped = state["steps"], state["updates"], state["dropped"]
        if "resume_version" in state:
            self.engine_version, self.resume_version = None, state["resume_version"]
        else:
            self.restored, self.must_republish = list(state["held"]), True
            if getattr(self, "inbox", None) is not None:
                self.inbox.held.extend(self.restored)
