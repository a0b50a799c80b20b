"""A vLLM engine on the tiny model: pushing weights changes generations; pushing the originals restores them.

Prints one JSON line with the findings (tests/test_engine.py asserts on it).
"""

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def main() -> None:
    from yatt_lightning.run.process_exit import collect_once_at_exit

    collect_once_at_exit()  # as `yatt` ends: without the interpreter's whole-heap collections at exit
    from transformers import AutoTokenizer

    from yatt_lightning.engines.base import SamplingConfig
    from yatt_lightning.engines.vllm_engine import VLLMEngine
    from yatt_lightning.models.tiny import build_tiny_qwen2

    path = build_tiny_qwen2()
    tok = AutoTokenizer.from_pretrained(path)
    engine = VLLMEngine()
    engine.start(path, max_num_seqs=16, max_model_len=32, dtype="float32")
    prompts = [tok("after f comes").input_ids, tok("after q comes").input_ids]
    sampling = SamplingConfig(n=4, max_new_tokens=8)

    def sample():
        return [[c.token_ids for c in group] for group in engine.generate(prompts, sampling, seeds=[11, 12])]

    def sample_logprobs():
        return [c.logprobs for group in engine.generate(prompts, sampling, seeds=[11, 12]) for c in group]

    original = load_file(str(path / "model.safetensors"))
    first, again = sample(), sample()
    g = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    engine.push_weights(perturbed.items())
    name = "model.norm.weight"  # linear weights are repacked for oneDNN inside the engine; norms are not
    engine_param_matches = torch.allclose(engine.engine_parameter(name).float(), perturbed[name])
    changed = sample()
    engine.push_weights(original.items())
    restored = sample()
    restored_lp = sample_logprobs()
    engine.push_weights(original.items())
    lp_after_second_push = sample_logprobs()
    engine.shutdown()
    print(
        json.dumps(
            {
                "deterministic": first == again,
                "changed": changed != first,
                "restored": restored == first,
                "engine_param_matches_pushed": engine_param_matches,
                "num_tokens": sum(len(c) for g in first for c in g),
                "repeat_push_logprobs_equal": restored_lp == lp_after_second_push,
            }
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
