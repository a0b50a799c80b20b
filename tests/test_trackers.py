"""Experiment trackers: one run logs to TensorBoard, W&B (offline) and MLflow (a local file store) at once, and
each is read back from what it wrote: every figure TensorBoard got, the resolved configuration, the tables."""

import json
import os
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, read_scalars, run
from yatt_lightning.trackers import mlflow_name

pytestmark = pytest.mark.slow


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (``run-<id>.wandb``): LevelDB's log format (32 KiB blocks; each record a
    7-byte header, then its part of a protobuf ``Record``) after W&B's 7-byte file header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, records, parts = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if room < 7 or (length == 0 and kind == 0):  # the block's padding
            pos += room
            continue
        parts, pos = parts + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or a record's last part
            record = pb.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def test_tensorboard_wandb_offline_and_mlflow_each_receive_the_figures_the_config_and_the_samples(tmp_path, monkeypatch):
    loggers = [
        {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(tmp_path / "tb"), "name": "run"}},
        {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"save_dir": str(tmp_path), "offline": True, "project": "yatt"}},
        {"class_path": "lightning.pytorch.loggers.MLFlowLogger",
         "init_args": {"experiment_name": "yatt", "tracking_uri": f"file:{tmp_path / 'mlruns'}"}},
    ]  # fmt: skip
    # MLflow 3.17 refuses its file store unless told (it would have a database); W&B never leaves the machine
    env = {"MLFLOW_ALLOW_FILE_STORE": "true", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           **{f"WANDB_{d}_DIR": str(tmp_path / "wandb-home" / d.lower()) for d in ("CACHE", "CONFIG", "DATA")}}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    run([sys.executable, "-m", "yatt_lightning.run.cli", "fit", "--config", str(REPO / "configs" / "grpo_tiny.yaml"),
         "--trainer.logger", json.dumps(loggers), "--trainer.max_steps", "4", "--data.val_task", "alphabet_heldout",
         "--trainer.val_check_interval", "2", "--trainer.callbacks", "[]", "--model.init_args.sampling.n", "4"],
        cwd=tmp_path, timeout=600, env={**os.environ, **env})  # fmt: skip
    tags = set(read_scalars(tmp_path / "tb"))
    assert {"reward/mean", "actor/pg_loss", "val/reward/mean", "val/pass@4", "val/mean@4"} <= tags, tags

    records = wandb_records(next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")))
    kind = lambda r: r.WhichOneof("record_type")  # noqa: E731
    logged = {item.key or "/".join(item.nested_key) for r in records if kind(r) == "history" for item in r.history.item}
    assert tags <= logged, f"W&B lacks {tags - logged}"
    config = {item.key: json.loads(item.value_json) for r in records if kind(r) == "config" for item in r.config.update}
    assert config["model"]["init_args"]["sampling"]["n"] == 4 and config["trainer"]["max_steps"] == 4
    run_dir = next((tmp_path / "wandb").glob("offline-run-*/files"))
    table = json.loads(next(run_dir.glob("media/table/val/samples_*.table.json")).read_text())
    assert table["columns"] == ["prompt", "completion", "reward"] and table["data"][0][0].startswith("after ")
    assert list(run_dir.glob("media/table/rollout/samples_*.table.json"))

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("yatt").experiment_id])
    metrics = set(mlflow_run.data.metrics)
    assert {mlflow_name(t) for t in tags} <= metrics and "val/pass_at_4" in metrics, metrics
    assert [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "val/reward/mean")] == [0, 2, 4]
    assert mlflow_run.data.params["model/init_args/sampling/n"] == "4"
    samples = [a.path for a in client.list_artifacts(mlflow_run.info.run_id, "val/samples")]
    assert samples == [f"val/samples/step_{s:08d}.md" for s in (0, 2, 4)], samples
    text = Path(client.download_artifacts(mlflow_run.info.run_id, samples[-1], str(tmp_path / "dl"))).read_text()
    assert text.startswith("| prompt | completion | reward |")
