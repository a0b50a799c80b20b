"""How many torch threads a process of a run gets: the cores it may use, shared by the run's processes on
its node.

``OMP_NUM_THREADS`` set by the user wins. Otherwise a process gets ``cores // processes_on_node`` (at
least one), where ``cores`` is what the OS lets the process run on (its affinity: a SLURM or container CPU
set, not the machine's count). So ``yatt fit`` in one process on a 2-core machine trains and samples with
2 threads, and ``--trainer.devices 2`` gives each process one (oversubscribed threads made steps 3-10x
slower on a loaded 2-core machine). The count is set before the engine starts: vLLM's CPU worker binds
its threads then and turns ``torch.set_num_threads`` into a no-op.
"""

from __future__ import annotations

import os

USER_SET = "OMP_NUM_THREADS"
# Whether OMP_NUM_THREADS was the user's when `yatt` started ("1" / "0"; the launched ranks inherit it):
# Lightning's launcher sets OMP_NUM_THREADS itself (cores // processes, by the machine's count) for the
# processes it starts, and that must not read as the user's choice.
FROM_USER = "YATT_OMP_FROM_USER"


def remember_user_setting() -> None:
    """At the command's start, before anything sets OMP_NUM_THREADS: note whether the user did."""
    os.environ.setdefault(FROM_USER, "1" if os.environ.get(USER_SET, "").strip() else "0")


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def threads_per_process(processes_on_node: int, environ: dict[str, str] | None = None) -> tuple[int, str]:
    """The thread count for one of ``processes_on_node`` processes, and where it came from (for the log)."""
    environ = os.environ if environ is None else environ
    explicit = environ.get(USER_SET, "").strip() if environ.get(FROM_USER, "1") == "1" else ""
    if explicit:
        try:
            threads = int(explicit)
        except ValueError:
            raise ValueError(f"`OMP_NUM_THREADS`={explicit!r} is not a number of threads; unset it or give e.g. 2.") from None
        if threads < 1:
            raise ValueError(f"`OMP_NUM_THREADS`={threads} must be >= 1; unset it to use every core.")
        return threads, "OMP_NUM_THREADS"
    cores = available_cores()
    per = max(1, cores // max(1, processes_on_node))
    return per, f"{cores} cores / {processes_on_node} process{'es' if processes_on_node > 1 else ''} on this node"


def apply(processes_on_node: int) -> tuple[int, str]:
    """Set torch's (and OpenMP's, MKL's) thread count for this process; returns it and its source."""
    import torch

    threads, source = threads_per_process(processes_on_node)
    torch.set_num_threads(threads)
    os.environ[USER_SET] = str(threads)  # what the engine and any child process read
    return threads, source
