"""Which process of a multi-process run shows a failure on the terminal: the rank it began on, once.

When one rank fails its peers fail after it: with an agreed :class:`~yatt_lightning.distributed.failures.
RankFailure` naming it, with a collective that lost its peer (gloo's "Connection closed by peer"), and
on the way out with the C++ runtime's "terminate called without an active exception". Each would print
its own screen. Instead the processes of one run claim the terminal through a file: a rank whose error is
its own claims it at once; a rank whose error came from another rank waits a few seconds for that rank to
claim it, and claims it only if none did (a rank killed outright prints nothing). A rank that does not
claim it writes its screen into its own log (``output.rank<r>.log``). After the screen, the process's
descriptors 1 and 2 point at its log, so what the runtime prints on the way out goes there too.

A process without a log (a run started from Python without :class:`~yatt_lightning.callbacks.RunConsole`)
always prints: its screen has nowhere else to go.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
import uuid
from pathlib import Path

RUN_TOKEN = "YATT_RUN_TOKEN"  # set once by `yatt`, inherited by the ranks Lightning launches
PROCESS_RANK, PROCESS_WORLD = "YATT_PROCESS_RANK", "YATT_PROCESS_WORLD"  # this process's, once known
WAIT_FOR_ORIGIN_S = 5.0

# A collective or channel whose peer went away: this rank's error is another's consequence.
_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|"
    r"Socket Timeout|ProcessGroupGloo.*(closed|reset)|NCCL communicator was aborted",
    re.IGNORECASE,
)


def remember_run() -> None:
    """At the command's start: a token every process of this run shares (Lightning's launched ranks inherit it)."""
    os.environ.setdefault(RUN_TOKEN, uuid.uuid4().hex)


def world_size() -> int:
    """The run's processes (the strategy records them as it sets the process group up; 1 before)."""
    return int(os.environ.get(PROCESS_WORLD, "1"))


def global_rank() -> int:
    return int(os.environ.get(PROCESS_RANK, "0"))


def is_collateral(err: BaseException, rank: int) -> bool:
    """True when ``err`` on ``rank`` is the consequence of another rank's failure."""
    from yatt_lightning.distributed.failures import RankFailure
    from yatt_lightning.run.errors import chain

    errors = chain(err)
    for e in errors:
        if isinstance(e, RankFailure):
            return e.origin != rank
    return any(_PEER_LOST.search(f"{type(e).__name__}: {e}") for e in errors)


def _claim_file() -> Path | None:
    token = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get(RUN_TOKEN)
    if not token:
        return None
    port = os.environ.get("MASTER_PORT", "")
    return Path(tempfile.gettempdir()) / f"yatt-failure-{token}-{port}"


def _claim(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        return False
    except OSError:  # no writable temp folder: every rank prints, as before
        return True


def show(text: str, err: BaseException, log_path: Path | None) -> None:
    """Print ``text`` (the error screen of ``err``) on the terminal if this process is the one to show it,
    else write it into ``log_path``; then point descriptors 1 and 2 at the log."""
    import sys

    multi = world_size() > 1
    path = _claim_file() if multi else None
    if not multi or log_path is None or path is None:
        print(text, file=sys.stderr, flush=True)
        return
    rank = global_rank()
    if is_collateral(err, rank):
        deadline = time.monotonic() + WAIT_FOR_ORIGIN_S
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    mine = _claim(path)
    if mine:
        print(text, file=sys.stderr, flush=True)
    try:
        log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if not mine:
            os.write(log, f"{text}\n(rank {rank}: the terminal shows the failure's origin; this is its consequence here)\n".encode())
    except OSError:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)  # the runtime's words on the way out (gloo, "terminate called ...") into the log
    os.dup2(log, 2)
    os.close(log)
