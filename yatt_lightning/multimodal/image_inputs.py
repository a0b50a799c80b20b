"""How a vision-language policy sees a row's images: placeholder tokens in its ids, pixels in its micro-batches.

A prompt's text holds one image token per image (``<image>``); the policy's sequences hold each expanded
to the model's tokens for that image (what transformers' processor writes, and what the loss positions
count): a fixed count for LLaVA, one per merged patch of the image's grid for Qwen-VL (images at their own
resolution), and the engine gets them collapsed again (:func:`collapse`).
Pixels are made here from the rows' :class:`~yatt_lightning.datamodules.images.ImageRef`, on the rank
that trains the rows, with the model's own image processor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from yatt_lightning.datamodules.images import load_image
from yatt_lightning.models.vlm import image_token_id


def tokens_per_image(config) -> int | None:
    """How many tokens one image takes in a LLaVA's sequence (its ``config.json``): one per patch, plus the
    class token when ``vision_feature_select_strategy`` is ``full``; ``None`` for a model whose images each
    take their own count (Qwen-VL: by the image's size, :meth:`ImageInputs.counts`)."""
    if not hasattr(config, "vision_feature_select_strategy"):
        return None
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 + int(config.vision_feature_select_strategy == "full")


def collapse(ids: list[int], token: int, per_image: int | None) -> list[int]:
    """``ids`` with each image's placeholders back to one (as the rollout engine wants them); the inverse of
    :func:`expand`. ``per_image``: each image's count (LLaVA's, also for images that follow each other);
    ``None``: every run of placeholders is one image (Qwen-VL's, which marks where each image starts and ends)."""
    out: list[int] = []
    run = 0
    for t in [*ids, None]:
        if t == token:
            run += 1
            continue
        if run:
            if per_image is None:
                out.append(token)
            elif run % per_image:
                raise ValueError(f"a run of {run} image tokens is not a whole number of {per_image}-token images")
            else:
                out.extend([token] * (run // per_image))
            run = 0
        if t is not None:
            out.append(t)
    return out


def expand(ids: list[int], token: int, counts: list[int] | int) -> list[int]:
    """``ids`` with the ``i``-th image ``token`` repeated ``counts[i]`` times (an int: the same for every image);
    the inverse of :func:`collapse`."""
    out: list[int] = []
    images = iter(counts) if isinstance(counts, list) else None
    for t in ids:
        if t != token:
            out.append(t)
            continue
        n = counts if images is None else next(images, None)
        if n is None:
            raise ValueError(f"a prompt holds more image tokens than its {len(counts)} images")
        out.extend([t] * n)
    return out


class ImageInputs:
    """Args:
    path: The vision-language model's Hugging Face folder (its config and image processor).
    """

    def __init__(self, path: Path) -> None:
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(path)
        self.processor = AutoImageProcessor.from_pretrained(path)
        self.token_id = image_token_id(config)
        self.tokens_per_image = tokens_per_image(config)  # None: each image its own (Qwen-VL)

    def counts(self, refs: list) -> list[int]:
        """How many tokens each image of ``refs`` takes in the policy's sequence: for Qwen-VL one per 2x2 merged
        patches of the image as its processor resizes it (read from the image's size)."""
        if self.tokens_per_image is not None:
            return [self.tokens_per_image] * len(refs)
        merge = self.processor.merge_size**2
        sizes = [load_image(ref).size for ref in refs]  # (width, height)
        return [self.processor.get_number_of_image_patches(h, w, {}) // merge for w, h in sizes]

    def expand(self, ids: list[int], refs: list | None) -> list[int]:
        """``ids`` with each image token repeated as many times as its image takes (the prompt format checked
        that the row has one per image). ``refs`` ``None`` (a row not yet drawn, as the checks before start
        read it): a Qwen-VL image's count is its size's, unknown until drawn, so its one token stays; the
        prompt's length is checked again when the row is drawn."""
        if self.tokens_per_image is not None:
            return expand(ids, self.token_id, self.tokens_per_image)
        return ids if refs is None else expand(ids, self.token_id, self.counts(refs))

    def pixels(self, images: list[list]) -> dict[str, torch.Tensor] | None:
        """The micro-batch fields for the samples' image references (a list per sample) in order (``None``
        when they have none): ``pixel_values`` (LLaVA: ``[images, 3, H, W]``; Qwen-VL: every image's patches,
        ``[patches, C * T * P * P]``, with ``image_grid_thw [images, 3]``)."""
        images = [load_image(ref) for refs in images for ref in refs]
        if not images:
            return None
        out = self.processor(images=images, return_tensors="pt")
        return {k: out[k] for k in ("pixel_values", "image_grid_thw") if k in out}
