"""ImagePromptDataModule: image-and-text prompts, each rank reading only the images of the rows it owns.

Rows of a JSON-lines file, in either shape::

    {"prompt": "<image>\\nWhat colour is the square?", "images": ["img/0.png"], "answer": "red"}
    {"messages": [{"role": "user", "content": [{"type": "image", "image": "data:image/png;base64,..."},
                                               {"type": "text", "text": "What colour is the square?"}]}],
     "answer": "red"}

or a table (Parquet files, a ``datasets`` folder: :mod:`~yatt_lightning.datamodules.table_rows`) whose
``images`` column (``data.images_key``) holds each row's images, as ``datasets``' ``Image`` feature stores them
(bytes) or as paths; verl's layout (geometry3k: ``prompt`` as chat messages with ``<image>`` marks, ``images``,
``reward_model.ground_truth``) needs no mapping. A table's rows are read when drawn, like its text rows.

Image paths are relative to the dataset file (a table's: its folder). ``<image>`` marks where each image goes in the prompt; a
plain row without marks gets one per image in front of its text; a chat row keeps its messages (the
model's chat template renders them, :mod:`yatt_lightning.chat`) and shows its last user message as
``prompt``.
Reading the file keeps only where each image is (inline data is dropped after the line is parsed, and
read again from the file when needed). A row's images are hashed, checked and decoded when the row is
first drawn, on the rank that owns it (in its data loader); the row then carries
:class:`~yatt_lightning.datamodules.images.ImageRef` values, never pixels.

A bad image (missing, not an image, truncated, over ``max_image_bytes`` / ``max_image_pixels``) is an
error naming the row, the image and the fix; with ``on_bad_image="skip"`` the row is replaced by the next
good row of the dataset and counted (:attr:`ImagePromptDataModule.skipped`, per rank; each skip is a
warning in the log naming the row and why), so every rank still draws as many rows.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

from torch.utils.data import Dataset
from typing_extensions import override
from yatt_lightning.datamodules.images import (
    INLINE_PREFIX,
    ImageError,
    ImageLimits,
    ImageRef,
    image_values,
    reference,
    table_images,
)
from yatt_lightning.datamodules.prompt import PromptDataModule, jsonl_objects
from yatt_lightning.datamodules.table_rows import (
    Columns,
    TableRows,
    dotted_field,
    is_table,
    stored_row,
    table_folder,
)
from yatt_lightning.datamodules.tasks import ColourTask

from yatt_lightning.chat import IMAGE_MARK, chat_messages, content_parts, display_prompt, messages_text

log = logging.getLogger(__name__)


def _prompt_text(raw: dict, where: str, n_images: int) -> tuple[str, list[dict] | None]:
    """The row's prompt text with one ``<image>`` mark per image, and its chat messages (image parts without
    their data, which stays in the file) when it is a chat row."""
    value = raw["messages"] if "messages" in raw else raw.get("prompt")
    messages = None
    if isinstance(value, list):
        messages = [
            {**m, "content": content_parts(m["content"])} if isinstance(m["content"], list) else m
            for m in chat_messages(value, where, images=True)
        ]
        text = messages_text(messages)
    elif isinstance(value, str) and value.strip():
        text = value
        if IMAGE_MARK not in text:
            text = f"{IMAGE_MARK}\n" * n_images + text
    else:
        raise ValueError(f"{where}: a row needs a non-empty 'prompt' string or chat 'messages'.")
    if text.count(IMAGE_MARK) != n_images:
        raise ValueError(f"{where}: the prompt has {text.count(IMAGE_MARK)} {IMAGE_MARK} marks for {n_images} images.")
    return text, messages


def read_image_jsonl(path: Path) -> list[dict]:
    """Rows of an image-and-text JSON-lines file: the prompt with its image marks, where each image is
    (``_images``: the path, or ``None`` for inline data, re-read from the line at ``_offset``), and the
    row's other fields. Nothing is hashed or decoded here."""
    rows = []
    for lineno, offset, raw in jsonl_objects(path):
        where = f"{path}:{lineno}"
        values = image_values(raw)
        row = {k: v for k, v in raw.items() if k not in ("prompt", "messages", "images")}
        text, messages = _prompt_text(raw, where, len(values))
        if messages is None:
            row["prompt"] = text
        else:
            row.update(messages=messages, prompt=display_prompt(messages))
        row["_images"] = [None if isinstance(v, str) and v.startswith(INLINE_PREFIX) else v for v in values]
        row.update(_source=where, _line=lineno, _offset=offset)
        rows.append(row)
    if not rows:
        raise ValueError(f"`data.path`: {path} holds no rows.")
    return rows


class ImageTableRows(TableRows):
    """Image-and-text rows of a table, read by index, shaped as :func:`read_image_jsonl`'s rows: the images are
    the row's ``images_key`` cell (bytes stay in the table until the row is drawn; paths are made absolute)."""

    def __init__(self, path: str, columns: Columns, images_key: str) -> None:
        super().__init__(path, columns)
        if images_key not in self.table.column_names:
            raise ValueError(
                f"`data.images_key`: {path} has no column {images_key!r} (columns: "
                f"{', '.join(sorted(self.table.column_names))}); name the column that holds each row's images."
            )
        self.path, self.images_key = path, images_key
        self.folder = table_folder(path)
        self.stored = self.table.with_format("arrow")  # datasets' Image cells as stored, not decoded

    def __getitem__(self, index: int) -> dict:
        where = f"{self.files} row {index}"
        raw = stored_row(self.stored, index)
        values = table_images(raw.pop(self.images_key))
        if self.prompt_key not in ("prompt", "messages"):
            raw["prompt"] = raw.pop(self.prompt_key)
        text, messages = _prompt_text(raw, where, len(values))
        row = {k: v for k, v in raw.items() if k not in ("prompt", "messages")}
        if messages is None:
            row["prompt"] = text
        else:
            row.update(messages=messages, prompt=display_prompt(messages))
        if self.answer_key is not None and self.answer_key != "answer":
            row["answer"] = dotted_field(row, self.answer_key, where)
        values = [str(self.folder / v) if isinstance(v, str) and not v.startswith(INLINE_PREFIX) else v for v in values]
        row.update(_images=values, _source=where, _row=int(index), _id=int(index))
        return row


class ImagePromptDataset(Dataset):
    """Rows whose images are checked and decoded when drawn; a bad one raises, or (``skip``) the next good
    row stands in and is counted."""

    def __init__(self, rows: list[dict] | ImageTableRows, path: Path, limits: ImageLimits, on_bad_image: str) -> None:
        self.rows, self.path, self.limits, self.on_bad_image = rows, path, limits, on_bad_image
        self.bad: set[int] = set()  # rows whose images failed (skip mode)

    def __len__(self) -> int:
        return len(self.rows)

    def resolve(self, index: int) -> dict:
        """Row ``index`` with ``images``: a checked :class:`ImageRef` per image (read and decoded once, here)."""
        row = dict(self.rows[index])
        values = row.pop("_images")
        if None in values:  # inline data: read the row's line again, once
            with self.path.open("rb") as f:
                f.seek(row["_offset"])
                inline = image_values(json.loads(f.readline()))
            values = [inline[k] if value is None else value for k, value in enumerate(values)]
        if "_row" in row:  # a table's: bytes are read back from the table, by row, column and index
            spot = {"row": row.pop("_row"), "column": self.rows.images_key}
        else:
            spot = {"line": row["_line"], "offset": row["_offset"]}
        row["images"] = [
            reference(value, base=self.path, where=row["_source"], limits=self.limits, index=k, **spot)
            for k, value in enumerate(values)
        ]
        return row

    @property
    def skipped(self) -> int:
        """Rows found bad so far (each counted once, however often it was drawn)."""
        return len(self.bad)

    def __getitem__(self, index: int) -> dict:
        for attempt in range(len(self.rows)):
            i = (index + attempt) % len(self.rows)
            if i in self.bad:
                continue
            try:
                return self.resolve(i)
            except ImageError as err:
                if self.on_bad_image == "raise":
                    raise
                self.bad.add(i)
                log.warning("skipped (%d rows so far): %s", len(self.bad), str(err).split("; ")[0])
        raise ValueError(f"`data.path`: every row of {self.path} has a bad image; nothing to train on.")


class ImagePromptDataModule(PromptDataModule):
    """Args (besides :class:`~yatt_lightning.datamodules.prompt.PromptDataModule`'s):

    path: The JSON-lines file of image-and-text rows, or a table (Parquet: a file, a glob or a folder; a
        ``datasets`` ``save_to_disk`` folder; a JSON file) whose ``images_key`` column holds the images.
    task: A built-in image task instead (:class:`~yatt_lightning.datamodules.tasks.ColourTask`), written
        once under the model cache and then read like ``path``.
    on_bad_image: ``"raise"`` (default): a bad image stops the run naming the row and the image;
        ``"skip"``: the next good row stands in, and the count is logged.
    max_image_bytes: Largest image file (or inline data) accepted, in bytes.
    max_image_pixels: Largest decoded image accepted, in pixels (width x height).
    prompt_key: A table's column holding the prompt (a string with ``<image>`` marks, or chat messages).
    answer_key: A table's column holding the answer (a dotted path reaches into a struct); ``None``:
        ``answer``, else verl's ``reward_model.ground_truth``.
    images_key: A table's column holding each row's images (a list, or one image).
    """

    def __init__(
        self,
        path: str | None = None,
        task: ColourTask | None = None,
        batch_size: int = 16,
        on_bad_image: Literal["raise", "skip"] = "raise",
        max_image_bytes: int = 20 * 2**20,
        max_image_pixels: int = 4096 * 4096,
        shuffle: bool = True,
        seed: int | None = None,
        num_workers: int = 0,
        prompt_key: str = "prompt",
        answer_key: str | None = None,
        images_key: str = "images",
    ) -> None:
        if (path is None) == (task is None):
            raise ValueError("`data.path` (image-and-text rows: a jsonl file or a table) or `data.task` (a built-in "
                             "task): set one.")  # fmt: skip
        super().__init__(path=path, batch_size=batch_size, prompt_key=prompt_key, answer_key=answer_key,
                         shuffle=shuffle, seed=seed, num_workers=num_workers)  # fmt: skip
        self.images_key = images_key
        self.task = None  # PromptDataModule's text task; this module's is ``image_task``
        self.image_task = task
        if on_bad_image not in ("raise", "skip"):
            raise ValueError(f"`data.on_bad_image` must be 'raise' or 'skip', got {on_bad_image!r}.")
        for key, value in (("max_image_bytes", max_image_bytes), ("max_image_pixels", max_image_pixels)):
            if value < 1:
                raise ValueError(f"`data.{key}` must be >= 1, got {value}.")
        self.on_bad_image = on_bad_image
        self.limits = ImageLimits(max_image_bytes, max_image_pixels)

    def source(self) -> Path:
        """The jsonl file: ``path``, or the built-in task's, written once."""
        return Path(self.path) if self.path is not None else self.image_task.write(self.image_task.folder())

    @override
    def load_rows(self) -> list[dict] | ImageTableRows:
        if self.path is not None and is_table(self.path):
            return ImageTableRows(self.path, Columns(self.prompt_key, self.answer_key), self.images_key)
        rows = read_image_jsonl(self.source())
        for i, row in enumerate(rows):
            row["_id"] = i
        return rows

    @override
    def make_dataset(self, rows: list[dict] | ImageTableRows) -> ImagePromptDataset:
        return ImagePromptDataset(rows, self.source(), self.limits, self.on_bad_image)

    @property
    def skipped(self) -> int:
        """Rows replaced because of a bad image, on this rank (in its data loader's process)."""
        return getattr(self.dataset, "skipped", 0)


__all__ = ["IMAGE_MARK", "ImagePromptDataModule", "ImagePromptDataset", "ImageRef", "read_image_jsonl"]
