"""PromptDataModule: prompts for RL, sharded by data-parallel rank, resumable mid-epoch.

Rows are dicts with a ``prompt`` string (or chat ``messages``); every other field travels with the row to
the reward function (e.g. ``answer``). Sources: a JSON-lines file (one object per line), or a built-in task.
Each data-parallel rank reads only its own shard (a ``DistributedSampler`` over the data-parallel
group, not the global ranks: the ranks of one model-parallel group share their prompts). Loading uses
torchdata's ``StatefulDataLoader``, whose position Lightning saves in checkpoints.

Under a controller that loads on a driver (``SingleController(driver_loads_rows=True)``), rank 0 alone
reads the rows: each step it loads the global batch (every data-parallel rank's batch, the same rows in
the same order as the shards above) and hands it to the controller, which gives each rank its share
(:meth:`~yatt_lightning.rollout.controller.Controller.distribute_rows`); the other ranks' loaders only count steps.
"""

from __future__ import annotations

import glob
import json
import logging
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset, DistributedSampler
from typing_extensions import override
from yatt_lightning.datamodules.table_rows import Columns, TableRows, is_table, prompt_row
from yatt_lightning.datamodules.tasks import AlphabetTask, EveryPrompt, Task

if TYPE_CHECKING:
    from torchdata.stateful_dataloader import StatefulDataLoader

from yatt_lightning.distributed.seeding import resolve_seed

log = logging.getLogger(__name__)


class _Steps(Dataset):
    """As many placeholders as the driver has rows: a rank that loads nothing still takes as many steps."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index: int) -> None:
        return None


class PromptDataset(Dataset):
    def __init__(self, rows: Sequence[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


ARRAY_HINT = (
    " A JSON-lines file holds one JSON object per line, and this looks like a JSON array; write one object per "
    "line (for example `jq -c '.[]' rows.json > rows.jsonl`)."
)


def jsonl_objects(path: Path) -> Iterator[tuple[int, int, dict]]:
    """``(line number, byte offset, object)`` per non-empty line of a JSON-lines file; a line that is not
    UTF-8, not JSON or not an object is an error naming the file and line number."""
    if not path.is_file():
        raise FileNotFoundError(f"`data.path`: {path} does not exist.")
    with path.open("rb") as f:
        offset = 0
        for lineno, raw in enumerate(f, start=1):
            where, start, offset = f"{path}:{lineno}", offset, offset + len(raw)
            try:  # the first line may start with a byte-order mark, as editors save UTF-8
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{where}: not UTF-8 (byte {err.start + 1} of the line); re-encode the file."
                ) from None
            if not line.strip():
                continue
            array = ARRAY_HINT if line.lstrip().startswith("[") else ""
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno}).{array}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}.{array}")
            yield lineno, start, row


def read_jsonl(path: Path, prompt_key: str = "prompt") -> list[dict]:
    """Rows of a JSON-lines file; a malformed line is an error naming the file and line number.

    A row's prompt is a string under ``prompt_key``, or chat messages (``[{"role", "content"}, ...]``)
    under ``prompt_key`` or ``messages``; a chat row keeps them as ``messages`` and shows its last user
    message as ``prompt`` (see :mod:`yatt_lightning.chat`)."""
    rows = [prompt_row(row, f"{path}:{lineno}", prompt_key) for lineno, _, row in jsonl_objects(path)]
    if not rows:
        raise ValueError(f"`data.path`: {path} holds no rows.")
    return rows


def _identity(rows: list[dict]) -> list[dict]:
    return rows


class PromptDataModule(pl.LightningDataModule):
    """Args:
    path: The prompts: a JSON-lines file, a JSON file, Parquet (a file, a glob or a folder of them) or a folder
        written by ``datasets``' ``save_to_disk`` (read lazily, :mod:`~yatt_lightning.datamodules.table_rows`);
        ``None`` uses ``task``.
    task: A built-in task generating rows (default :class:`AlphabetTask` when ``path`` is not given).
    batch_size: Prompts per data-parallel rank per RL step (each is sampled ``model.sampling.n`` times).
    prompt_key: Field of each row holding the prompt (a string, or chat messages; a row may give
        ``messages`` instead).
    answer_key: Column of a table holding the answer the rewards compare with, as ``answer`` (a dotted path
        reaches into a struct); ``None``: ``answer``, else verl's ``reward_model.ground_truth``.
    shuffle: Shuffle every epoch (seeded: the order is the same for the same seed).
    seed: Seed of the shuffle; ``None`` follows ``seed_everything``.
    num_workers: Data-loader worker processes.
    val_path: A held-out JSON-lines file to validate on (RL and every stage: ``trainer.val_check_interval``).
    val_task: A built-in task generating the held-out rows (give it another seed than ``task``'s), or
        ``alphabet_heldout``: each prompt of the alphabet task's held-out split once (6 start letters; with
        ``context`` 4, 26 prompts), the training task then drawing from the other prompts only.
    val_batch_size: Held-out rows per data-parallel rank per validation batch.
    """

    def __init__(
        self,
        path: str | None = None,
        task: Task | None = None,
        batch_size: int = 16,
        prompt_key: str = "prompt",
        answer_key: str | None = None,
        shuffle: bool = True,
        seed: int | None = None,
        num_workers: int = 0,
        val_path: str | None = None,
        val_task: Task | str | None = None,
        val_batch_size: int = 64,
    ) -> None:
        super().__init__()
        if path is not None and task is not None:
            raise ValueError("`data.path` and `data.task` are both set; choose one source of prompts.")
        if val_path is not None and val_task is not None:
            raise ValueError("`data.val_path` and `data.val_task` are both set; choose one held-out set.")
        for key, where in (("path", path), ("val_path", val_path)):
            if where is not None and not (Path(where).exists() or (is_table(where) and glob.glob(where))):
                raise FileNotFoundError(f"`data.{key}`: {where} does not exist.")
        if val_batch_size < 1:
            raise ValueError(f"`data.val_batch_size` must be >= 1, got {val_batch_size}.")
        if batch_size < 1:
            raise ValueError(f"`data.batch_size` must be >= 1, got {batch_size}.")
        self.path = path
        self.task = task if task is not None or path is not None else AlphabetTask()
        self.batch_size = batch_size
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.shuffle = shuffle
        self.seed = resolve_seed(seed)
        self.num_workers = num_workers
        if isinstance(val_task, str):
            val_task = self._held_out_split(val_task)
        self.val_path, self.val_task, self.val_batch_size = val_path, val_task, val_batch_size
        self.dataset: PromptDataset | None = None

    def _held_out_split(self, name: str) -> Task:
        """``data.val_task`` given by name: the held-out split of the training task, which keeps the rest."""
        if name != "alphabet_heldout":
            raise ValueError(f"`data.val_task`: unknown held-out set {name!r}; name `alphabet_heldout`, give a task's "
                             "class_path, or a file with `data.val_path`.")  # fmt: skip
        task = self.task
        if type(task) is not AlphabetTask or task.held_out is True:
            where = f"`data.path` {self.path}" if self.path is not None else f"`data.task` {type(task).__name__}"
            raise ValueError(f"`data.val_task: alphabet_heldout` holds out prompts of the alphabet task, but the training "
                             f"rows come from {where}; give a held-out file with `data.val_path` instead.")  # fmt: skip
        self.task = AlphabetTask(task.num_rows, task.answer_len, task.seed, task.context, held_out=False)
        held = AlphabetTask(1, task.answer_len, task.seed, task.context, held_out=True)
        log.info("training on the %d alphabet prompts outside the held-out split; validating on the other %d",
                 len(self.task.prompts), len(held.prompts))  # fmt: skip
        return EveryPrompt(held)

    def load_rows(self, path: str | None = None, task: Task | None = None) -> Sequence[dict]:
        """The rows of ``path`` or ``task`` (default: the training ones): a list, or a table's rows read by index."""
        held_out = path is not None or task is not None
        path, task = (path, task) if held_out else (self.path, self.task)
        if path is not None and is_table(path):
            return TableRows(path, Columns(self.prompt_key, self.answer_key), "data.val_path" if held_out else "data.path")
        if path is not None:
            rows = read_jsonl(Path(path), self.prompt_key)
        else:
            rows = [dict(r, _source=f"{type(task).__name__} row {i}") for i, r in enumerate(task.rows())]
        for i, row in enumerate(rows):
            row["_id"] = i
        return rows

    @override
    def setup(self, stage: str) -> None:
        if self.dataset is None and not (self._driver() is not None and self.trainer.global_rank != 0):
            self.dataset = self.make_dataset(self.load_rows())

    def make_dataset(self, rows: list[dict]) -> Dataset:
        """The dataset of the loaded rows (a subclass may check or decode rows as they are drawn)."""
        return PromptDataset(rows)

    def _driver(self) -> Any:
        """The strategy's controller when rank 0 loads every rank's rows, else ``None``."""
        controller = getattr(self.trainer.strategy, "controller", None) if self.trainer else None
        return controller if controller is not None and controller.loads_on_driver else None

    def shard(self) -> tuple[int, int]:
        """(data-parallel size, data-parallel rank) of this process."""
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None
        if not kwargs:
            return 1, 0
        return kwargs["num_replicas"], kwargs["rank"]

    @override
    def train_dataloader(self) -> StatefulDataLoader:
        from torchdata.stateful_dataloader import StatefulDataLoader

        replicas, rank = self.shard()
        dataset, batch_size = self.dataset, self.batch_size
        if self._driver() is not None and replicas > 1:
            # The driver's permutation is the shards' (the same seed); one block of replicas x batch_size of it
            # is the union of every rank's batch of the step, rank r's rows at positions r, r + replicas, ...
            num_rows = [len(dataset) if rank == 0 else None]
            torch.distributed.broadcast_object_list(num_rows, src=0)
            if rank == 0:
                replicas, batch_size = 1, replicas * batch_size
            else:
                dataset = _Steps(num_rows[0])
        if len(dataset) < replicas * batch_size:
            raise ValueError(
                f"the dataset has {len(dataset)} rows, fewer than one step needs "
                f"({self.shard()[0]} data-parallel ranks x `data.batch_size`={self.batch_size})."
            )
        sampler = DistributedSampler(
            dataset, num_replicas=replicas, rank=rank, shuffle=self.shuffle, seed=self.seed, drop_last=True
        )
        return StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=True,
            collate_fn=_identity,
            num_workers=self.num_workers,
        )

    @override
    def val_dataloader(self) -> list:
        """The held-out rows, in order, each data-parallel rank its share (a stage's validation); none without
        ``val_path`` or ``val_task``."""
        if self.val_path is None and self.val_task is None:
            warnings.filterwarnings("ignore", message=r"Total length of `list` across ranks is zero")  # none is asked
            return []
        from torchdata.stateful_dataloader import StatefulDataLoader

        replicas, rank = self.shard()
        dataset = PromptDataset(self.load_rows(self.val_path, self.val_task))
        if len(dataset) < replicas:
            raise ValueError(
                f"the held-out set has {len(dataset)} rows, fewer than the {replicas} data-parallel ranks."
            )
        sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=False, drop_last=True)
        return StatefulDataLoader(dataset, batch_size=self.val_batch_size, sampler=sampler, collate_fn=_identity)

    @override
    def on_after_batch_transfer(self, batch: list, dataloader_idx: int) -> list[dict]:
        driver = self._driver()
        if driver is None:
            return batch
        replicas, rank = self.shard()
        return driver.distribute_rows([batch[r::replicas] for r in range(replicas)] if rank == 0 else None)
