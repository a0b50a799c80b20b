"""Rows from tables as users have them: Parquet files, a ``datasets.save_to_disk`` folder, a JSON file.

The table is opened with Hugging Face ``datasets`` as memory-mapped Arrow (a Parquet source is converted
once, into ``$YATT_CACHE/datasets``, and mapped from there by every rank and every later run), and a row is
read when the data loader asks for its index: a rank reads only its share, and a million rows cost a rank
the pages it touches, which the OS can drop, not a copy in its memory.

Columns map to the fields yatt reads (:class:`Columns`): the prompt (a string, or chat messages), the answer
the reward compares with (a dotted path reaches into a struct: verl's ``reward_model.ground_truth``), and
every other column passes through as a row field (``data_source`` names the row's source in validation's
figures). verl's layout (``data_source``, ``prompt`` as chat messages, ``reward_model.ground_truth``,
``extra_info``) needs no mapping.
"""

from __future__ import annotations

import functools
import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yatt_lightning.chat import chat_messages, display_prompt

VERL_ANSWER = "reward_model.ground_truth"


@dataclass(frozen=True)
class Columns:
    """Which columns hold what: ``prompt_key`` (or ``messages``), ``answer_key`` (``None``: ``answer``, else
    verl's ``reward_model.ground_truth`` where the table has it)."""

    prompt_key: str = "prompt"
    answer_key: str | None = None


def is_table(path: str) -> bool:
    """Whether ``data.path`` names a table this module reads (anything but a JSON-lines file)."""
    return not path.endswith(".jsonl")


def prompt_row(row: dict, where: str, prompt_key: str) -> dict:
    """``row`` with its prompt as yatt reads it: ``prompt`` (text) and, for chat rows, ``messages``."""
    row = dict(row)
    if prompt_key in row and "messages" in row and prompt_key != "messages":
        raise ValueError(f"{where}: both {prompt_key!r} and 'messages'; give the prompt once.")
    value = row.pop(prompt_key) if prompt_key in row else row.pop("messages", None)
    if value is None:
        raise ValueError(
            f"{where}: no {prompt_key!r} field (fields: {', '.join(sorted(row)) or 'none'}); a row needs a prompt "
            "string or chat 'messages' (`data.prompt_key` names the column)."
        )
    if isinstance(value, list):
        row["messages"] = chat_messages(value, where)
        row["prompt"] = display_prompt(row["messages"])
    elif isinstance(value, str) and value.strip():
        row["prompt"] = value
    else:
        raise ValueError(f"{where}: {prompt_key!r} must be a non-empty string or a list of chat messages.")
    row["_source"] = where
    return row


class TableRows:
    """The rows of a table, read by index (a ``Dataset`` for the data loader; ``len`` is the table's).

    Args:
        path: A Parquet file, a glob of them, a folder of them, a ``save_to_disk`` folder, or a JSON file.
        columns: The column mapping.
        key: The configuration key that named ``path`` (in messages).
    """

    def __init__(self, path: str, columns: Columns = Columns(), key: str = "data.path") -> None:
        self.table, self.files = _open(path, key)
        names = set(self.table.column_names)
        prompt = columns.prompt_key if columns.prompt_key in names else "messages" if "messages" in names else None
        if prompt is None:
            raise ValueError(
                f"`{key}`: {path} has no column {columns.prompt_key!r} (columns: {', '.join(sorted(names))}); set "
                "`data.prompt_key` to the column that holds the prompt."
            )
        self.prompt_key = prompt
        answer = columns.answer_key or ("answer" if "answer" in names else VERL_ANSWER if _has(self.table, VERL_ANSWER) else None)
        if columns.answer_key is not None and not _has(self.table, answer):
            raise ValueError(
                f"`data.answer_key`: {path} has no column {answer!r} (columns: {', '.join(sorted(names))}; a dotted "
                "path reaches into a struct column)."
            )
        self.answer_key = answer

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> dict:
        where = f"{self.files} row {index}"
        row = prompt_row(self.table[int(index)], where, self.prompt_key)
        if self.answer_key is not None and self.answer_key != "answer":
            row["answer"] = dotted_field(row, self.answer_key, where)
        row["_id"] = int(index)
        return row


def table_folder(path: str) -> Path:
    """The folder a table's relative paths (its images') start from: the table's folder, or its file's."""
    p = Path(path)
    if p.is_dir():
        return p
    if any(c in path for c in "*?["):
        return Path(sorted(glob.glob(path, recursive=True))[0]).parent
    return p.parent


@functools.cache
def open_table(path: str):
    """The table ``data.path`` names, opened once a process, rows as stored (``datasets``' ``Image`` cells as
    ``{"bytes", "path"}``, undecoded): what an image reference pointing into the table reads back."""
    return _open(path, "data.path")[0].with_format("arrow")


def stored_row(table, index: int) -> dict:
    """Row ``index`` of ``table`` (a ``with_format("arrow")`` view) as Python values, nothing decoded."""
    return table[int(index)].to_pylist()[0]


def _has(table, dotted: str) -> bool:
    head, *rest = dotted.split(".")
    if head not in table.column_names:
        return False
    feature: Any = table.features[head]
    for part in rest:
        if not isinstance(feature, dict) or part not in feature:
            return False
        feature = feature[part]
    return True


def dotted_field(row: dict, dotted: str, where: str) -> Any:
    """The value at ``dotted`` (``reward_model.ground_truth`` reaches into a struct); an error naming the row."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"{where}: no {dotted!r} (set `data.answer_key` to the column that holds the answer).")
        value = value[part]
    return value


def _open(path: str, key: str):
    """The table at ``path`` as memory-mapped Arrow, and how messages name its files."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    from yatt_lightning.models.build_cache import cache_dir

    p = Path(path)
    if p.is_dir() and any((p / f).is_file() for f in ("state.json", "dataset_dict.json")):  # datasets' save_to_disk
        table = datasets.load_from_disk(str(p))
        if isinstance(table, datasets.DatasetDict):
            raise ValueError(
                f"`{key}`: {path} holds the splits {', '.join(table)}; name one, e.g. {p / next(iter(table))}."
            )
        return table, str(p)
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*.parquet"))
    elif any(c in path for c in "*?["):
        files = sorted(glob.glob(path, recursive=True))
    else:
        files = [path] if p.is_file() else []
    if not files:
        raise FileNotFoundError(
            f"`{key}`: {path} matches no file (a .jsonl or .json file, Parquet files, a glob, or a folder written by "
            "datasets' save_to_disk)."
        )
    suffixes = {Path(f).suffix for f in files}
    if suffixes not in ({".parquet"}, {".json"}):
        raise ValueError(f"`{key}`: {path} gives {', '.join(sorted(suffixes))} files; give Parquet files or one JSON file.")
    cache = str(cache_dir() / "datasets")
    try:
        if suffixes == {".json"}:
            table = datasets.Dataset.from_json(files, cache_dir=cache)
        else:
            table = datasets.Dataset.from_parquet(files, cache_dir=cache)
    except Exception as err:  # a file that is not what its name says: name it, and what the reader said
        raise ValueError(f"`{key}`: {path} could not be read as {', '.join(sorted(suffixes))}: {err}") from None
    return table, files[0] if len(files) == 1 else f"{path} ({len(files)} files)"
