"""One rank of a 2-process gloo job in which rank 1 never reaches a collective rank 0 waits in.

    python tests/scripts/watchdog_ranks.py RANK PORT DEADLINE_S

Both ranks mark the stages of step 3 as a run's step does (rollout, reward); rank 1 then sleeps in its
reward stage (a function without a deadline) while rank 0 waits in the all-reduce that ends scoring.
The watchdog must stop both, naming rank 1 and its stage.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from yatt_lightning.distributed.watchdog import Watchdog


def stuck_reward() -> None:
    time.sleep(600)


def main() -> None:
    from yatt_lightning.run.process_exit import collect_once_at_exit

    collect_once_at_exit()  # as `yatt` ends: without the interpreter's whole-heap collections at exit
    rank, port, deadline = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dog = Watchdog(deadline, rank, [0, 1], poll_s=0.2).start()
    dist.all_reduce(torch.ones(1))  # both ranks are up
    print(f"rank {rank} started {time.time()!r}", flush=True)
    dog.enter("rollout", 3)
    dog.enter("reward", 3)
    if rank == 1:
        stuck_reward()
    dog.enter("train", 3)
    dist.all_reduce(torch.ones(1))  # rank 1 never arrives
    os._exit(0)


if __name__ == "__main__":
    main()
