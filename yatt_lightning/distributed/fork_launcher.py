"""A machine's local ranks forked from rank 0 when the run starts, on CPU.

Lightning's subprocess launcher starts local ranks 1..N-1 by running the command again (``LOCAL_RANK=r python
...``): each rank imports torch, Lightning, Megatron-Core, transformers and vLLM and builds its trainer from the
configuration again, ~10 s of one core per rank before it stands where rank 0 stood when it launched them. Those
ranks compute exactly what rank 0 computed (the same configuration, seeds and objects: nothing before the launch
depends on the rank), so :class:`ForkedRanks` copies rank 0 at that point instead: ``os.fork()`` at Lightning's
launch, each child takes its ``LOCAL_RANK`` and goes on into the run as the re-run command would have. The
environment (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``WORLD_SIZE``), the observer that ends every rank
when one dies, and everything after the launch are Lightning's.

CPU only: a process that uses CUDA cannot be forked safely, so GPU runs keep Lightning's launcher (as do runs whose
processes a launcher outside creates: torchrun, SLURM). A process that runs threads other than its main one at the
launch keeps it too: a fork copies only the calling thread, and a lock another thread held would stay held.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import _launch_process_observer
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

log = logging.getLogger(__name__)


class _ForkedRank:
    """A forked rank as Lightning's process observer sees a ``subprocess.Popen``: ``poll``, ``returncode``,
    ``pid``, ``send_signal`` (``returncode`` is ``-signal`` for a rank a signal ended, as ``Popen``'s is)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere
                self.returncode = 0
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass


class ForkedRanks(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher, its children forked from rank 0 instead of started anew (module docstring).

    ``preload``: called once before the fork (imports that every rank would make after it, such as the rollout
    engine's), so that the ranks share them.
    """

    def __init__(self, cluster_environment: Any, num_processes: int, num_nodes: int,
                 preload: Callable[[], None] | None = None) -> None:  # fmt: skip
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.preload = preload

    @staticmethod
    def usable() -> bool:
        """Forking is safe here now: no CUDA, and no thread but this one."""
        import torch

        return not torch.cuda.is_available() and threading.active_count() == 1

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            if self.preload is not None and self.num_processes > 1 and self.usable():
                self.preload()
            if not self.usable():  # (also when what preload imported started a thread)
                others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
                log.debug("local ranks started by Lightning's launcher (threads running: %s)", others)
                return super().launch(function, *args, trainer=trainer, **kwargs)
            self._fork_children()
            if self.procs:
                _launch_process_observer(self.procs)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)

    def _fork_children(self) -> None:
        self._check_can_spawn_children()
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        for local_rank in range(1, self.num_processes):
            sys.stdout.flush()  # what Python holds in its buffers would otherwise be written twice
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child: rank `local_rank`, as `LOCAL_RANK=r` made it in the re-run command
                os.environ["LOCAL_RANK"] = str(local_rank)
                rank_zero_only.rank = utils_rank_zero_only.rank = local_rank  # the re-run's import read it
                self.procs = []
                return
            self.procs.append(_ForkedRank(pid))
