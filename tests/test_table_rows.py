"""Datasets as users have them: Parquet (a file, a glob, a folder), a save_to_disk folder, JSON; verl's layout;
bad tables named; and a real run that trains and validates on Parquet files."""

import json
import sys

import pytest
from yatt_lightning.datamodules.prompt import PromptDataModule

from tests.helpers import REPO, read_scalars, run

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def verl_rows(starts: str, source: str = "alphabet") -> list[dict]:
    """Rows in verl's layout: the prompt as chat messages, the answer in ``reward_model.ground_truth``."""
    return [{"data_source": source, "prompt": [{"role": "user", "content": f"after {c}"}], "ability": "letters",
             "reward_model": {"style": "rule", "ground_truth": " ".join(LETTERS[(LETTERS.index(c) + k) % 26] for k in range(1, 5))},
             "extra_info": {"split": "train", "index": i}} for i, c in enumerate(starts)]  # fmt: skip


def write_parquet(path, rows) -> str:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("YATT_CACHE", str(tmp_path / "cache"))  # the Arrow conversions of this test's files


def test_verl_layout_parquet_needs_no_mapping_and_reads_rows_by_index(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", verl_rows("abcdefgh"))
    rows = PromptDataModule(path=path).load_rows()
    assert len(rows) == 8 and not isinstance(rows, list)  # read by index, not into a list
    row = rows[2]
    assert row["prompt"] == "after c" and row["messages"] == [{"role": "user", "content": "after c"}]
    assert row["answer"] == "d e f g" and row["data_source"] == "alphabet" and row["extra_info"]["index"] == 2
    assert row["_id"] == 2 and row["_source"] == f"{path} row 2"


def test_globs_folders_datasets_folders_json_and_column_mapping(tmp_path):
    import datasets

    folder = tmp_path / "shards"
    folder.mkdir()
    write_parquet(folder / "part-0.parquet", verl_rows("abc"))
    write_parquet(folder / "part-1.parquet", verl_rows("xyz"))
    assert [r["prompt"] for r in PromptDataModule(path=str(folder)).load_rows()] == [f"after {c}" for c in "abcxyz"]
    glob_rows = PromptDataModule(path=str(folder / "part-*.parquet")).load_rows()
    assert len(glob_rows) == 6 and glob_rows[5]["_source"].startswith(f"{folder / 'part-*.parquet'} (2 files)")
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"question": "after q", "solution": {"final": "r s t u"}}]).save_to_disk(str(saved))
    mapped = PromptDataModule(path=str(saved), prompt_key="question", answer_key="solution.final").load_rows()
    assert (mapped[0]["prompt"], mapped[0]["answer"]) == ("after q", "r s t u")
    (tmp_path / "rows.json").write_text(json.dumps([{"prompt": "after m", "answer": "n o p q"}]))
    assert PromptDataModule(path=str(tmp_path / "rows.json")).load_rows()[0]["answer"] == "n o p q"


def test_bad_tables_and_rows_are_named_with_the_key_the_file_the_row_and_the_column(tmp_path):
    import datasets

    with pytest.raises(FileNotFoundError, match=r"`data.path`: .*nothing\*.parquet does not exist"):
        PromptDataModule(path=str(tmp_path / "nothing*.parquet"))
    no_prompt = write_parquet(tmp_path / "q.parquet", [{"question": "after a", "answer": "b c d e"}])
    with pytest.raises(ValueError, match=r"`data.path`: .*q.parquet has no column 'prompt' \(columns: answer, question\); "
                                         r"set `data.prompt_key`"):  # fmt: skip
        PromptDataModule(path=no_prompt).load_rows()
    with pytest.raises(ValueError, match=r"`data.answer_key`: .*has no column 'solution.final'"):
        PromptDataModule(path=no_prompt, prompt_key="question", answer_key="solution.final").load_rows()
    empty = write_parquet(tmp_path / "e.parquet", [{"prompt": "after a"}, {"prompt": " "}])
    rows = PromptDataModule(path=empty).load_rows()
    with pytest.raises(ValueError, match=rf"{empty} row 1: 'prompt' must be a non-empty string"):
        rows[1]
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"`data.path`: .*bad.parquet could not be read as .parquet"):
        PromptDataModule(path=str(tmp_path / "bad.parquet")).load_rows()
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "after a"}])}).save_to_disk(str(splits))
    with pytest.raises(ValueError, match=rf"holds the splits train; name one, e.g. {splits / 'train'}"):
        PromptDataModule(path=str(splits)).load_rows()


@pytest.mark.slow
def test_yatt_fit_trains_on_a_verl_parquet_file_and_validates_on_another_per_data_source(tmp_path):
    """`yatt fit --data.path train.parquet --data.val_path held.parquet` with no other data keys: it trains, and
    validation reports per data source (the held-out rows come from two); a held-out row is never a training
    row."""
    train = write_parquet(tmp_path / "train.parquet", verl_rows("abcefgijkmnoqrsuvwyz" * 16))
    held = write_parquet(tmp_path / "held.parquet", verl_rows("dhl", "left") + verl_rows("ptx", "right"))
    env = {"YATT_CACHE": str(tmp_path / "cache")}
    run([sys.executable, "-m", "yatt_lightning.run.cli", "fit", "--config", str(REPO / "configs" / "grpo_tiny.yaml"),
         "--data.path", train, "--data.val_path", held, "--trainer.max_steps", "8", "--trainer.val_check_interval", "8",
         "--trainer.callbacks", "[]", f"--trainer.logger.init_args.save_dir={tmp_path / 'tb'}"],
        cwd=tmp_path, timeout=600, env=env)  # fmt: skip
    scalars = read_scalars(tmp_path / "tb")
    assert len(scalars["reward/mean"]) == 8
    for key in ("val/reward/mean", "val/reward/mean/left", "val/reward/mean/right", "val/pass@4/left"):
        assert [s for s, _ in scalars[key]] == [0, 8], (key, scalars.get(key))
    assert scalars["val/prompts"][0][1] == 6
