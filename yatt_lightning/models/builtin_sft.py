"""The built-in tiny model fine-tuned on the alphabet task by the SFT stage, built on first use (15-25 s on two
CPU cores) into the cache of built-in models:

- ``builtin:tiny-qwen2-sft``: 60 steps; it solves the task (mean reward about 0.9). The teacher of
  ``configs/distill_tiny.yaml``.
- ``builtin:tiny-qwen2-sft-brief``: 12 steps; it writes answers in the task's form (letters, then the end of
  text) but rarely the right ones (mean reward about 0.07). The student of ``configs/distill_tiny.yaml``:
  on-policy distillation, like RL, needs a student whose samples the teacher can grade (from random weights
  the sampled-token KL finds short, wrong answers the teacher ends quickly, a local optimum).

The build runs ``yatt fit`` of :data:`SFT_CONFIG` and ``yatt export`` in child processes, with the launcher's
variables of the asking rank removed (the child is a run of its own, one process).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from yatt_lightning.models.build_cache import build_once, cache_dir
from yatt_lightning.models.tiny import build_tiny_qwen2

TINY_QWEN2_SFT = "builtin:tiny-qwen2-sft"
TINY_QWEN2_SFT_BRIEF = "builtin:tiny-qwen2-sft-brief"
SFT_STEPS = {TINY_QWEN2_SFT: 60, TINY_QWEN2_SFT_BRIEF: 12}

SFT_CONFIG = """\
seed_everything: 0
trainer:
  max_steps: STEPS
  devices: 1
  accelerator: cpu
  strategy: {class_path: yatt_lightning.strategy.MegatronStrategy}
  logger: false
  enable_checkpointing: false
  callbacks:
    - {class_path: yatt_lightning.callbacks.AsyncCheckpoint, init_args: {every_n_steps: STEPS, keep_last: 1}}
model:
  class_path: yatt_lightning.stages.SFTModule
  init_args:
    policy: {path: BASE}
    target: answer
    target_prefix: " "
    optimizer: {lr: 0.001, clip_grad: 1.0}
    micro_batch_size: 64
    max_seq_tokens: 32
data:
  class_path: yatt_lightning.datamodules.prompt.PromptDataModule
  init_args: {batch_size: 32}
"""

# A rank's launcher variables: the child must not join the asking run's process group.
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                "MASTER_PORT", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS",
                "YATT_RUN_TOKEN", "YATT_PROCESS_RANK", "YATT_PROCESS_WORLD", "YATT_OMP_FROM_USER")  # a run of its own


def build_tiny_qwen2_sft(name: str = TINY_QWEN2_SFT) -> Path:
    """The folder of the built-in ``name`` (one of :data:`SFT_STEPS`; built once, safe under concurrent ranks)."""
    base = build_tiny_qwen2()
    config = SFT_CONFIG.replace("BASE", str(base)).replace("STEPS", str(SFT_STEPS[name]))
    key = hashlib.sha256((base.name + SFT_CONFIG + str(SFT_STEPS[name])).encode()).hexdigest()[:12]
    return build_once(cache_dir() / f"{name.removeprefix('builtin:')}-{key}", lambda tmp: _fine_tune(name, config, tmp))


def _fine_tune(name: str, text: str, out: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("TORCHELASTIC")}
    env.setdefault("OMP_NUM_THREADS", "1")
    work = Path(tempfile.mkdtemp(prefix="tiny-qwen2-sft-run-"))
    try:
        config = work / "sft.yaml"
        config.write_text(text)
        run = [sys.executable, "-m", "yatt_lightning.run.cli"]
        for args in (["fit", "--config", str(config), "--trainer.default_root_dir", str(work)],
                     ["export", "--ckpt_dir", str(work / "checkpoints"), "--out", str(work / "hf")]):  # fmt: skip
            done = subprocess.run(run + args, cwd=work, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise RuntimeError(f"building {name}: `yatt {args[0]}` failed:\n{done.stderr[-3000:]}")
        for item in (work / "hf").iterdir():
            shutil.move(str(item), out / item.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
