"""The built-in tiny model: a random-initialised Qwen2-style model and a locally trained tokenizer.

Nothing is downloaded. The model is written as an ordinary Hugging Face folder (``config.json``,
``model.safetensors``, ``tokenizer.json``) and from then on is loaded exactly like a user's
checkpoint, so the default config exercises the real loading path.

Sizes respect what the stack needs: vLLM on CPU supports head sizes 32, 64, 80, ...; tensor
parallelism needs the number of query and key/value heads divisible by the TP size; pipeline
parallelism needs the layers divisible by the PP size. The defaults (4 heads, 2 KV heads of 32, 2
layers) allow TP=2 and PP=2.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
TINY_QWEN2 = "builtin:tiny-qwen2"

# One place for the tiny model's shape; changing it changes the cache key.
TINY_QWEN2_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": 320,
}
# A larger sibling (about 18M parameters) for benchmarks where the model's size matters (checkpoint I/O).
SMALL_QWEN2 = "builtin:small-qwen2"
SMALL_QWEN2_SHAPE = {
    **TINY_QWEN2_SHAPE,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
# The model of configs/grpo_small.yaml and bench/step_efficiency.py (about 13M parameters): big enough
# that generation and training compute, not the framework's fixed costs, should fill a step.
SMALL4_QWEN2 = "builtin:small4-qwen2"
SMALL4_QWEN2_SHAPE = {**SMALL_QWEN2_SHAPE, "num_hidden_layers": 4}
BUILTIN_SHAPES = {TINY_QWEN2: TINY_QWEN2_SHAPE, SMALL_QWEN2: SMALL_QWEN2_SHAPE, SMALL4_QWEN2: SMALL4_QWEN2_SHAPE}
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]


def cache_dir() -> Path:
    """Folder for built artefacts: ``$YATT_CACHE`` or ``~/.cache/yatt_lightning``."""
    return Path(os.environ.get("YATT_CACHE", Path.home() / ".cache" / "yatt_lightning"))


def resolve_model_path(path: str, key: str = "model.policy.path") -> Path:
    """Turn a config value into a Hugging Face model folder, building the built-in model if named.

    Raises:
        ValueError: if ``path`` names an unknown built-in model, or is not a folder with ``config.json``.
    """
    if path.startswith(BUILTIN_PREFIX):
        from yatt_lightning.models.tiny_llava import TINY_LLAVA, build_tiny_llava

        if path == TINY_LLAVA:
            return build_tiny_llava()
        if path not in BUILTIN_SHAPES:
            raise ValueError(
                f"`{key}`: unknown built-in model {path!r}; built-in models: {', '.join([*BUILTIN_SHAPES, TINY_LLAVA])}."
            )
        return build_tiny_qwen2(shape=BUILTIN_SHAPES[path])
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(
            f"`{key}`: model folder {str(folder)!r} does not exist. Pass a Hugging Face model folder "
            f"(with config.json, *.safetensors and the tokenizer files) or {TINY_QWEN2!r}."
        )
    if not (folder / "config.json").is_file():
        raise ValueError(f"`{key}`: {str(folder)!r} has no config.json; it is not a Hugging Face model folder.")
    return folder


def build_tiny_qwen2(seed: int = 1234, shape: dict | None = None) -> Path:
    """Build (once) and return the folder of a random-initialised Qwen2-style model of ``shape`` (default:
    the tiny one) with the locally trained tokenizer; safe under concurrent ranks."""
    shape = TINY_QWEN2_SHAPE if shape is None else shape
    from yatt_lightning.datamodules.tasks import AlphabetTask

    key = hashlib.sha256(json.dumps([shape, SPECIAL_TOKENS, seed, list(AlphabetTask.corpus())]).encode())
    out = cache_dir() / f"{'tiny-' if shape == TINY_QWEN2_SHAPE else ''}qwen2-{key.hexdigest()[:12]}"
    return build_once(out, lambda tmp: _write_tiny_qwen2(tmp, seed, AlphabetTask.corpus(), shape))


BUILD_MANIFEST = ".yatt-build.json"  # written last: the folder's files and sizes


def build_once(out: Path, write: Callable[[Path], None]) -> Path:
    """``out``, written by ``write(folder)`` the first time; safe with any number of processes building it at once.

    Under a file lock, ``write`` fills a fresh temporary folder, which is checked (a config, weights, a
    tokenizer), sealed with a manifest of its files and sizes, and renamed to ``out`` in one step; a
    folder counts as built only when its manifest matches its files. A folder found incomplete (a build
    killed before these rules, an edited cache) is moved aside under the lock, named in the log, and built
    again.
    """
    from filelock import FileLock

    if not _incomplete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        problem = _incomplete(out)
        if not problem:
            return out
        if out.exists():
            stamp = time.strftime("%Y%m%d-%H%M%S")
            aside = Path(tempfile.mkdtemp(prefix=f"{out.name}.incomplete-{stamp}-", dir=out.parent))
            os.replace(out, aside)  # onto the empty folder just made: a name no other build takes
            log.warning("built-in model folder %s is incomplete (%s): moved it aside to %s; building it again", out, problem, aside)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        try:
            write(tmp)
            _seal(tmp)
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from the machine's other users
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("built %s", out)
    return out


def _incomplete(folder: Path) -> str | None:
    """Why ``folder`` is not a finished build (``None`` when it is)."""
    if not folder.is_dir():
        return "absent"
    try:
        files = json.loads((folder / BUILD_MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        held = sorted(p.name for p in folder.iterdir())
        return f"no build manifest; it holds {', '.join(held) or 'nothing'}"
    for name, size in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return f"{name} is {'missing' if not path.is_file() else f'{path.stat().st_size} bytes, not {size}'}"
    return None


def _seal(folder: Path) -> None:
    """Check what ``write`` left in ``folder`` and record it in the manifest, or raise naming what is missing."""
    names = {p.name for p in folder.iterdir() if p.is_file()}
    needed = {"config.json": "config.json", "weights": "model.safetensors", "tokenizer": "tokenizer.json"}
    missing = [what for what, name in needed.items() if name not in names]
    if missing:
        raise RuntimeError(f"building {folder} wrote no {', '.join(missing)} (it holds {', '.join(sorted(names))})")
    files = {name: (folder / name).stat().st_size for name in sorted(names)}
    (folder / BUILD_MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def save_pretrained(model: Any, folder: Path) -> None:
    """``model.save_pretrained(folder)`` on whichever process builds. transformers 5.19 writes nothing on a rank
    other than 0 of an initialised process group (``DistributedMixin.should_save_on_this_rank``), while the
    tokenizer's ``save_pretrained`` still writes: a judge built on rank 1 left a cache folder holding only the
    tokenizer's files. The builder is the folder's only writer (under :func:`build_once`'s lock)."""
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    model.save_pretrained(folder, safe_serialization=True)


def train_tokenizer(corpus, vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on ``corpus`` with Qwen2's pre-tokenizer, normalizer and decoder.

    transformers loads every ``qwen2`` model's tokenizer as ``Qwen2Tokenizer``, which rebuilds that
    pipeline around the saved vocabulary and merges; training the same pipeline keeps the two identical.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, more than vocab_size={vocab_size}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def _write_tiny_qwen2(folder: Path, seed: int, corpus, shape: dict) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(shape)
    tokenizer = train_tokenizer(corpus, shape["vocab_size"])
    rope_theta = shape.pop("rope_theta")
    config = Qwen2Config(
        **shape,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    save_pretrained(model, folder)
    tokenizer.save_pretrained(folder)
