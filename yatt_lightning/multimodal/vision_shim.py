"""Image processors without torchvision: the one import shim that multimodal rollouts need on CPU.

The registry's torchvision is a CUDA build that cannot load on a CPU-only torch (../shared/CPU-STACK.md),
and transformers 5.19 then selects the PIL twins of its image processors by itself. vLLM's LLaVA model file
(through Pixtral's) imports the torchvision-backed modules directly, at import time. :func:`install` makes
exactly those modules resolve to their PIL twins, with the torchvision class names pointing at the PIL
classes. It does nothing where torchvision imports (a GPU machine), and refuses versions it was not checked
with. vLLM inspects model files in a subprocess, so :func:`subprocess_env` hands that subprocess a
``sitecustomize`` (``yatt_lightning/vision_site``) that installs the shim there too. A Qwen-VL processor also
has a video slot whose processor needs torchvision: :func:`install_video_stand_in` fills it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

# The versions this shim was checked against; another version may import these modules differently.
PINNED = {"transformers": "5.19.0"}
# torchvision-backed module -> (its PIL twin, {torchvision class name: PIL class name})
ALIASES = {
    "transformers.models.pixtral.image_processing_pixtral": (
        "transformers.models.pixtral.image_processing_pil_pixtral", {"PixtralImageProcessor": "PixtralImageProcessorPil"},
    ),
    "transformers.models.llava.image_processing_llava": (
        "transformers.models.llava.image_processing_pil_llava", {"LlavaImageProcessor": "LlavaImageProcessorPil"},
    ),
    "transformers.models.clip.image_processing_clip": (
        "transformers.models.clip.image_processing_pil_clip", {"CLIPImageProcessor": "CLIPImageProcessorPil"},
    ),
    "transformers.models.qwen2_vl.image_processing_qwen2_vl": (
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl", {"Qwen2VLImageProcessor": "Qwen2VLImageProcessorPil"},
    ),
}  # fmt: skip
SITE = Path(__file__).parent / "vision_site"


def needed() -> bool:
    """True where torchvision cannot be imported (here: not installed, as the CPU lock keeps it out)."""
    return importlib.util.find_spec("torchvision") is None


class _PilTwins(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(name, self) if name in ALIASES else None

    def create_module(self, spec) -> object:
        twin, names = ALIASES[spec.name]
        module = importlib.import_module(twin)
        for torchvision_name, pil_name in names.items():
            setattr(module, torchvision_name, getattr(module, pil_name))
        return module

    def exec_module(self, module) -> None:
        pass  # the twin is already executed


def install() -> bool:
    """Install the aliases (once) where torchvision is missing; True if they are active."""
    if not needed():
        return False
    for name, version in PINNED.items():
        found = importlib.metadata.version(name)
        if found != version:
            raise RuntimeError(
                f"yatt_lightning.multimodal.vision_shim was checked with {name}=={version}, found {found}; check that "
                f"{', '.join(ALIASES)} still have PIL twins, then update PINNED."
            )
    if not any(isinstance(f, _PilTwins) for f in sys.meta_path):
        sys.meta_path.insert(0, _PilTwins())
    return True


def install_video_stand_in() -> bool:
    """Where torchvision is missing, a Qwen-VL processor's video slot gets a stand-in that processes no video
    (its own video processor needs torchvision, transformers then has no class to put there, and the whole
    processor, which vLLM builds for images too, fails to load); True if installed. The engine refuses videos
    before they reach it (``limit_mm_per_prompt`` video 0)."""
    if not install():
        return False
    global NoVideoProcessor
    if NoVideoProcessor is None:
        import transformers.processing_utils as processing
        from transformers.video_processing_utils import BaseVideoProcessor

        class NoVideoProcessor(BaseVideoProcessor):  # noqa: F811 (built on first use: its base imports transformers')
            """Holds a Qwen-VL processor's video slot where torchvision is missing; processes no video."""

            merge_size, temporal_patch_size, patch_size = 2, 2, 14

            @classmethod
            def from_pretrained(cls, *args, **kwargs):
                return cls()

            def __call__(self, *args, **kwargs):
                raise RuntimeError("videos need torchvision, which this machine's torch cannot load (CPU stack)")

        processing.MODALITY_TO_AUTOPROCESSOR_MAPPING._MAPPING_NAMES["video_processor"] = (__name__, "NoVideoProcessor")
        processing.MODALITY_TO_BASE_CLASS_MAPPING["video_processor"] = "NoVideoProcessor"  # what it checks against
        processing.transformers_module.NoVideoProcessor = NoVideoProcessor
    return True


NoVideoProcessor = None  # the stand-in class, once install_video_stand_in built it


def subprocess_env() -> None:
    """Let the subprocesses this process starts (vLLM's model inspection) install the shim too."""
    if needed() and str(SITE) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH")) if p)
