"""Images of prompt rows: references that travel, pixels that stay where they are used.

A row names its images by path (relative to the dataset file) or inline (``data:image/...;base64,``).
What travels with the row, to any rank or into a checkpoint, is an :class:`ImageRef`: where the bytes
are and their SHA-256. The pixels are read (:func:`load_image`) on the rank that uses them, when it uses
them (the engine's input, the training forward), and the hash proves it read what was checked.

Every failure names the row (``file:line``), the image and the fix: a missing file, bytes that are not an
image, a truncated file, an image over ``data.max_image_bytes`` or ``data.max_image_pixels``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage

INLINE_PREFIX = "data:image/"


class ImageError(ValueError):
    """An image a row names cannot be used; the message names the row, the image and the fix."""


@dataclass(frozen=True)
class ImageLimits:
    """What an image may weigh: bytes on disk and decoded pixels (width x height); the defaults are
    :class:`~yatt_lightning.datamodules.image_prompt.ImagePromptDataModule`'s."""

    max_bytes: int
    max_pixels: int


class ImageRef(NamedTuple):
    """Where an image's bytes are, and their hash (never the pixels).

    ``path``: the image file, or for an inline image the dataset file whose line ``line`` (1-based, at byte
    ``offset``) holds it as the ``index``-th image of its row. A named tuple, not a frozen dataclass:
    Lightning's batch transfer rebuilds dataclasses field by field, which a frozen one refuses.
    """

    path: str
    sha256: str
    where: str  # the row, as ``file:line``, for messages
    line: int | None = None
    offset: int | None = None
    index: int | None = None

    @property
    def inline(self) -> bool:
        return self.line is not None

    def describe(self) -> str:
        return f"inline image {self.index}" if self.inline else f"image {self.path}"


def image_values(row: dict) -> list:
    """The images a raw row names, in order: its ``images`` list, or the image parts of its chat messages
    (``{"type": "image", "image": ...}``, under ``messages`` or a ``prompt`` given as a list)."""
    messages = row["messages"] if "messages" in row else row.get("prompt")
    if isinstance(messages, list):
        return [
            part.get("image") for message in messages if isinstance(message, dict)
            and isinstance(message.get("content"), list)
            for part in message["content"] if isinstance(part, dict) and part.get("type") == "image"
        ]  # fmt: skip
    images = row.get("images", [])
    return images if isinstance(images, list) else [images]


def _fail(where: str, what: str, fix: str) -> ImageError:
    return ImageError(f"{where}: {what}; {fix}, or set `data.on_bad_image: skip` to skip such rows and count them.")


def _decode_inline(value: str, where: str) -> bytes:
    head, _, payload = value.partition(",")
    if not head.endswith(";base64"):
        raise _fail(where, f"inline image {head[:40]!r}... is not base64", "write it as data:image/png;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise _fail(where, f"inline image is not valid base64 ({err})", "re-encode it") from None


def reference(
    value: str, *, base: Path, where: str, limits: ImageLimits, line: int, offset: int, index: int
) -> ImageRef:
    """A checked reference to the image ``value`` names (a path relative to ``base``, or inline data): the
    bytes are read once, hashed, held to ``limits`` and decoded; the decoded image is kept for its first
    use (:func:`load_image`)."""
    if not isinstance(value, str) or not value:
        raise _fail(where, f"image {index} is {value!r}, not a path or inline data", "give a path or data:image/...")
    if value.startswith(INLINE_PREFIX):
        data = _decode_inline(value, where)
        path, kw = str(base), {"line": line, "offset": offset, "index": index}
    else:
        file = (base.parent / value).resolve()
        if not file.is_file():
            raise _fail(
                where,
                f"image {value!r} does not exist (looked for {file})",
                "fix the path (relative to the dataset file)",
            )
        data, path, kw = file.read_bytes(), str(file), {}
    if len(data) > limits.max_bytes:
        raise _fail(
            where, f"image {value[:60]!r} is {len(data)} bytes, over `data.max_image_bytes`={limits.max_bytes}",
            "shrink the image or raise the limit",
        )  # fmt: skip
    ref = ImageRef(path, hashlib.sha256(data).hexdigest(), where, **kw)
    _remember(ref, _decode(data, ref, limits.max_pixels))
    return ref


def read_bytes(ref: ImageRef) -> bytes:
    """The image's bytes, as they were when the row was read (else an error saying the file changed)."""
    if ref.inline:
        with open(ref.path, "rb") as f:
            f.seek(ref.offset)
            images = image_values(json.loads(f.readline()))
        data = _decode_inline(images[ref.index], ref.where)
    else:
        try:
            data = Path(ref.path).read_bytes()
        except OSError as err:
            raise _fail(ref.where, f"image {ref.path} cannot be read ({err.strerror})", "restore the file") from None
    if hashlib.sha256(data).hexdigest() != ref.sha256:
        raise _fail(
            ref.where, f"{ref.describe()} changed since the dataset was read", "restart the run on stable files"
        )
    return data


# Decoded images of this process, newest last: the rollout and the training forward of a step share them.
_DECODED: OrderedDict[ImageRef, PILImage] = OrderedDict()
_DECODED_MAX = 256


def _remember(ref: ImageRef, image: PILImage) -> None:
    _DECODED[ref] = image
    _DECODED.move_to_end(ref)
    while len(_DECODED) > _DECODED_MAX:
        _DECODED.popitem(last=False)


def clear_decoded() -> None:
    """Forget the decoded images (the next use reads and checks the bytes again)."""
    _DECODED.clear()


def load_image(ref: ImageRef) -> PILImage:
    """The decoded RGB image of a reference :func:`reference` checked (kept per process, or read again,
    hash-checked, from where the reference points)."""
    if ref in _DECODED:
        _DECODED.move_to_end(ref)
        return _DECODED[ref]
    image = _decode(read_bytes(ref), ref, max_pixels=None)  # held to the limits when it was checked
    _remember(ref, image)
    return image


def _decode(data: bytes, ref: ImageRef, max_pixels: int | None) -> PILImage:
    """``data`` decoded to RGB; over ``max_pixels``, not an image, or truncated: an error naming the row."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = None  # our own limit below names the key; PIL's bomb check would not
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if max_pixels is not None and width * height > max_pixels:
            raise _fail(
                ref.where, f"{ref.describe()} is {width}x{height} = {width * height} pixels, over "
                f"`data.max_image_pixels`={max_pixels}", "resize the image or raise the limit",
            )  # fmt: skip
        image.load()
    except ImageError:
        raise
    except Image.UnidentifiedImageError:
        raise _fail(ref.where, f"{ref.describe()} is not an image PIL can read", "replace the file") from None
    except (OSError, SyntaxError, ValueError) as err:  # truncated or corrupt data
        raise _fail(ref.where, f"{ref.describe()} is truncated or corrupt ({err})", "replace the file") from None
    return image.convert("RGB")


def images_of(rows: list[dict]) -> list[list] | None:
    """Each row's decoded images (``None`` when no row names any): what the engine is given with the prompts,
    read here, on the rank whose engine runs them, from the rows' references."""
    if not any("images" in row for row in rows):
        return None
    return [[load_image(ref) for ref in row["images"]] if "images" in row else [] for row in rows]
