"""Users' text models (tests/user_models.py) through `yatt fit` and `yatt export`, one after another in this process.

    python tests/scripts/user_models_fit.py OUT FAMILY=STEPS [FAMILY=STEPS ...]

For each family: builds its folder with plain ``save_pretrained`` under OUT, trains ``configs/grpo_tiny.yaml``
with ``--model.policy.path`` on it for STEPS steps through the CLI's own YattCLI (the configuration checks
included; the llama folder also with ``--model.system_prompt``), saves a checkpoint at the end, exports it
with ``yatt export`` and loads the export with transformers. Prints one JSON line: per family the mean
reward and ``rollout/logprob_diff_max`` of every step, the first sample's prompt ids against the tokenizer's
own ``apply_chat_template(..., tokenize=True)["input_ids"]``, and what transformers made of the export.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SYSTEM = {"llama-tied": "You are a helpful assistant."}  # one family also puts a system prompt in front


def fit(family: str, folder: Path, steps: int, root: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers import read_scalars
    from yatt_lightning.checkpoint.export import export
    from yatt_lightning.run.cli import YattCLI

    saver = {"class_path": "yatt_lightning.callbacks.AsyncCheckpoint",
             "init_args": {"every_n_steps": 100000, "dirpath": str(root / "ckpts")}}  # fmt: skip (saves at the end)
    args = ["--config", str(REPO / "configs" / "grpo_tiny.yaml"), "--model.policy.path", str(folder),
            "--model.max_prompt_tokens", "48", "--trainer.max_steps", str(steps), "--trainer.default_root_dir",
            str(root), "--trainer.callbacks", json.dumps([saver])]  # fmt: skip
    if family in SYSTEM:
        args += ["--model.system_prompt", SYSTEM[family]]
    cli = YattCLI(args=args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    module = cli.model
    rollouts = module.last_rollouts
    row = rollouts.rows[0]
    messages = ([{"role": "system", "content": SYSTEM[family]}] if family in SYSTEM else []) + [
        {"role": "user", "content": row["prompt"]}
    ]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    own = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    scalars = read_scalars(root)
    out = export(str(root / "ckpts"), str(root / "hf"))
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    initial = AutoModelForCausalLM.from_pretrained(folder)
    moved = [k for k, v in initial.state_dict().items() if not torch.equal(v, model.state_dict()[k])]
    return {
        "rewards": [v for _, v in sorted(scalars["reward/mean"])],
        "logprob_diff_max": [v for _, v in sorted(scalars["rollout/logprob_diff_max"])],
        "prompt_ids": list(rollouts.prompt_ids[0]),
        "tokenizer_ids": list(own),
        "prompt_text": tokenizer.decode(rollouts.prompt_ids[0]),
        "export_missing": list(info["missing_keys"]),
        "export_unexpected": list(info["unexpected_keys"]),
        "export_tied": bool(model.config.tie_word_embeddings),
        "export_files": sorted(p.name for p in out.iterdir()),
        "moved": len(moved),
        "tensors": len(initial.state_dict()),
    }


def main() -> None:
    from tests.user_models import build

    out = Path(sys.argv[1])
    results = {}
    for spec in sys.argv[2:]:
        family, steps = spec.split("=")
        folder = build(family, out / family)
        results[family] = fit(family, folder, int(steps), out / f"{family}-run")
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
