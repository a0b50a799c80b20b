"""Tier 3: `yatt fit` launched the way clusters launch it, with 2 "nodes" x 1 process on this machine.

torchrun (two invocations with c10d rendezvous, as on two hosts) and SLURM (the variables ``srun`` sets for
``sbatch --nodes 2 --ntasks-per-node 1``, processes started by the test). Each rank's
``tests/scripts/launchers/cluster_probe.py`` callback records the cluster environment Lightning chose and
the ranks it derived; TensorBoard holds the numbers. 3 runs of 3 steps: 25-40 s each on 2 idle cores,
up to ~60 s on busy ones. (Lightning's own launcher, ``--trainer.devices 2`` on one node, was measured
bit-identical to the torchrun and SLURM launches; the SLURM test keeps one such cross-launcher comparison.)
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO, SCRIPTS, read_scalars, run

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CONFIG = REPO / "configs" / "grpo_tiny.yaml"
TIMEOUT = 300  # per process; a rank whose peer died waits in a collective until then
# Variables of an enclosing launcher (CI running inside a SLURM job, say) would decide Lightning's choice.
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PL_", "LSB_", "KUBEFLOW_")
LAUNCHER_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 "NODE_RANK", "GROUP_RANK", "ROLE_RANK")  # fmt: skip
# Wall-clock and memory scalars differ between any two runs; every other scalar is the algorithm's.
UNTIMED = ("time/", "perf/", "idle", "memory/", "process/")  # what differs between two equal runs


@dataclass
class Launch:
    probes: list[dict]  # one per rank, in global-rank order
    scalars: dict[str, list[tuple[int, float]]]
    event_files: list[Path]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _no_launcher_variables():
    with pytest.MonkeyPatch.context() as mp:
        for key in list(os.environ):
            if key.startswith(LAUNCHER_PREFIXES) or key in LAUNCHER_KEYS:
                mp.delenv(key)
        mp.setenv("PYTHONPATH", os.pathsep.join([str(SCRIPTS / "launchers"), os.environ.get("PYTHONPATH", "")]))
        yield


def _fit(out: Path, *extra: str) -> list[str]:
    probe = [{"class_path": "cluster_probe.ClusterProbe", "init_args": {"out_dir": str(out / "probe")}}]
    return [
        "-m", "yatt_lightning.run.cli", "fit", "--config", str(CONFIG), "--trainer.max_steps", "3",
        "--trainer.default_root_dir", str(out), "--trainer.logger.init_args.save_dir", str(out / "runs"),
        "--trainer.callbacks", json.dumps(probe), *extra,
    ]  # fmt: skip


def _launch(out: Path, commands: list[tuple[list[str], dict]]) -> Launch:
    """Start every (command, extra environment) at once, each under ``timeout`` (which stops torchrun with a
    SIGTERM it forwards to its worker), and wait for all."""
    out.mkdir(parents=True, exist_ok=True)
    with _no_launcher_variables(), ThreadPoolExecutor(len(commands)) as pool:
        jobs = [
            pool.submit(run, ["timeout", "-k", "10", str(TIMEOUT), *cmd], cwd=out, env=env, timeout=TIMEOUT + 30)
            for cmd, env in commands
        ]
        for job in jobs:
            job.result()
    probes = [json.loads(p.read_text()) for p in sorted((out / "probe").glob("rank*.json"))]
    return Launch(probes, read_scalars(out / "runs"), sorted((out / "runs").rglob("events.out.tfevents.*")))


def _torchrun(out: Path, *extra: str) -> Launch:
    endpoint, run_id = f"127.0.0.1:{_free_port()}", uuid.uuid4().hex[:8]
    node = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
    ]  # fmt: skip
    fit = _fit(out, "--trainer.num_nodes", "2", "--trainer.devices", "1", *extra)
    return _launch(out, [([*node, "--node-rank", str(rank), *fit], {}) for rank in (0, 1)])


def _slurm_job_id() -> str:
    """A job id whose port (Lightning: 15000 + its last 4 digits) is free now."""
    for port in random.sample(range(15000, 25000), 200):
        if _port_is_free(port):
            return f"77{port - 15000:04d}"
    raise AssertionError("no free port in 15000-24999 for SLURMEnvironment's job-id-derived MASTER_PORT")


def _srun_env(rank: int, job_id: str) -> dict:
    """What srun sets for task ``rank`` of ``sbatch --nodes 2 --ntasks-per-node 1`` (one task per node)."""
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NAME": "yatt-grpo",  # 'bash' or 'interactive' would turn SLURM detection off
        "SLURM_NODELIST": "127.0.0.1,127.0.0.2",  # the first node hosts the rendezvous
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_CPUS_PER_TASK": "1",
        "SLURM_PROCID": str(rank),
        "SLURM_NODEID": str(rank),
        "SLURM_LOCALID": "0",
    }


def _values(launch: Launch, tag: str) -> list[float]:
    return [v for _, v in launch.scalars[tag]]


def _algorithm_scalars(launch: Launch) -> dict[str, list[tuple[int, float]]]:
    return {tag: points for tag, points in launch.scalars.items() if not tag.startswith(UNTIMED)}


def _assert_trained_three_steps(launch: Launch) -> None:
    assert len(launch.event_files) == 1, launch.event_files  # only global rank 0 logs
    for tag in ("reward/mean", "actor/pg_loss", "rollout/logprob_diff_max"):
        assert [step for step, _ in launch.scalars[tag]] == [0, 1, 2], tag
    # After each weight push the engines' logprobs are the policy's (stale weights differ by > 1e-2).
    assert max(_values(launch, "rollout/logprob_diff_max")) < 1e-3
    assert [p["global_step"] for p in launch.probes] == [3, 3]


@pytest.fixture(scope="module")
def torchrun_dp2(tmp_path_factory) -> Launch:
    return _torchrun(tmp_path_factory.mktemp("torchrun_dp2"))


def test_torchrun_two_nodes_data_parallel(torchrun_dp2):
    """torchrun on 2 "nodes": Lightning takes the ranks from torchelastic; the DP replicas stay identical."""
    probes = torchrun_dp2.probes
    assert [p["cluster_environment"] for p in probes] == ["TorchElasticEnvironment"] * 2
    assert [(p["global_rank"], p["node_rank"], p["local_rank"]) for p in probes] == [(0, 0, 0), (1, 1, 0)]
    assert all(p["world_size"] == 2 and p["num_nodes"] == 2 for p in probes)
    assert [(p["data_parallel_rank"], p["tensor_parallel_size"]) for p in probes] == [(0, 1), (1, 1)]
    assert probes[0]["param_checksum"] == probes[1]["param_checksum"]  # gradients all-reduced across nodes
    _assert_trained_three_steps(torchrun_dp2)


def test_torchrun_two_nodes_tensor_parallel(tmp_path):
    """TP=2 across the 2 "nodes": one layer split over both, one vLLM engine shared by them (its external
    launcher reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK, with LOCAL_RANK 0 on both)."""
    launch = _torchrun(tmp_path, "--trainer.strategy.tensor_model_parallel_size", "2")
    probes = launch.probes
    assert [p["cluster_environment"] for p in probes] == ["TorchElasticEnvironment"] * 2
    assert [(p["node_rank"], p["local_rank"]) for p in probes] == [(0, 0), (1, 0)]
    assert [(p["tensor_parallel_rank"], p["tensor_parallel_size"], p["data_parallel_rank"]) for p in probes] == [
        (0, 2, 0), (1, 2, 0),
    ]  # fmt: skip
    _assert_trained_three_steps(launch)


def test_torchrun_two_nodes_rollout_on_one_training_on_the_other(tmp_path):
    """Asynchronous RL across 2 "nodes": the trainer on node 0, the rollout rank (engine, rewards) on node 1;
    batches and weights cross between them over torch.distributed."""
    placement = json.dumps({"class_path": "yatt_lightning.placement.Disaggregated", "init_args": {"max_staleness": 1}})
    launch = _torchrun(tmp_path, "--trainer.strategy.placement", placement)
    probes = launch.probes
    assert [(p["node_rank"], p["role"]) for p in probes] == [(0, "train"), (1, "rollout")]
    assert [p["global_step"] for p in probes] == [3, 3]
    assert probes[1]["param_checksum"] is None and probes[0]["param_checksum"] > 0
    assert len(launch.event_files) == 1  # only the trainer, global rank 0, logs
    assert [step for step, _ in launch.scalars["actor/pg_loss"]] == [0, 1, 2]
    assert max(_values(launch, "async/staleness_max")) <= 1.0


def test_slurm_two_nodes_one_task_each(torchrun_dp2, tmp_path):
    """srun's variables for `sbatch --nodes 2 --ntasks-per-node 1`: Lightning picks SLURMEnvironment, takes
    the ranks from SLURM_PROCID / SLURM_NODEID / SLURM_LOCALID, the rendezvous address from the first node of
    SLURM_NODELIST and the port from the job id; the run equals the torchrun one of the same layout."""
    job_id = _slurm_job_id()
    fit = [sys.executable, *_fit(tmp_path, "--trainer.num_nodes", "2", "--trainer.devices", "1")]
    launch = _launch(tmp_path, [(fit, _srun_env(rank, job_id)) for rank in (0, 1)])
    probes = launch.probes
    assert [p["cluster_environment"] for p in probes] == ["SLURMEnvironment"] * 2
    assert [(p["global_rank"], p["node_rank"], p["local_rank"]) for p in probes] == [(0, 0, 0), (1, 1, 0)]
    assert {(p["MASTER_ADDR"], p["MASTER_PORT"]) for p in probes} == {("127.0.0.1", str(15000 + int(job_id[-4:])))}
    _assert_trained_three_steps(launch)
    assert _algorithm_scalars(launch) == _algorithm_scalars(torchrun_dp2)
    assert probes[0]["param_checksum"] == probes[1]["param_checksum"] == torchrun_dp2.probes[0]["param_checksum"]
