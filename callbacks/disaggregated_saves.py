"""AsyncCheckpoint's part in a disaggregated placement: the trainers decide at their safe points and the
rollout ranks follow (:mod:`~yatt_lightning.placement.save_points`), and after a rollout rank's own failure
both sides save the state they reached."""

from __future__ import annotations

import logging

from yatt_lightning.checkpoint import folder as ckpt

log = logging.getLogger("yatt_lightning.checkpoint.folder")


class DisaggregatedSavePoints:
    """Mixed into :class:`~yatt_lightning.callbacks.AsyncCheckpoint` (its ``save``, ``_stop``, settings and
    signals)."""

    def _decisions(self, trainer, final: bool) -> list:
        """The trainers decide; a rollout rank reports its signal and takes the decisions it follows now."""
        placement = trainer.strategy.placement
        signum = self._signals.received if self.save_on_signal else None
        if trainer.strategy.role.only_rolls_out:
            if signum is not None and not self._stop_requested:
                placement.request_stop(signum)
                self._stop_requested = True
            return placement.decisions(final)
        step = trainer.global_step
        due = bool(self.every_n_steps and step % self.every_n_steps == 0) or self._timer_due(trainer)
        if final:
            due, signum = self.save_at_end, None  # the run ends here anyway
        return [placement.decide(due and step != self._scheduled_step, signum, step, final)]

    def _follow(self, trainer, decisions: list) -> None:
        for decision in decisions:
            if decision.save:
                if trainer.strategy.role.only_rolls_out:
                    trainer.strategy.placement.join_save(decision)
                self.save(trainer, step=decision.global_step)
            if decision.stop and not decision.final:
                self._stop(trainer, decision.signal, decision.global_step)

    def _save_after_a_rollout_failure(self, trainer, exception: BaseException) -> None:
        """Disaggregated: a rollout rank that raised (the only one) and its trainers save the state they
        reached: the trainers after every batch it sent, the rollout rank after the last one. Any other
        failure on either side leaves ``latest`` as it is."""
        from yatt_lightning.placement.batch_channel import ProducerFailed

        placement, role = trainer.strategy.placement, trainer.strategy.role
        joins = isinstance(exception, ProducerFailed) and exception.joins_save
        if (role.only_trains and not joins) or (role.only_rolls_out and not placement.joins_save_after(exception)):
            log.error(
                "not saving after %s: only a rollout rank's own failure (with one rollout rank) leaves both "
                "sides in a state to save. `latest` in %s is unchanged.", type(exception).__name__, self.dirpath,
            )  # fmt: skip
            return
        saved = None
        try:
            if role.only_trains:
                trained = trainer.global_step != self._start_step
                decisions = [placement.after_failure(trainer.global_step, save=trained)]
            else:  # it follows the trainers' decisions, as at a safe point, to the one after its failure
                decisions = placement.decisions_after_failure()
            for decision in decisions:
                if decision.save:
                    if role.only_rolls_out:
                        placement.join_save(decision)
                    self.save(trainer, asynchronous=False, step=decision.global_step)
                    saved = decision.global_step
            placement.finish(placement.steps - 1)  # both ends close the channels: their threads end
            if saved is None:
                log.info("not saving after %s: no step was trained since the run started", type(exception).__name__)
            else:
                log.error(
                    "after %s: the trainers' state after step %d and the rollout rank's after the last batch it "
                    "sent are consistent and were saved to %s; the batch of the failed step is skipped on resume.",
                    type(exception).__name__, saved, self.dirpath / ckpt.checkpoint_name(saved),
                )  # fmt: skip
        except BaseException as err:  # never hide the original error (CheckpointException is a BaseException)
            log.error("saving after %s failed too: %s", type(exception).__name__, err)
