"""A family's model in the vLLM engine before and after pushes that change every tensor.

    python tests/scripts/family_engine.py OUT FAMILY

Builds two folders of FAMILY (tests/user_models.py, seeds 0 and 1: every tensor differs) under OUT, starts the
engine on the first, samples, and compares the engine's logprobs of its samples with transformers' on the same
tokens: before any push (against the first folder), after pushing the second folder's tensors (against the
second; also the first folder's logprobs, the size of a push that did not land), and after pushing the first
folder's back. Prints one JSON line with the largest differences.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main() -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.user_models import build
    from yatt_lightning.rollout.base import SamplingConfig
    from yatt_lightning.rollout.vllm_engine import VLLMEngine

    out, family = Path(sys.argv[1]), sys.argv[2]
    first, second = build(family, out / "a", seed=0), build(family, out / "b", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(first)
    engine = VLLMEngine()
    engine.start(first, max_num_seqs=16, max_model_len=64, dtype="float32")
    prompts = [tokenizer("after f comes").input_ids, tokenizer("the colour of the sky is").input_ids]
    sampling = SamplingConfig(n=4, max_new_tokens=12)
    models = {f: AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32) for f in (first, second)}

    def worst(*folders) -> list[float]:
        """The engine's samples, scored by transformers with each folder's model."""
        groups = engine.generate(prompts, sampling, seeds=[1, 2])
        diffs = []
        for folder in folders:
            diff = 0.0
            for prompt, group in zip(prompts, groups, strict=True):
                for sample in group:
                    ids = torch.tensor([prompt + list(sample.token_ids)])
                    with torch.no_grad():
                        logprobs = torch.log_softmax(models[folder](ids).logits[0, :-1].float(), -1)
                    theirs = logprobs[len(prompt) - 1 :].gather(1, ids[0, len(prompt) :, None])[:, 0]
                    diff = max(diff, (theirs - torch.tensor(sample.logprobs)).abs().max().item())
            diffs.append(diff)
        return diffs

    before = worst(first)[0]
    engine.push_weights(load_file(str(second / "model.safetensors")).items())
    pushed, stale = worst(second, first)
    engine.push_weights(load_file(str(first / "model.safetensors")).items())
    restored = worst(first)[0]
    engine.shutdown()
    print(json.dumps({"before": before, "pushed": pushed, "stale": stale, "restored": restored}))


if __name__ == "__main__":
    main()
