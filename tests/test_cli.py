"""Tier 3: `yatt fit` end to end through the real CLI on the tiny model (real vLLM, Megatron, TensorBoard)."""

import json
import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, read_scalars, read_texts, yatt, yatt_in_process

TINY = str(REPO / "configs" / "grpo_tiny.yaml")
CONFIGS = sorted((REPO / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_every_shipped_config_parses_through_the_cli(config, tmp_path):
    code, out = yatt_in_process(["fit", "--config", str(config), "--print_config"], cwd=tmp_path)
    assert code == 0, out
    module = re.search(r"model:\s*\n\s*class_path: (\S+)", config.read_text()).group(1)  # the stage's module
    assert f"class_path: {module}" in out


def _stand_in(model: Path, dest: Path) -> Path:
    """A copy of a built-in model's folder long enough for a GPU config's token budgets (its config only is
    read when the objects are built; no weights are loaded)."""
    shutil.copytree(model, dest)
    config = json.loads((dest / "config.json").read_text())

    def lengthen(node):
        if isinstance(node, dict):
            for key, value in node.items():
                node[key] = 32768 if key == "max_position_embeddings" else lengthen(value)
        return node

    (dest / "config.json").write_text(json.dumps(lengthen(config)))
    return dest


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_every_shipped_config_builds_its_objects_on_cpu(config, tmp_path, monkeypatch):
    """Tier 1: the constructors of every shipped config run (and so their checks: layouts, token budgets
    against the model's positions, reward signatures), the GPU configs' too: their model and data paths
    point at stand-ins, the accelerator at the CPU. No process group or engine starts."""
    from yatt_lightning.checkpoint.model_source import resolve_model_path
    from yatt_lightning.run.cli import YattCLI

    text = config.read_text()
    qwen = _stand_in(resolve_model_path("builtin:tiny-qwen2"), tmp_path / "qwen")
    llava = _stand_in(resolve_model_path("builtin:tiny-llava"), tmp_path / "llava")
    text = re.sub(r"/models/llava[\w.-]*", str(llava), text)
    if "/models/Qwen3-30B-A3B" in text:  # a mixture of experts' config (expert parallelism) needs experts
        moe = _stand_in(resolve_model_path("builtin:tiny-qwen3-moe"), tmp_path / "moe")
        text = text.replace("/models/Qwen3-30B-A3B", str(moe))
    text = re.sub(r"/models/[\w.-]+", str(qwen), text)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"what is {i}+1?", "answer": str(i + 1)}) + "\n"
                                                 for i in range(512)))  # fmt: skip
    text = re.sub(r"/data/[\w.-]+\.jsonl", str(tmp_path / "rows.jsonl"), text)
    if ".parquet" in text:  # Parquet in verl's layout (the math config's GSM8K and MATH splits)
        import datasets

        rows = [{"data_source": "gsm8k", "prompt": [{"role": "user", "content": f"what is {i}+1?"}],
                 "reward_model": {"ground_truth": str(i + 1)}} for i in range(512)]  # fmt: skip
        datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
        text = re.sub(r"/data/[\w./*-]+\.parquet", str(tmp_path / "rows.parquet"), text)
    text = text.replace("my_rewards.", "shipped_config_rewards.")  # the user's file a config names (another test has a my_rewards)
    (tmp_path / "shipped_config_rewards.py").write_text("def count_answer(prompt, completion, **row):\n    return 0.0\n")
    (tmp_path / "config.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cli = YattCLI(args=["--config", "config.yaml", "--trainer.accelerator", "cpu"], run=False)
    strategy = cli.trainer.strategy
    placement = re.search(r"placement:\s*\n\s*class_path: (\S+)", text)
    assert type(strategy.placement).__name__ == (placement.group(1).rsplit(".", 1)[-1] if placement else "FullColocation")
    tp = re.search(r"tensor_model_parallel_size: (\d+)", text)
    assert strategy.tensor_model_parallel_size == (int(tp.group(1)) if tp else 1)
    names = [n for n in re.findall(r"class_path: yatt_lightning\.rewards\.(?:\S+\.)?(\w+)\s", text) if "Parser" not in n]
    default = ["EnvironmentReward"] if "agent:" in text else ["RuleReward"]  # an agent's: its environment's
    if hasattr(cli.model, "reward_functions"):  # an RL stage
        assert [type(fn).__name__ for fn in cli.model.reward_functions] == (names or default)
    assert not strategy._engine_started


def test_cli_overrides_reach_the_config(tmp_path):
    code, out = yatt_in_process(
        ["fit", "--config", TINY, "--trainer.max_steps", "7", "--model.algorithm.clip_eps", "0.3", "--print_config"],
        cwd=tmp_path,
    )
    assert code == 0 and "max_steps: 7" in out and "clip_eps: 0.3" in out


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (["--model.no_such_key", "1"], "no_such_key"),
        (["--trainer.max_steps", "many"], "max_steps"),
        (["--model.sampling.n", "0"], "`model.sampling.n` must be >= 1"),
        (["--model.policy.path", "/no/such/model"], "model folder '/no/such/model' does not exist"),
        (["--trainer.strategy.tensor_model_parallel_size", "3"], "=3 does not divide the model's 4 attention heads"),
        (["--trainer.strategy.pipeline_model_parallel_size", "4"], "=4 does not divide the model's 2 layers"),
        (["--trainer.strategy.tensor_model_parallel_size", "2"], "= 2 does not divide the 1 processes"),
        (
            [
                "--trainer.devices",
                "2",
                "--trainer.strategy.tensor_model_parallel_size",
                "2",
                "--trainer.strategy.controller",
                "yatt_lightning.rollout.controller.SingleController",
            ],
            "SingleController supports data parallelism only",
        ),  # fmt: skip
    ],
)
def test_bad_config_is_reported_with_the_key(override, expected, tmp_path):
    code, out = yatt_in_process(["fit", "--config", TINY, *override], cwd=tmp_path)
    assert code == 2, out
    assert expected in out
    assert len(out.strip().splitlines()) <= 10, out


def _final_weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt_dir.parent / "flat.pt"
    dcp_to_torch_save(str(ckpt_dir / "weights"), str(out))
    return torch.load(out, weights_only=False)


THIRD_PARTY = re.compile(r"warn|WARNING|\(MainProcess|NUMA|Apex|Triton|LD_PRELOAD|Tip:|set_vital|it/s|Loading|Epoch|v_num", re.I)


@pytest.mark.slow
def test_fit_trains_logs_and_checkpoints(tmp_path, tiny_model_path):
    """A first run as a user sees it: yatt's own lines, the progress lines and a summary on the terminal (no
    third-party line, Lightning's validation notice included), the libraries' chatter in the run's output.log,
    and everything under `--trainer.default_root_dir`. Without OMP_NUM_THREADS, one process takes every core."""
    import os

    root = tmp_path / "elsewhere"
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "yatt_lightning.run.cli", "fit", "--config", TINY, "--trainer.max_steps", "4",
         "--trainer.enable_checkpointing", "true", "--trainer.callbacks+=ModelCheckpoint",
         "--trainer.callbacks.every_n_train_steps", "2", "--trainer.default_root_dir", str(root)],
        cwd=tmp_path, timeout=600, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = (proc.stderr + proc.stdout).splitlines()
    assert [line for line in lines if THIRD_PARTY.search(line)] == []
    assert [line for line in lines if not line.startswith(("[yatt", "       "))] == [], "a line not yatt's"
    cores = len(os.sched_getaffinity(0))
    plural = "s" if cores > 1 else ""
    assert f"[yatt INFO] rank 0: {cores} torch thread{plural} ({cores} cores / 1 process on this node)" in lines
    before_bar = next(i for i, line in enumerate(lines) if line.startswith("[yatt] step "))
    assert before_bar <= 15, lines[:before_bar]
    assert "[yatt] step 4/4  reward " in proc.stdout + proc.stderr
    summary = proc.stderr[proc.stderr.index("[yatt] done: 4 steps") :]
    for part in ("mean reward:", f"tensorboard --logdir {root / 'grpo_tiny'}", f"checkpoints: {root / 'grpo_tiny' / 'checkpoints'}",
                 "--trainer.max_steps 4", "--ckpt_path last", f"yatt export --ckpt_dir {root / 'grpo_tiny' / 'checkpoints'}"):  # fmt: skip
        assert part in summary, (part, summary)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere"], "the run wrote outside default_root_dir"
    log_dir = root / "grpo_tiny"
    version = log_dir / "version_0"
    assert "LD_PRELOAD" in (version / "output.log").read_text()  # vLLM's advice, kept in the run's log
    assert (version / "config.yaml").is_file()
    scalars = read_scalars(log_dir)
    for tag in ("reward/mean", "reward/std", "actor/pg_loss", "actor/kl", "actor/clip_fraction", "actor/entropy",
                "response_length/mean", "perf/rollout_tokens_per_s", "time/rollout", "time/reward", "time/train",
                "time/sync", "rollout/logprob_diff_max"):  # fmt: skip
        assert tag in scalars, f"{tag} missing from TensorBoard; have {sorted(scalars)}"
    assert [s for s, _ in scalars["reward/mean"]] == [0, 1, 2, 3]
    assert all(v > 0 for _, v in scalars["time/train"])
    assert max(v for _, v in scalars["rollout/logprob_diff_max"]) < 1e-3
    texts = read_texts(log_dir)["rollout/samples/text_summary"]
    assert texts and "| after " in texts[0]

    # Lightning's ModelCheckpoint (synchronous, through the strategy) and AsyncCheckpoint (at the end)
    # write the same self-contained, verified format.
    from yatt_lightning.checkpoint import folder as yckpt

    ckpts = sorted(log_dir.rglob("*.ckpt"))
    assert ckpts, "no checkpoint written"
    assert yckpt.verify(ckpts[-1]) == []
    assert yckpt.tracked(log_dir / "checkpoints").name == "step-00000004"
    ckpt = yckpt.tracked(log_dir / "checkpoints")
    assert (ckpt / "trainer_rank0.pt").is_file() and (ckpt / "hf" / "config.json").is_file()
    assert not list(log_dir.rglob("*.tmp")), "a temporary checkpoint folder was left behind"
    state = torch.load(ckpt / "trainer_rank0.pt", weights_only=False)
    assert state["global_step"] == 4

    from safetensors.torch import load_file

    initial = load_file(str(tiny_model_path / "model.safetensors"))
    final = _final_weights(ckpt)
    before = initial["model.layers.0.mlp.down_proj.weight"]
    after = final["model.decoder.layers.mlp.linear_fc2.weight"][0]  # Megatron stacks layers in checkpoints
    assert after.shape == before.shape
    assert not torch.equal(after, before), "training did not change the weights"


@pytest.mark.slow
def test_a_users_estimator_reward_prompts_and_model_folder_train_without_editing_the_package(tmp_path, tiny_model_path):
    """A subclass of AdvantageEstimator in the user's own file (the working directory, no PYTHONPATH),
    selected by its class_path in the user's YAML with its own argument, computes every step's advantages
    and the policy trains on them; in the same run the user's own HF folder (--model.policy.path), jsonl
    prompts with a field of their own (--data.path) and reward function from a module in the working directory
    (--model.reward_fn), which receives that field. One with an estimator's name already taken is refused
    naming both. (A reward function that raises: tests/test_bad_input.py::test_reward_error_at_run_time.)"""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"after {c} comes", "target": c}) + "\n" for c in "abcdefghijklmnop"))
    (tmp_path / "my_reward.py").write_text(
        "def score(prompt: str, completion: str, **row) -> float:\n"
        "    assert 'target' in row, row\n"
        "    return float(len(completion) % 2)\n"
    )
    (tmp_path / "my_algos.py").write_text(
        textwrap.dedent(
            """
            import torch
            from yatt_lightning.algorithms import AdvantageEstimator, Advantages

            class Centred(AdvantageEstimator):
                group_baseline = True

                def __init__(self, scale: float = 1.0) -> None:
                    self.scale = scale

                def __call__(self, inputs):
                    r = inputs.rewards
                    means = torch.stack([r[inputs.group_ids == g].mean() for g in inputs.group_ids])
                    with open("calls.txt", "a") as f:
                        f.write(f"{len(r)} {self.scale}\\n")
                    return Advantages(self.scale * (r - means))
            """
        )
    )
    (tmp_path / "my_clash.py").write_text(
        "from yatt_lightning.algorithms import AdvantageEstimator\n\n"
        "class RLOOAdvantage(AdvantageEstimator):  # the library has one\n"
        "    def __call__(self, inputs):\n        raise AssertionError('never selected')\n"
    )
    (tmp_path / "mine.yaml").write_text(
        textwrap.dedent(
            """
            model:
              init_args:
                advantage_estimator:
                  class_path: my_algos.Centred
                  init_args:
                    scale: 2.0
            """
        )
    )
    common = ["fit", "--config", TINY, "--trainer.max_steps", "3", "--trainer.callbacks", "[]",
              "--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(tmp_path / "runs")]  # fmt: skip
    users = ["--model.policy.path", str(tiny_model_path), "--data.path", str(data), "--model.reward_fn", "my_reward.score"]
    yatt([*common, "--config", "mine.yaml", *users], cwd=tmp_path, timeout=600)
    assert (tmp_path / "calls.txt").read_text().splitlines() == ["128 2.0"] * 3  # 16 prompts x 8 samples, 3 steps
    scalars = read_scalars(tmp_path / "runs")
    assert len(scalars["actor/grad_norm"]) == 3 and all(v > 0 for _, v in scalars["actor/grad_norm"])

    code, err = yatt_in_process([*common, "--model.advantage_estimator", "my_clash.RLOOAdvantage"], cwd=tmp_path)
    assert code != 0
    assert ("two advantage estimator classes are named 'RLOOAdvantage': yatt_lightning.algorithms.advantage.RLOOAdvantage "
            "and my_clash.RLOOAdvantage") in err, err[-2000:]  # fmt: skip


@pytest.mark.slow
def test_nan_loss_stops_with_a_clear_error(tmp_path):
    (tmp_path / "nan_module.py").write_text(
        textwrap.dedent(
            """
            import torch
            from yatt_lightning.module import RLHFModule

            class NaNLoss(RLHFModule):
                def loss(self, logprobs, mb):
                    per_token, metrics = super().loss(logprobs, mb)
                    return per_token * torch.nan, metrics
            """
        )
    )
    proc = yatt(
        ["fit", "--config", TINY, "--trainer.max_steps", "2", "--trainer.logger", "false", "--trainer.callbacks", "[]",
         "--trainer.enable_checkpointing", "false", "--model.class_path", "nan_module.NaNLoss"],
        cwd=tmp_path, timeout=600, check=False, env={"PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode != 0
    assert "NonFiniteLossError: the policy loss is NaN/inf at step 0" in proc.stderr
