"""Checkpoint folders that are complete or absent, and the ``latest`` tracker that only points at complete ones.

Layout of one checkpoint (``step-00000020/``)::

    weights/              Megatron distributed checkpoint: model + optimizer, loadable in any TP/PP/DP layout
    trainer_rank<r>.pt    rank r's Lightning state: loops, data-loader position, callbacks, RNG
    hf/                   the policy's Hugging Face config and tokenizer (for ``yatt export``)
    lora_base.json        with ``model.lora``: weights/ holds the adapters and their optimizer only; this names
                          the base model folder and its weights' SHA-256 (checked on resume and export)
    manifest.json         every file with its size and CRC-32, written last

Writing goes to ``<name>.tmp``. Only when every rank's files are on disk (for an asynchronous save: when
the background writers of every rank have finished) does :func:`finalize` gather each rank's share of
the manifest, write it, ``fsync``, rename the folder to its final name and then replace the ``latest``
tracker (write-then-rename). A crash at any moment therefore leaves ``latest`` pointing at a checkpoint
whose every file was written and listed; a leftover ``.tmp`` folder is never read and is removed by the
next save. Loading verifies sizes of all files on every rank and checksums of a share of them per rank.

Checkpoints are ordered by the step their manifest records, never by file times (a folder copied with
``cp -r`` or restored from a backup behaves as the original). The manifest also records the run's
``run_id`` (a fresh run gets a new one; a resumed run keeps the one it resumed from), so that falling
back past a broken checkpoint and keeping the newest ``keep_last`` never mix two runs written into one
folder.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import queue
import shutil
from pathlib import Path
from typing import Any

import torch

from yatt_lightning.checkpoint import direct_io, lora_base
from yatt_lightning.checkpoint.listing import (  # noqa: F401 (public here too)
    TRACKER,
    checkpoint_step,
    complete_checkpoints,
    read_manifest,
    resume_target,
    run_id_of,
    step_of_name,
    tracked,
)
from yatt_lightning.checkpoint.verify import MANIFEST, _crc32, verify  # noqa: F401 (public here too)
from yatt_lightning.checkpoint.writer import _write_buckets_in_order, async_calls_queue, without_zip_crc  # noqa: F401
from yatt_lightning.distributed import failures
from yatt_lightning.models import lora
from yatt_lightning.models.cpu import cpu_mode, megatron_cpu_context

log = logging.getLogger(__name__)

WEIGHTS = "weights"
WEIGHT_SUFFIXES = lora_base.WEIGHT_SUFFIXES


def hf_files(model_path: Path) -> list[Path]:
    """Every file of the model folder but its weights (config, the tokenizer's files whatever their names, chat
    templates, the processor's): what makes an export a whole Hugging Face folder."""
    return sorted(p for p in model_path.iterdir() if p.is_file() and p.name[0] != "." and not p.name.endswith(WEIGHT_SUFFIXES))


class CheckpointError(RuntimeError):
    """A checkpoint is missing files, has files of the wrong size or content, or cannot be found."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def trainer_state_file(folder: Path, rank: int) -> Path:
    return folder / f"trainer_rank{rank}.pt"


# ---------------------------------------------------------------------------------------------- save
def start_write_results_queue() -> None:
    """Start the queue through which Megatron's asynchronous writers report. On CPU the writer is a thread
    of this process (:func:`async_calls_queue`), so a plain thread-safe queue serves. On GPU it is a forked
    process and the queue is served by a spawned manager process. Started Megatron's way, that process keeps
    the default signal handlers, so a SIGTERM or SIGUSR1 sent to the whole process group (SLURM's time
    limit and ``--signal``, ``kill -TERM -<pgid>``) kills it and every later save fails; this one blocks
    those signals and SIGINT (it ends with the training process). Uses ``filesystem_async._results_queue``
    of the pinned megatron-core."""
    import multiprocessing
    import signal
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    if cpu_mode():
        filesystem_async._results_queue = queue.Queue()
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    deaf = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    manager.start(initializer=functools.partial(signal.pthread_sigmask, signal.SIG_BLOCK, deaf))
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive


def begin(strategy, trainer_state: dict[str, Any], final: Path, *, asynchronous: bool) -> Any:
    """Collective: start writing a checkpoint into ``<final>.tmp``.

    Returns Megatron's ``AsyncRequest`` when ``asynchronous`` (the caller schedules it on
    :func:`async_calls_queue`, whose writer runs in a forked process on GPU and in a thread on CPU, and
    :func:`finalize` runs as its last finalize step), else ``None`` once the files are written (the
    caller then calls :func:`finalize`).
    """
    from functools import partial

    from megatron.core import dist_checkpointing

    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    module = strategy.lightning_module
    with failures.fail_together():  # a full disk on rank 0 stops every rank here, not in the barrier
        if strategy.is_global_zero:
            for stale in final.parent.glob("*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)  # a save that never finished (crash, kill)
            (tmp / WEIGHTS).mkdir(parents=True)
            (tmp / "hf").mkdir()
            model_path = Path(module.model_path)
            for path in hf_files(model_path):
                shutil.copy2(path, tmp / "hf" / path.name)
            if getattr(module.policy, "lora", None) is not None:  # adapters only: the base is referenced
                _write_durable(tmp / lora_base.BASE_FILE, json.dumps(lora_base.reference(model_path, module.policy.lora)).encode())
    strategy.barrier("checkpoint-begin")
    state_bytes = _torch_bytes(trainer_state)  # captured now; written (and fsynced) with the shards
    if _trainers_group(strategy) is not None:  # a disaggregated placement: the rollout ranks write first
        if strategy.role.only_rolls_out:
            _write_and_describe(None, tmp, strategy.global_rank, state_bytes)  # no weights; the trainers finalize
        strategy.barrier("checkpoint-rollout-parts")
        if strategy.role.only_rolls_out:
            return None
    with megatron_cpu_context(), without_zip_crc():  # a synchronous save writes here (or in its forks)
        request = dist_checkpointing.save(
            _sharded_state(module.policy, getattr(module, "critic_model", None), is_loading=False), str(tmp / WEIGHTS), async_sharded_save=asynchronous
        )
    rank = strategy.global_rank
    if asynchronous:
        # Checksums are computed by the background writer as it writes this rank's shards (on CPU), or
        # right after (on GPU), so the step loop never reads the shards back.
        write = request.async_fn
        if write is not None and cpu_mode():
            write = partial(_write_buckets_in_order, *write.args)  # (transforms, use_msc) of Megatron's writer
        request = request._replace(async_fn=partial(_write_and_describe, write, tmp, rank, state_bytes))
        request.add_finalize_fn(partial(finalize, strategy, final))
        return request
    with failures.fail_together(_trainers_group(strategy)):
        _write_and_describe(None, tmp, rank, state_bytes)
    return None


def finalize(strategy, final: Path) -> None:
    """Collective: manifest, rename ``.tmp`` to ``final``, then point ``latest`` at it. In a disaggregated
    placement it is the trainers' (the rollout ranks wrote their parts in :func:`begin`)."""
    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    group = _trainers_group(strategy)
    if getattr(strategy, "role", "colocated") == "rollout":
        return
    rank = strategy.global_rank
    world = torch.distributed.get_world_size(group) if group is not None else strategy.world_size
    partial_manifest = tmp / f"manifest_rank{rank}.json"
    error = None
    try:
        entries = json.loads(partial_manifest.read_text())
        partial_manifest.unlink()
        if rank == 0:  # files written once, by rank 0, in Megatron's finalisation or before the save
            shared = [p for p in sorted(tmp.rglob("*")) if p.is_file() and _shared_file(p, tmp)]
            entries.update({str(p.relative_to(tmp)): _describe(p) for p in shared})
            for other in strategy.placement.rollout if group is not None else []:  # durable since begin()
                part = tmp / f"manifest_rank{other}.json"
                entries.update(json.loads(part.read_text()))
                part.unlink()
    except (OSError, ValueError) as err:  # every rank must hear of it: the others wait in the gather below
        error_file = tmp / f"error_rank{rank}.txt"
        cause = error_file.read_text() if error_file.is_file() else f"{type(err).__name__}: {err}"
        error = CheckpointError(f"the checkpoint of {final.name} was not saved: rank {rank}: {cause}")
    failures.agree(error, group)  # nothing is renamed or tracked unless every rank wrote its part
    gathered = [None] * world
    if world > 1:
        torch.distributed.all_gather_object(gathered, entries, group=group)
    else:
        gathered = [entries]
    if rank == 0:
        files = {k: v for part in gathered for k, v in part.items()}
        manifest = {"format": 1, "world_size": strategy.world_size, "step": step_of_name(final.name),
                    "run_id": getattr(strategy, "run_id", None), "files": files}  # fmt: skip
        for directory in (tmp / WEIGHTS, tmp / "hf", tmp):
            _fsync_dir(directory)  # the files' names are durable before the manifest lists them
        _write_durable(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        # Saving a step that already has a checkpoint (a new run in an old folder): the old one moves
        # aside rather than being deleted first, so a crash in between leaves a complete folder to load.
        aside = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        _write_durable(final.parent / TRACKER, final.name.encode(), atomic=True)
        shutil.rmtree(aside, ignore_errors=True)
    if group is None:
        strategy.barrier("checkpoint-finalized")
    else:
        torch.distributed.barrier(group=group)


def _trainers_group(strategy):
    """The trainers' group in a disaggregated placement (its two sides save at one point but the trainers
    finish the checkpoint alone, asynchronously); ``None`` when every rank trains."""
    return strategy.controller.group if getattr(strategy, "role", "colocated") != "colocated" else None


def _write_and_describe(write, tmp: Path, rank: int, state_bytes: bytes, *args, **kwargs) -> None:
    """Run Megatron's writer (if this rank has shards to write; it reports its own errors), write this
    rank's trainer state, then record this rank's files with sizes and checksums in
    ``manifest_rank<r>.json``. Runs in the background process when the save is asynchronous. A failure
    of our part leaves ``error_rank<r>.txt`` (when the disk lets it) for :func:`finalize` to report."""
    if write is not None:
        with without_zip_crc():
            write(*args, **kwargs)
    try:
        _write_durable(trainer_state_file(tmp, rank), state_bytes)
        files = [trainer_state_file(tmp, rank), *sorted((tmp / WEIGHTS).glob(f"__{rank}_*"))]
        entries = {str(p.relative_to(tmp)): _describe(p) for p in files}  # each file fsynced as it is read
        _fsync_dir(tmp / WEIGHTS)
        _write_durable(tmp / f"manifest_rank{rank}.json", json.dumps(entries).encode())
    except BaseException as err:
        with contextlib.suppress(OSError):
            _write_durable(tmp / f"error_rank{rank}.txt", f"{type(err).__name__}: {err}".encode())
        raise


def _shared_file(path: Path, root: Path) -> bool:
    """Files written once (by rank 0) rather than per rank."""
    rel = path.relative_to(root)
    name = rel.name
    per_rank = name.startswith(("trainer_rank", "manifest_rank")) or (rel.parts[0] == WEIGHTS and name.startswith("__"))
    return not per_rank


# ---------------------------------------------------------------------------------------------- resolve
def resolve(strategy, path: Path) -> Path:
    """Collective: the checkpoint to load for ``path``.

    ``path`` is a checkpoint folder (it must be intact) or a ``latest`` tracker file: then the newest
    intact checkpoint of that directory, starting from the tracker's, skipping (and reporting) any that
    is incomplete or corrupted.
    """
    path = Path(path)
    if path.name == TRACKER:
        directory = path.parent
        named = tracked(directory)
        lineage = run_id_of(named) if named is not None else None  # fall back within the tracked run only
        others = [c for c in complete_checkpoints(directory, run_id=lineage) if c != named]
        candidates = ([named] if named is not None else []) + others
        for candidate in candidates:
            problems = _verify_everywhere(strategy, candidate)
            if not problems:
                return candidate
            log.warning(
                "checkpoint %s is not usable (%s); falling back to the next older complete checkpoint",
                candidate, "; ".join(problems[:3]),
            )  # fmt: skip
        raise CheckpointError(
            f"no intact checkpoint in {directory} (tried: {', '.join(c.name for c in candidates) or 'none'})"
        )
    if not path.exists():
        raise CheckpointError(f"`--ckpt_path`: {path} does not exist; pass a checkpoint folder or `last`.")
    problems = _verify_everywhere(strategy, path)
    if problems:
        raise CheckpointError(
            f"checkpoint {path} is incomplete or corrupted: {'; '.join(problems[:5])}. Pass another checkpoint, "
            f"or `--ckpt_path last` to use the newest intact one."
        )
    return path


def _verify_everywhere(strategy, folder: Path) -> list[str]:
    problems = verify(folder, strategy.global_rank, strategy.world_size)
    if strategy.world_size > 1:
        gathered = [None] * strategy.world_size
        torch.distributed.all_gather_object(gathered, problems)
        problems = sorted({p for part in gathered for p in part})
    return problems


# ---------------------------------------------------------------------------------------------- load
def load_trainer_state(strategy, folder: Path) -> dict[str, Any]:
    saved_world = json.loads((folder / MANIFEST).read_text()).get("world_size")
    if saved_world != strategy.world_size:  # each rank's data position belongs to a sampler of that many ranks
        raise CheckpointError(
            f"{folder} was written by {saved_world} processes and this run has {strategy.world_size}: loading it "
            "needs the same number (`trainer.devices` x `trainer.num_nodes`). To go on with another layout, "
            "export the policy (`yatt export`) and start a new run (or `yatt validate --model.policy.path`) from it."
        )
    state_file = trainer_state_file(folder, strategy.global_rank)
    if not state_file.is_file():
        raise CheckpointError(f"{folder} has no {state_file.name}: the checkpoint is incomplete.")
    checkpoint = torch.load(state_file, map_location="cpu", weights_only=False)
    checkpoint["_yatt_checkpoint_dir"] = str(folder)
    return checkpoint


def load_policy(strategy, checkpoint: dict[str, Any]) -> None:
    """Collective: load the sharded model and optimizer into this rank's policy."""
    from megatron.core import dist_checkpointing

    folder = Path(checkpoint["_yatt_checkpoint_dir"])
    module = strategy.lightning_module
    if module.policy is None:
        return  # a disaggregated rollout rank: it gets the trainers' weights through the weight channel
    critic = getattr(module, "critic_model", None)
    adapters = getattr(module.policy, "lora", None)
    try:  # the CLI checked before any engine started; a run started in Python is checked here
        lora_base.check(folder, Path(module.model_path), adapters)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    with megatron_cpu_context():
        state = dist_checkpointing.load(_sharded_state(module.policy, critic, is_loading=True), str(folder / WEIGHTS))
        for model, prefix in ((module.policy, "model"), (critic, "critic")):
            if model is None:
                continue
            model_state = {k.removeprefix(f"{prefix}."): v for k, v in state[prefix].items()}
            # Megatron adds `_extra_state` entries (Transformer Engine metadata) that local layers do not have.
            result = model.local_module().load_state_dict(model_state, strict=False)
            missing = [k for k in result.missing_keys if lora.is_lora(k)] if prefix == "model" and adapters else result.missing_keys
            if missing:
                raise CheckpointError(f"{folder}: the checkpoint lacks {prefix} parameters {missing[:5]}")
            if model.optimizer is not None and _optimizer_key(prefix) in state:
                model.optimizer.load_state_dict(state[_optimizer_key(prefix)])


def remove(folder: Path) -> None:
    shutil.rmtree(Path(folder), ignore_errors=True)


# ---------------------------------------------------------------------------------------------- helpers
def _sharded_state(policy, critic=None, *, is_loading: bool) -> dict:
    """The policy's (and PPO's critic's) parameters and optimizer states, as Megatron's sharded state."""
    state = {}
    for model, prefix in ((policy, "model"), (critic, "critic")):
        if model is None:
            continue
        model_sd = model.local_module().sharded_state_dict(prefix=f"{prefix}.")
        if getattr(model, "lora", None) is not None:  # the adapters only; the frozen base stays in its folder
            model_sd = lora.checkpoint_state(model_sd)
        state[prefix] = model_sd
        if model.optimizer is not None:
            state[_optimizer_key(prefix)] = model.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return state


def _optimizer_key(prefix: str) -> str:
    return "optimizer" if prefix == "model" else f"{prefix}_optimizer"  # the policy's key is the original one


def _torch_bytes(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _write_durable(path: Path, data: bytes, atomic: bool = False) -> None:
    target = path.with_name(path.name + ".partial") if atomic else path
    with open(target, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        os.replace(target, path)
        _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe(path: Path) -> dict:
    """Size and checksum of a file written for a checkpoint, durable once this returns: as its writer
    computed them (``direct_io``, already fsynced), or read back here and fsynced."""
    known = direct_io.take_description(path)
    if known is not None:
        return {"size": known[0], "crc32": known[1]}
    return {"size": path.stat().st_size, "crc32": _crc32(path, fsync=True)}
