"""Each family's Megatron model against transformers at every layout of 2 processes, and its export.

    python tests/scripts/family_logits.py OUT FAMILY [FAMILY ...]

Builds each family's folder under OUT (tests/user_models.py: plain ``save_pretrained``), then in 2 gloo processes
for each layout in turn (TP=1 (DP=2), TP=2, PP=2, and EP=2 for a mixture of experts; each with a fresh parallel state) loads
the folder into a MegatronPolicy, runs a forward on 3 sequences of 40 tokens (longer than the Mistral folder's
window), gathers the logits over TP, and exports the weights. Prints one JSON line: per layout and family the
largest logit difference to transformers (on the last stage) and whether the export equals the folder's tensors
bitwise; for the windowed Mistral also the difference transformers itself shows without the window. A vision-language
family (Qwen2.5-VL) runs two rows holding images of different sizes instead (:func:`_vision_batch`), and reports
the difference transformers itself shows with one position per token instead of M-RoPE's.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "ep2": (1, 1, 2)}


def worker(rank: int, port: int, folders: dict, queue) -> None:
    import torch
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from yatt_lightning.models.cpu import megatron_cpu_context
    from yatt_lightning.models.optim import OptimizerSettings
    from yatt_lightning.models.policy import MegatronPolicy

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    ids = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(0))
    results = {}
    for layout, (tp, pp, ep) in LAYOUTS.items():
        with megatron_cpu_context():
            ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                                         order="tp-cp-ep-pp-dp")  # fmt: skip
        for family, folder in folders.items():
            if ep > 1 and "moe" not in family:
                continue
            policy = MegatronPolicy(Path(folder), optimizer=OptimizerSettings(lr=1e-3, clip_grad=0.0))
            out = []

            def keep(mb, logits, out=out):
                out.append(logits.detach())
                return torch.zeros(()), torch.tensor(1), {}

            vision = _vision_batch(folder) if "vl" in family else None
            batch = vision["ours"] if vision else {"input_ids": ids}
            policy.forward_backward([batch], keep, forward_only=True)
            exported = dict(policy.export_hf())
            original = load_file(str(Path(folder) / "model.safetensors"))
            entry = {"export_equal": exported.keys() == original.keys()
                     and all(torch.equal(exported[k], original[k]) for k in original)}  # fmt: skip
            if out:
                logits = out[0]
                if tp > 1:
                    parts = [torch.empty_like(logits) for _ in range(tp)]
                    torch.distributed.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
                    logits = torch.cat(parts, dim=-1)
                if vision:
                    from transformers import AutoModelForImageTextToText

                    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
                    with torch.no_grad():
                        expected = hf(**vision["hf"]).logits
                    real = vision["hf"]["attention_mask"].bool()  # right padding: compare the real tokens
                    entry["logit_diff"] = (logits[real] - expected[real]).abs().max().item()
                    entry["image_tokens"] = vision["image_tokens"]
                    plain = {k: v for k, v in vision["hf"].items() if k != "mm_token_type_ids"}  # 1-D positions
                    with torch.no_grad():
                        entry["without_mrope_diff"] = (hf(**plain).logits[real] - expected[real]).abs().max().item()
                else:
                    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
                    with torch.no_grad():
                        expected = hf(ids).logits
                    entry["logit_diff"] = (logits - expected).abs().max().item()
                if hf.config.model_type == "mistral" and hf.config.sliding_window is not None:
                    full = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, sliding_window=None)
                    with torch.no_grad():
                        entry["without_window_diff"] = (full(ids).logits - expected).abs().max().item()
            results[f"{layout}/{family}"] = entry
            del policy
        ps.destroy_model_parallel()
    queue.put((rank, results))


def _vision_batch(folder: str) -> dict:
    """Two rows for a Qwen-VL folder: one with two noise images of different sizes (84 x 56 and 56 x 112 px: 6
    and 8 tokens), one with the second image alone, right-padded; as transformers' forward takes them and as the
    policy's micro-batch holds them."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    tok, processor = AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)
    config = AutoConfig.from_pretrained(folder)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((84, 56), (56, 112))]
    pixels = processor(images=images + [images[1]], return_tensors="pt")
    counts = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
    mark = "<|vision_start|>{}<|vision_end|>"
    texts = ["<|im_start|>user\n" + mark.format("<|image_pad|>" * counts[0]) + "colour: red and "
             + mark.format("<|image_pad|>" * counts[1]) + "blue<|im_end|>\n<|im_start|>assistant\nred",
             "<|im_start|>user\n" + mark.format("<|image_pad|>" * counts[2]) + "colour<|im_end|>\n"]  # fmt: skip
    rows = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    grid = pixels["image_grid_thw"]
    hf = dict(input_ids=ids, attention_mask=mask, pixel_values=pixels["pixel_values"], image_grid_thw=grid,
              mm_token_type_ids=(ids == config.image_token_id).int())  # fmt: skip
    return {"hf": hf, "ours": {"input_ids": ids, "pixel_values": pixels["pixel_values"], "image_grid_thw": grid},
            "image_tokens": counts}  # fmt: skip


def main() -> None:
    from yatt_lightning.run.process_exit import collect_once_at_exit

    collect_once_at_exit()  # as `yatt` ends: without the interpreter's whole-heap collections at exit
    import multiprocessing

    from tests.user_models import build

    out = Path(sys.argv[1])
    folders = {f: str(build(f, out / f)) for f in sys.argv[2:]}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, folders, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        _, part = queue.get(timeout=400)
        for key, entry in part.items():
            results.setdefault(key, {}).update(entry)
    for p in procs:
        p.join(timeout=60)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
