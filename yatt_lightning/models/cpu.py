"""What megatron-core 0.16.1 needs to run without CUDA. Active only when no GPU is present.

megatron-core hard-codes CUDA in places that matter on a CPU machine: tensor factories with
``device="cuda"`` or ``torch.cuda.current_device()`` (the default attention mask, gradient buffers,
the optimizer's scalars, ``clip_grads``, pipeline p2p buffers), CUDA streams and events in DDP,
``torch.cuda.synchronize`` in checkpoint writers, type checks against ``'torch.cuda.FloatTensor'``,
and a CUDA RNG tracker. This module answers each with the CPU equivalent:

* :func:`megatron_cpu_context` -- a ``TorchFunctionMode`` that maps CUDA devices to the CPU, makes
  ``Tensor.cuda()`` a no-op and reports CPU tensors under CUDA type names, plus ``torch.cuda``
  stand-ins (current device 0, no-op synchronize/streams/events, the CPU generator for RNG state).
  It is *scoped*: the strategy enters it around Megatron code only (model construction, training
  step, export, checkpointing), because a global mode slows vLLM generation ~2x.
* :class:`CpuRNGStatesTracker` -- Megatron's RNG tracker over the CPU generator, installed by
  :func:`model_parallel_manual_seed`.
* Checkpoint writing (:func:`_defer_checkpoint_clones`): Megatron's asynchronous writer clones every CPU
  tensor that is a view (the gate/up halves of the MLP and their optimizer state) in the training loop.
  On CPU an asynchronous save's writer thread reads the tensors while the next step runs
  (``checkpoint.writer.LiveSnapshot``), so the clone moves to the writer, just before each tensor is
  serialised (where it clones only what still is a view); the files are identical.

On a machine with CUDA every entry point here is a no-op and Megatron runs unpatched.
The patches target exactly :data:`MEGATRON_CORE_VERSION`; :func:`check_version` refuses others.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from yatt_lightning.distributed.training_world import training_world

MEGATRON_CORE_VERSION = "0.16.1"


def cpu_mode() -> bool:
    """True when the compatibility layer must be active (no CUDA device)."""
    return not torch.cuda.is_available()


def check_version() -> None:
    from megatron.core.package_info import __version__

    if cpu_mode() and __version__ != MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"yatt_lightning.models.cpu patches megatron-core {MEGATRON_CORE_VERSION} for CPU runs, but "
            f"{__version__} is installed. Install megatron-core=={MEGATRON_CORE_VERSION} (scripts/install.sh does)."
        )


# ---------------------------------------------------------------------------------------------
# Device mapping
_CPU = torch.device("cpu")
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


def _is_cuda_device(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    # Megatron passes torch.cuda.current_device() (an int) as a device.
    return isinstance(value, int) and not isinstance(value, bool)


_TO_LIKE = frozenset({torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros})


class _CudaToCpuMode(TorchFunctionMode):
    # Called for every torch operation inside the context: keep the common path (no device argument,
    # nothing special) to two cheap checks.
    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        if kwargs:
            device = kwargs.get("device")
            if device is not None and _is_cuda_device(device):
                kwargs["device"] = _CPU
        else:
            kwargs = {}
        if func in _SPECIAL:
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.clone:
                if getattr(_clones_deferred, "on", False):
                    return args[0]  # the checkpoint writer clones it (see _defer_checkpoint_clones)
                return func(*args, **kwargs)
            if func is torch.Tensor.type:
                if len(args) == 1 and not kwargs:
                    name = func(*args)
                    return _CUDA_TYPE_NAMES.get(name, name)
            elif len(args) > 1 and _is_cuda_device(args[1]):
                args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


_SPECIAL = frozenset({torch.Tensor.cuda, torch.Tensor.type, torch.Tensor.clone}) | _TO_LIKE
_clones_deferred = threading.local()


class _FakeStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args, **kwargs) -> _FakeEvent:
        return _FakeEvent()


class _FakeEvent:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _noop() -> Callable[..., None]:
    """A fresh no-op function per stand-in: torch.compile refuses one object registered under two names."""

    def noop(*args, **kwargs) -> None:
        return None

    return noop


_CUDA_STANDINS = {
    "current_device": lambda: 0,
    "device_count": lambda: 1,
    "set_device": _noop(),
    "synchronize": _noop(),
    "empty_cache": _noop(),
    "Stream": _FakeStream,
    "Event": _FakeEvent,
    "stream": lambda *a, **k: contextlib.nullcontext(),
    "current_stream": lambda *a, **k: _FakeStream(),
    "default_stream": lambda *a, **k: _FakeStream(),
    "get_rng_state": lambda *a, **k: torch.get_rng_state(),
    "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
    "manual_seed": lambda seed: None,
    "manual_seed_all": lambda seed: None,
    "memory_allocated": lambda *a, **k: 0,
    "max_memory_allocated": lambda *a, **k: 0,
    "memory_reserved": lambda *a, **k: 0,
    "reset_peak_memory_stats": _noop(),
    "nvtx": type("nvtx", (), {"range_push": staticmethod(_noop()), "range_pop": staticmethod(_noop())}),
}

_lock = threading.RLock()
_depth = 0
_saved: dict[str, object] = {}
_mode: _CudaToCpuMode | None = None


def _enter() -> None:
    global _depth, _mode
    with _lock:
        _depth += 1
        if _depth > 1:
            return
        for name, standin in _CUDA_STANDINS.items():
            _saved[name] = getattr(torch.cuda, name, None)
            setattr(torch.cuda, name, standin)
        _saved["random.get_rng_state"] = torch.cuda.random.get_rng_state
        torch.cuda.random.get_rng_state = _CUDA_STANDINS["get_rng_state"]
        _defer_checkpoint_clones()
        _mode = _CudaToCpuMode()
        _mode.__enter__()


_checkpoint_patch_installed = False


def _defer_checkpoint_clones() -> None:
    """Install (once) the two halves of the deferred clone: skip it while Megatron prepares the write
    buckets, and clone views right before ``torch.save`` in the writer (``_write_item``)."""
    global _checkpoint_patch_installed
    if _checkpoint_patch_installed:
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    prepare = fa.FileSystemWriterAsync.prepare_write_data
    write_item = fa._write_item

    def prepare_without_clones(self, plan, planner) -> Any:
        _clones_deferred.on = True
        try:
            return prepare(self, plan, planner)
        finally:
            _clones_deferred.on = False

    @functools.wraps(write_item)  # Megatron inspects the signature
    def write_item_cloning_views(*args, **kwargs) -> Any:
        args = tuple(
            a.clone() if isinstance(a, torch.Tensor) and a.untyped_storage().nbytes() != a.numel() * a.itemsize else a
            for a in args
        )
        return write_item(*args, **kwargs)

    fa.FileSystemWriterAsync.prepare_write_data = prepare_without_clones
    fa._write_item = write_item_cloning_views
    _checkpoint_patch_installed = True


def _exit() -> None:
    global _depth, _mode
    with _lock:
        _depth -= 1
        if _depth > 0:
            return
        if _mode is None:
            raise RuntimeError("megatron_cpu_context exited more often than it was entered")
        _mode.__exit__(None, None, None)
        _mode = None
        torch.cuda.random.get_rng_state = _saved.pop("random.get_rng_state")
        for name, original in _saved.items():
            if original is None:
                delattr(torch.cuda, name)
            else:
                setattr(torch.cuda, name, original)
        _saved.clear()


@contextlib.contextmanager
def megatron_cpu_context() -> Iterator[None]:
    """Run the enclosed Megatron code on the CPU (a no-op when CUDA is available), over the training ranks
    only when some ranks do not train (:mod:`~yatt_lightning.distributed.training_world`). Re-entrant."""
    with training_world():
        if not cpu_mode():
            yield
            return
        _enter()
        try:
            yield
        finally:
            _exit()


# ---------------------------------------------------------------------------------------------
# RNG
def _cpu_tracker_class() -> type:
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME, CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """Megatron's named RNG states, kept as CPU generator states."""

        def add(self, name, seed) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=_MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def model_parallel_manual_seed(seed: int) -> None:
    """Seed Megatron's RNG tracker (Megatron's ``model_parallel_cuda_manual_seed`` on GPU)."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    if not cpu_mode():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    from megatron.core import parallel_state as ps

    mrandom._CUDA_RNG_STATE_TRACKER = _cpu_tracker_class()()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + ps.get_tensor_model_parallel_rank())
    tracker.add(
        mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
        seed + 1024 + 100 * ps.get_expert_model_parallel_rank() + ps.get_expert_tensor_parallel_rank(),
    )


def moe_without_transformer_engine() -> None:
    """megatron-core 0.16.1's router (``moe_utils.RouterGatingLinearFunction``) tests ``te_general_gemm is not
    None``, a name bound only when Transformer Engine imports: without it the test raises ``NameError``.
    Bind it to None (the router then uses ``torch.mm``); a no-op where Transformer Engine is installed."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if cpu_mode():
        mappings._AllToAll.forward = staticmethod(_all_to_all_on_cpu)


def _all_to_all_on_cpu(ctx, group, input, output_split_sizes, input_split_sizes):
    """megatron-core 0.16.1's ``_AllToAll.forward`` (expert parallelism's token exchange) for gloo: its output on
    the input's device (Megatron's asks for the current CUDA device, also in the backward pass, which runs
    outside :func:`megatron_cpu_context`), and the split sizes, which the token dispatcher gives as tensors, as
    the lists of ints gloo takes."""
    ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = group, output_split_sizes, input_split_sizes
    if group.size() == 1:
        return input
    sizes = [s.tolist() if isinstance(s, torch.Tensor) else s for s in (output_split_sizes, input_split_sizes)]
    input = input.contiguous()
    if sizes[0] is None:
        output = torch.empty_like(input)
    else:
        output = input.new_empty(size=[sum(sizes[0]), *input.size()[1:]])
    torch.distributed.all_to_all_single(output, input, output_split_sizes=sizes[0], input_split_sizes=sizes[1], group=group)
    return output
