"""The local ranks forked from rank 0 (``yatt_lightning.distributed.fork_launcher``): each takes its own rank
as Lightning's re-run command would have, rank 0 watches them as Lightning watches its subprocesses, and a
process running other threads keeps Lightning's launcher (tier 1: one plain Python process, no Megatron; every
multi-process run of the suite launches through it)."""

from __future__ import annotations

import json
import signal
import sys
import time

from tests.helpers import run

LAUNCH = r"""
import json, os, sys, time
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from yatt_lightning.distributed.fork_launcher import ForkedRanks

out, fail = sys.argv[1], int(sys.argv[2])
preloaded = []
env = LightningEnvironment()
launcher = ForkedRanks(env, num_processes=3, num_nodes=1, preload=lambda: preloaded.append(os.getpid()))

def work(tag):
    rank = int(os.environ["LOCAL_RANK"])
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"tag": tag, "pid": os.getpid(), "ppid": os.getppid(), "zero_only": rank_zero_only.rank,
                   "env_rank": env.local_rank(), "world": os.environ["WORLD_SIZE"], "preloaded": preloaded}, f)
    if rank == 2 and fail:
        os._exit(3)
    if rank == 0 and fail:
        time.sleep(30)  # the observer ends this process once it sees rank 2's exit code
    return rank

print("rank", launcher.launch(work, "a run's arguments"), "returned", flush=True)
"""


def test_forked_ranks_take_their_rank_share_what_rank_zero_loaded_and_a_dead_rank_ends_the_run(tmp_path):
    proc = run([sys.executable, "-c", LAUNCH, str(tmp_path), "0"], timeout=120)
    got = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)}
    parent = got[0]["pid"]
    for r, g in got.items():
        # each rank ran the launched function with its arguments, as its own rank, in its own process forked
        # from rank 0 (a launcher that ran the function twice in one process, or left LOCAL_RANK at 0, fails)
        assert g["tag"] == "a run's arguments" and g["env_rank"] == g["zero_only"] == r and g["world"] == "3"
        assert (g["pid"] == parent) if r == 0 else (g["ppid"] == parent)
        assert g["preloaded"] == [parent], "preload runs once, in rank 0, before the fork"
    assert proc.stdout.count("returned") == 3 and "rank 0 returned" in proc.stdout  # each rank goes on after

    (tmp_path / "fail").mkdir()
    t0 = time.monotonic()
    proc = run([sys.executable, "-c", LAUNCH, str(tmp_path / "fail"), "1"], timeout=120, check=False)
    # Lightning's observer (every 5 s) saw rank 2's exit code 3 and killed the run: not rank 0's 30 s sleep
    assert proc.returncode == -signal.SIGKILL and time.monotonic() - t0 < 25, (proc.returncode, proc.stderr[-2000:])


def test_a_process_running_another_thread_keeps_lightnings_launcher():
    code = (
        "import threading; from yatt_lightning.distributed.fork_launcher import ForkedRanks as F\n"
        "alone = F.usable(); stop = threading.Event(); t = threading.Thread(target=stop.wait); t.start()\n"
        "print(alone, F.usable()); stop.set()"
    )
    # a fork would copy the other thread's locks but not the thread
    assert run([sys.executable, "-c", code], timeout=60).stdout.split() == ["True", "False"]
