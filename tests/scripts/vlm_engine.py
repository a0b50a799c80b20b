"""The tiny LLaVA in the rollout engine: image prompts, logprobs against transformers, weight pushes.

Prints one JSON line. Starts ``VLLMEngine`` on ``builtin:tiny-llava``, samples from image + text prompts
given as token ids (one ``<image>`` token per image), scores the same tokens with transformers' LLaVA on
the same image, then pushes changed vision-tower and projector weights and does both again (a second
generation after the push would fail with an encoder-cache miss if the engine kept its image cache).
Then starts an engine on the same weights named as the other transformers versions name them
(tests/user_models.py's ``LLAVA_LAYOUTS``): each samples the same and matches transformers.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _transformers_logprobs(model, processor, prompt_ids, image, completions) -> list[list[float]]:
    import torch

    pixels = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    out = []
    for c in completions:
        ids = torch.tensor([prompt_ids + c.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=pixels).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        out.append(lp[len(prompt_ids) - 1 :].tolist())
    return out


def _max_diff(ours, theirs) -> float:
    return max(abs(a - b) for xs, ys in zip(ours, theirs, strict=True) for a, b in zip(xs, ys, strict=True))


def main() -> None:
    from yatt_lightning.run.process_exit import collect_once_at_exit

    collect_once_at_exit()  # as `yatt` ends: without the interpreter's whole-heap collections at exit
    from PIL import Image
    from safetensors.torch import load_file, save_file
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from tests.user_models import LLAVA_LAYOUTS, relayout
    from yatt_lightning.engines.base import SamplingConfig
    from yatt_lightning.engines.vllm_engine import VLLMEngine
    from yatt_lightning.models.tiny_llava import IMAGE_TOKEN, IMAGE_TOKENS, build_tiny_llava

    path = build_tiny_llava()
    processor = AutoProcessor.from_pretrained(path)
    tokenizer = processor.tokenizer
    prompt = tokenizer(f"{IMAGE_TOKEN}\ncolour:")["input_ids"]
    red, blue = Image.new("RGB", (56, 56), (220, 30, 30)), Image.new("RGB", (56, 56), (40, 60, 230))
    engine = VLLMEngine()
    engine.start(path, max_num_seqs=8, max_model_len=64, dtype="float32")
    sampling = SamplingConfig(n=4, max_new_tokens=6)
    expanded = prompt[:1] * IMAGE_TOKENS + prompt[1:]  # what the engine and transformers see

    def check(folder) -> tuple[list, float]:
        model = LlavaForConditionalGeneration.from_pretrained(folder).eval()
        groups = engine.generate([prompt, prompt], sampling, seeds=[1, 1], images=[[red], [blue]])
        diff = 0.0
        for image, group in zip((red, blue), groups, strict=True):
            theirs = _transformers_logprobs(model, processor, expanded, image, group)
            diff = max(diff, _max_diff([c.logprobs for c in group], theirs))
        return [[c.token_ids for c in g] for g in groups], diff

    before, diff_before = check(path)
    saved = load_file(path / "model.safetensors")  # in the engine's (vLLM's) names, which transformers loads too
    changed = {k: v * 1.5 for k, v in saved.items() if k.startswith(("vision_tower.", "multi_modal_projector."))}
    engine.push_weights(changed.items())
    with tempfile.TemporaryDirectory() as tmp:  # the same weights for transformers
        shutil.copytree(path, tmp, dirs_exist_ok=True)
        save_file({**saved, **changed}, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        after, diff_after = check(tmp)
    again = engine.generate([prompt], sampling, seeds=[1], images=[[red]])  # cached encoder outputs would miss
    engine.shutdown()
    layouts = {}  # the same weights named as other transformers versions wrote them: the same engine
    with tempfile.TemporaryDirectory() as tmp:
        for i, layout in enumerate(name for name in LLAVA_LAYOUTS if name != "transformers 5 save_pretrained"):
            engine = VLLMEngine()
            engine.start(relayout(path, layout, Path(tmp) / str(i)), max_num_seqs=8, max_model_len=64, dtype="float32")
            samples, diff = check(path)
            layouts[layout] = {"same_samples": samples == before, "diff": diff}
            engine.shutdown()
    print(json.dumps({
        "prompt_tokens": len(prompt), "diff_before": diff_before, "diff_after": diff_after,
        "images_matter": before[0] != before[1], "push_changed": before != after,
        "after_again_equal": [c.token_ids for c in again[0]] == after[0], "layouts": layouts,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
