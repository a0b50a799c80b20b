"""Images of prompt rows: references that travel, pixels that stay where they are used.

A row names its images by path (relative to the dataset file) or inline (``data:image/...;base64,``); a row
of a table (Parquet, a ``datasets`` folder) may hold the bytes themselves, as ``datasets``' ``Image`` feature
stores them (``{"bytes": ..., "path": ...}``).
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
from typing import TYPE_CHECKING, Any, NamedTuple

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
    ``offset``) holds it as the ``index``-th image of its row, or for an image in a table the table (as
    ``data.path`` names it) whose row ``row`` holds it as the ``index``-th image of its column ``column``.
    A named tuple, not a frozen dataclass: Lightning's batch transfer rebuilds dataclasses field by field,
    which a frozen one refuses.
    """

    path: str
    sha256: str
    where: str  # the row, as ``file:line``, for messages
    line: int | None = None
    offset: int | None = None
    index: int | None = None
    row: int | None = None
    column: str | None = None

    @property
    def inline(self) -> bool:
        return self.line is not None

    def describe(self) -> str:
        if self.row is not None:
            return f"image {self.index} of column {self.column!r}"
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


def _shown(value: Any) -> str:
    return f"{len(value)} bytes" if isinstance(value, bytes | bytearray) else repr(value)[:80]


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


def table_images(cell: Any) -> list:
    """A table's images cell as :func:`reference` takes its images: each image's bytes, or the path (or inline
    data) it names (``datasets``' undecoded ``Image`` is ``{"bytes": ..., "path": ...}``: bytes win); one image
    or a list of them."""
    values = cell if isinstance(cell, list) else [] if cell is None else [cell]
    return [v.get("bytes") or v.get("path") if isinstance(v, dict) else v for v in values]


def reference(
    value: str | bytes,
    *,
    base: Path,
    where: str,
    limits: ImageLimits,
    line: int | None = None,
    offset: int | None = None,
    index: int,
    row: int | None = None,
    column: str | None = None,
) -> ImageRef:
    """A checked reference to the image ``value`` names (a path relative to ``base``, inline data, or a table's
    bytes: ``row`` and ``column`` of the table ``base``): the bytes are read once, hashed, held to ``limits``
    and decoded; the decoded image is kept for its first use (:func:`load_image`)."""
    if isinstance(value, bytes | bytearray) and row is not None:
        data, path, kw = bytes(value), str(base), {"index": index, "row": row, "column": column}
        value = f"image {index} of column {column!r}"  # for the messages below
    elif not isinstance(value, str) or not value:
        raise _fail(where, f"image {index} is {_shown(value)}, not image bytes, a path or inline data",
                    "give a path or data:image/...")  # fmt: skip
    elif value.startswith(INLINE_PREFIX):
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
    if ref.row is not None:
        from yatt_lightning.datamodules.table_rows import open_table, stored_row

        data = table_images(stored_row(open_table(ref.path), ref.row)[ref.column])[ref.index]
        data = data if isinstance(data, bytes) else b""  # the cell no longer holds bytes: changed, below
    elif ref.inline:
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
