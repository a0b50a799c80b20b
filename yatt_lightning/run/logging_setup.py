"""Silence third-party messages that say nothing actionable to a yatt-lightning user."""

from __future__ import annotations

import logging
import warnings


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


def configure_logging() -> None:
    """yatt-lightning's own messages at INFO on stderr; third-party noise filtered."""
    ours = logging.getLogger("yatt_lightning")
    if not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[yatt %(levelname)s] %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False
    quiet_third_party()


def quiet_third_party() -> None:
    # Megatron-Core announces on import that Apex / Transformer Engine are absent (expected on CPU).
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    warnings.filterwarnings("ignore", message="full scope is deprecated")
    # Scripts that build YattCLI(args=...) keep sys.argv for Lightning to relaunch the other ranks.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    warnings.filterwarnings("ignore", message=".*`isinstance\\(treespec, LeafSpec\\)` is deprecated")
    # The prompt data module offers held-out rows to every stage; a module without a validation step (the
    # RL step has none yet) has nothing to do with them, and Lightning says so before the run's capture.
    warnings.filterwarnings("ignore", message="You passed in a `val_dataloader` but have no `validation_step`")
    # vLLM's in-place reload warns about the rotary cache, which is not a checkpoint tensor.
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
        _DropMessages("Failed to load weights")
    )
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(
            _DropMessages("GPU available: False", "TPU available", "HPU available", "LOCAL_RANK")
        )
    from yatt_lightning.distributed import console

    if console.verbose():
        return
    # Printed before RunConsole moves the libraries' output into the run's output.log: Lightning's start-up
    # notes and a tqdm bar of transformers' save_pretrained (building the tiny model the first time).
    chatter = _DropMessages("Seed set to", "Initializing distributed:", "distributed_backend=", "Tip:")
    for name in ("lightning.fabric.utilities.seed", "lightning.fabric.utilities.distributed",
                 "lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):  # fmt: skip
        logging.getLogger(name).addFilter(chatter)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
