"""Tier 1: prompt loading, data-parallel sharding and resumable loading."""

import json

import pytest
from yatt_lightning.datamodules.prompt import PromptDataModule, read_jsonl
from yatt_lightning.datamodules.tasks import AlphabetTask


class _FakeStrategy:
    def __init__(self, replicas, rank):
        self.distributed_sampler_kwargs = {"num_replicas": replicas, "rank": rank}


class _FakeTrainer:
    def __init__(self, replicas=1, rank=0):
        self.strategy = _FakeStrategy(replicas, rank)


def _loader(dm, replicas=1, rank=0):
    dm.trainer = _FakeTrainer(replicas, rank)
    dm.setup("fit")
    return dm.train_dataloader()


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not UTF-8 \(byte 16 of the line\); re-encode the file"):
        read_jsonl(path)


def test_jsonl_rows_keep_their_fields(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "2+2=", "answer": "4"}\n\n{"question": "hi", "answer": "x"}\n')
    with pytest.raises(ValueError, match=rf"{path}:3: no 'prompt' field \(fields: answer, question\)"):
        read_jsonl(path)
    path.write_text('{"question": "hi", "answer": "x"}\n')
    rows = read_jsonl(path, prompt_key="question")
    assert rows == [{"prompt": "hi", "answer": "x", "_source": f"{path}:1"}]


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"prompt": "a", ', "not valid JSON"),
        ('["prompt"]', "expected a JSON object"),
        ('{"prompt": ""}', "'prompt' must be a non-empty string"),
    ],
)
def test_malformed_jsonl_line_names_file_and_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2: {match}"):
        read_jsonl(path)


def test_a_byte_order_mark_is_read_and_a_json_array_is_named_as_one(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes("\ufeff".encode() + b'{"prompt": "a"}\n{"prompt": "b"}\n')  # as editors save UTF-8
    assert [r["prompt"] for r in read_jsonl(path)] == ["a", "b"]
    for text in ('[{"prompt": "a"}, {"prompt": "b"}]\n', '[\n  {"prompt": "a"}\n]\n'):
        path.write_text(text)
        with pytest.raises(ValueError, match=rf"{path}:1: .*one JSON object per line.*jq -c"):
            read_jsonl(path)


def test_missing_data_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="`data.path`: .*nope.jsonl does not exist"):
        PromptDataModule(path=str(tmp_path / "nope.jsonl"))


def test_path_and_task_together_is_an_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="choose one"):
        PromptDataModule(path=str(path), task=AlphabetTask())


def test_alphabet_task_rows():
    rows = AlphabetTask(num_rows=3, answer_len=3, seed=1).rows()
    assert rows == AlphabetTask(num_rows=3, answer_len=3, seed=1).rows()
    assert AlphabetTask().row("y") == {"prompt": "after y", "answer": "z a b c"}


def test_data_parallel_shards_are_disjoint_and_cover_the_data():
    ids = []
    for rank in range(2):
        dm = PromptDataModule(task=AlphabetTask(num_rows=64), batch_size=4, seed=3)
        ids.append([row["_id"] for batch in _loader(dm, 2, rank) for row in batch])
    assert len(ids[0]) == len(ids[1]) == 32
    assert not set(ids[0]) & set(ids[1])
    assert set(ids[0]) | set(ids[1]) == set(range(64))


def test_loader_resumes_mid_epoch_with_the_same_order():
    dm = PromptDataModule(task=AlphabetTask(num_rows=40), batch_size=4, seed=5)
    loader = _loader(dm)
    full = [[r["_id"] for r in b] for b in loader]
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))  # a checkpoint round-trip
    dm2 = PromptDataModule(task=AlphabetTask(num_rows=40), batch_size=4, seed=5)
    loader2 = _loader(dm2)
    loader2.load_state_dict(state)
    rest = [[r["_id"] for r in b] for b in loader2]
    assert rest == full[3:]


def test_too_small_dataset_is_explained():
    dm = PromptDataModule(task=AlphabetTask(num_rows=3), batch_size=4)
    with pytest.raises(ValueError, match="fewer than one step needs"):
        _loader(dm)


def _tasks_of(config: str) -> tuple[list[dict], list[dict]]:
    """The training and held-out rows of a shipped config's ``data.task`` / ``data.val_task``."""
    import importlib

    import yaml

    from tests.helpers import REPO

    data = yaml.safe_load((REPO / "configs" / config).read_text())["data"]["init_args"]

    def build(spec: dict):
        module, _, name = spec["class_path"].rpartition(".")
        return getattr(importlib.import_module(module), name)(**spec.get("init_args", {}))

    return build(data["task"]).rows(), build(data["val_task"]).rows()


def test_alphabet_task_held_out_prompts_split_by_a_fixed_rule():
    """context 4: 104 prompts, of which 26 (index of the last letter + letters shown = 0 mod 4) are held out;
    "after b c" (2 + 2) is one, "after d" (3 + 1) another, "after a" (0 + 1) and "after c d" (3 + 2) are not."""
    train, held = AlphabetTask(context=4, held_out=False), AlphabetTask(context=4, held_out=True)
    assert len(train.prompts) == 78 and len(held.prompts) == 26
    assert {"after b c", "after d"} <= {r["prompt"] for r in held.rows()}
    assert not {"after a", "after c d"} & {r["prompt"] for r in held.rows()}
    assert AlphabetTask(context=4).row("f", 3) == {"prompt": "after d e f", "answer": "g h i j"}
    assert AlphabetTask(num_rows=5).rows() == AlphabetTask(num_rows=5, context=1).rows()  # the default task


@pytest.mark.parametrize("config", ["sft_tiny.yaml", "dpo_tiny.yaml"])
def test_the_stages_held_out_prompts_occur_in_no_training_row(config):
    """configs/sft_tiny.yaml's held-out loss and configs/dpo_tiny.yaml's held-out accuracy (bench/stages.py) are
    measured on prompts the run never trains on: every held-out prompt is absent from the training rows (for
    DPO, every held-out pair's prompt from every training pair), while both sets cover many prompts."""
    train, held = _tasks_of(config)
    train_prompts, held_prompts = {r["prompt"] for r in train}, {r["prompt"] for r in held}
    assert not train_prompts & held_prompts
    assert len(train_prompts) == 78 and len(held_prompts) == 26


def test_the_built_in_tasks_words_are_in_the_built_in_tokenizers_corpus():
    """The tiny models' tokenizers learn ``models/tiny.py``'s corpus; the tasks' words must be in it (a task word
    it lacks would be spelt in pieces the tiny model never saw)."""
    from yatt_lightning.datamodules.tasks import COLOURS

    from yatt_lightning.models.tiny import ALPHABET_CORPUS, COLOUR_CORPUS

    words = {w for row in AlphabetTask(num_rows=52).rows() for w in (row["prompt"] + " " + row["answer"]).split()}
    assert words <= set(" ".join(ALPHABET_CORPUS).split())
    assert {"colour:", *COLOURS} <= set(" ".join(COLOUR_CORPUS).split()) and set(ALPHABET_CORPUS) <= set(COLOUR_CORPUS)
