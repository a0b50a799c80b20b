"""Shut an in-process vLLM engine down without tearing down the trainer's process group.

vLLM's engine shutdown (also run by a finalizer at interpreter exit) calls
``cleanup_dist_env_and_memory``, which destroys the *default* process group: the trainer's next
collective then fails with "Default process group has not been initialized". We replace that
function, for this process, with one that destroys only the groups vLLM created.

vLLM's engine and its worker also freeze the garbage collector's heap once they have started
(``freeze_gc_heap``: a serving process's startup objects live for ever). In a trainer that heap is the
trainer's: what it held at the engine's start would never be collected again, and the collections each freeze
takes cost ~0.6 s of every engine's start (the tiny model's whole start is ~5 s). An in-process engine leaves
the trainer's heap as it is.
"""

from __future__ import annotations

import gc

import torch

_installed = False


def _cleanup_vllm_groups_only() -> None:
    from vllm.distributed import parallel_state as vps

    try:
        vps.destroy_model_parallel()
        if vps._WORLD is not None:
            vps._WORLD.destroy()
        vps._WORLD = None
        vps._NODE_COUNT = None
    except Exception:  # the default group may already be gone at interpreter exit
        pass
    # The engine's device memory is released once, by shutdown_engine after this returns (a full collection of
    # a process holding torch and vLLM takes ~0.5 s of a core; twice was once per engine too many).


def adapt_to_trainer_process() -> None:
    """Install both replacements of the module docstring, vLLM's cleanup and its heap freeze (idempotent); call
    before creating an engine."""
    global _installed
    if _installed:
        return
    import vllm.v1.engine.core as core
    import vllm.v1.worker.gpu_worker as worker  # the CPU worker's base: it freezes after its warm-up too

    core.cleanup_dist_env_and_memory = _cleanup_vllm_groups_only
    core.freeze_gc_heap = worker.freeze_gc_heap = _leave_the_trainers_heap
    _installed = True


def _leave_the_trainers_heap() -> None:
    """In place of vLLM's ``freeze_gc_heap`` for an engine inside the trainer's process (module docstring)."""


def shutdown_engine(llm) -> None:
    """Stop ``llm`` (a ``vllm.LLM``) now, releasing its workers and vLLM's own process groups.

    On a GPU what the engine held in reference cycles is collected now and its device memory returned. On a CPU
    that memory is the process's and goes with the collector's next full pass or at the exit
    (:mod:`yatt_lightning.run.process_exit` collects once there): a collection here cost ~0.5 s of a core at the
    end of every run, followed by the exit's own."""
    adapt_to_trainer_process()
    llm.llm_engine.engine_core.shutdown()
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
