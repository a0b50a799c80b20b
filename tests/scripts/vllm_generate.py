"""Start a vLLM engine on a Hugging Face folder and generate; prints one JSON line."""

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    from yatt_lightning.run.process_exit import collect_once_at_exit

    collect_once_at_exit()  # as `yatt` ends: without the interpreter's whole-heap collections at exit
    from pathlib import Path

    from transformers import AutoTokenizer

    from yatt_lightning.engines.base import SamplingConfig
    from yatt_lightning.engines.vllm_engine import VLLMEngine

    path = Path(sys.argv[1])
    engine = VLLMEngine()
    engine.start(path, max_num_seqs=8, max_model_len=32, dtype="float32")
    ids = AutoTokenizer.from_pretrained(path)("after f").input_ids
    groups = engine.generate([ids], SamplingConfig(n=2, max_new_tokens=6), seeds=[1])
    engine.shutdown()
    print(json.dumps({"tokens": sum(len(c.token_ids) for c in groups[0])}))


if __name__ == "__main__":
    main()
