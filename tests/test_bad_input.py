"""Tier 1/3: a catalogue of bad inputs through the real CLI, each with its exit code and message.

Configuration errors (exit code 2) are found before any process group or engine starts, so those cases
run through the CLI's entry point in this process and take a second or two each; run-time errors (exit
code 1) start a real run. Every case must end in at most 10 lines that name the key, file or line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import REPO, yatt, yatt_in_process

TINY = str(REPO / "configs" / "grpo_tiny.yaml")
LOOKUP = str(REPO / "configs" / "agent_lookup_tiny.yaml")


@dataclass
class Case:
    args: list[str]
    match: str
    files: dict[str, str | bytes] = field(default_factory=dict)  # written into the working directory first


def _model_copy(tiny: Path, dest: Path, drop: tuple[str, ...] = (), truncate: str | None = None) -> str:
    shutil.copytree(tiny, dest)
    for name in drop:
        (dest / name).unlink()
    if truncate:
        data = (dest / truncate).read_bytes()
        (dest / truncate).write_bytes(data[:50])
    return str(dest)


CONFIG_CASES = {
    # data
    "malformed jsonl line": Case(["--data.path", "p.jsonl"], r"p\.jsonl:2: not valid JSON",
                                 {"p.jsonl": '{"prompt": "a"}\n{"prompt": \n'}),
    "missing prompt field": Case(["--data.path", "p.jsonl"], r"p\.jsonl:1: no 'prompt' field \(fields: text\)",
                                 {"p.jsonl": '{"text": "a"}\n'}),
    "empty prompt": Case(["--data.path", "p.jsonl"], r"p\.jsonl:1: 'prompt' must be a non-empty string",
                         {"p.jsonl": '{"prompt": ""}\n'}),
    "empty file": Case(["--data.path", "p.jsonl"], r"`data.path`: \S*p\.jsonl holds no rows", {"p.jsonl": ""}),
    "not utf-8": Case(["--data.path", "p.jsonl"], r"p\.jsonl:1", {"p.jsonl": b'{"prompt": "\xff\xfe"}\n'}),
    "missing data file": Case(["--data.path", "nope.jsonl"], r"`data.path`: nope\.jsonl does not exist"),
    # (a .json file may hold an array: it is read as a table, datamodules/table_rows.py)
    "a JSON array, not JSON lines": Case(["--data.path", "p.jsonl"], r"p\.jsonl:1: .*one JSON object per line",
                                         {"p.jsonl": '[{"prompt": "a"}]\n'}),
    "read-only root dir": Case(["--trainer.default_root_dir", "/proc/1/runs"],
                               r"`trainer.default_root_dir`: /proc/1/runs cannot be written \(/proc/1 is read-only"),
    "watchdog after the collective's timeout": Case(
        ["--trainer.strategy.watchdog_minutes", "45"],
        r"`trainer.strategy.watchdog_minutes` \(45.0\) must be > 0 and below `timeout_minutes` \(30.0\)"),
    "a placement the layout cannot serve": Case(  # checked with the one layout in preflight, before any process group
        ["--trainer.strategy.placement", "yatt_lightning.placement.Disaggregated"],
        r"`trainer.strategy.placement`: Disaggregated needs at least 2 processes"),
    "a mistyped trainer key": Case(["--trainer.max_stesp", "3"],
                                   r"unknown key `trainer.max_stesp`; did you mean `trainer.max_steps`\?"),
    "a mistyped top-level key": Case(["--seed_everyting", "3"],
                                     r"unknown key `seed_everyting`; did you mean `seed_everything`\?"),
    "a reward deadline of 0": Case(["--model.reward_timeout_s", "0"], r"`model.reward_timeout_s` must be > 0"),
    "fewer rows than a step": Case(["--data.path", "p.jsonl", "--data.batch_size", "4"],
                                   r"has 2 rows, fewer than one step needs .*`data.batch_size`=4",
                                   {"p.jsonl": '{"prompt": "a"}\n{"prompt": "b"}\n'}),
    "prompt too long": Case(["--data.path", "p.jsonl", "--data.batch_size", "1", "--model.max_prompt_tokens", "3"],
                            r"prompt of \d+ tokens \(p\.jsonl:1\) is longer than `model.max_prompt_tokens`=3",
                            {"p.jsonl": json.dumps({"prompt": "after a comes b and then c d e f g"}) + "\n"}),
    "chat row with an image part": Case(
        ["--data.path", "p.jsonl"], r"p\.jsonl:1: a message part must be .*rows with images need",
        {"p.jsonl": json.dumps({"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}]}) + "\n"}),
    "system prompt without a chat template": Case(
        ["--model.system_prompt", "Be brief."], r"`model.system_prompt` is set but \S+ has no chat template"),
    # keys and values
    "wrong type": Case(["--trainer.max_steps", "many"], r"`trainer.max_steps`: Expected a <class 'int'>"),
    "unknown key": Case(["--model.algorithm.clip_epsilon", "0.3"],
                        r"unknown key `model.algorithm.clip_epsilon`.*did you mean `clip_eps`\?"),
    "yaml syntax error": Case(["--config", "bad.yaml"], r"bad\.yaml:2:1: not valid YAML", {"bad.yaml": "trainer: [max_steps: 3\n"}),
    "config file missing": Case(["--config", "nope.yaml"], r"`--config nope\.yaml`: no such file"),
    "clip_eps out of range": Case(["--model.algorithm.clip_eps", "-1"], r"`model.algorithm.clip_eps` must be in \(0, 1\)"),
    "learning rate 0": Case(["--model.optimizer.lr", "0"], r"`model.optimizer.lr` must be > 0, got 0"),
    "max_steps 0": Case(["--trainer.max_steps", "0"], r"`trainer.max_steps` is 0"),
    "group of one with GRPO": Case(["--model.sampling.n", "1"], r"`model.sampling.n`=1 .*GRPOAdvantage.* >= 2"),
    "sequence beyond positions": Case(["--model.sampling.max_new_tokens", "300"],
                                      r"= 316 exceeds the model's 256 positions"),
    # code the config names
    "reward module missing": Case(["--model.reward_fn", "nomod.score"], r"`model.reward_fn`: cannot import module 'nomod'"),
    "reward function missing": Case(["--model.reward_fn", "rw.nope"], r"`model.reward_fn`: module 'rw' has no function 'nope'",
                                    {"rw.py": "def score(prompt, completion, **row):\n    return 1.0\n"}),
    # the model folder
    "missing model folder": Case(["--model.policy.path", "/no/such/model"], r"model folder '/no/such/model' does not exist"),
    # parallel layouts
    "tp does not divide heads": Case(["--trainer.strategy.tensor_model_parallel_size", "3"],
                                     r"=3 does not divide the model's 4 attention heads"),
    "tp does not divide kv heads": Case(["--trainer.devices", "4", "--trainer.strategy.tensor_model_parallel_size", "4"],
                                        r"=4 does not divide the model's 2 key/value heads"),
    "pp does not divide layers": Case(["--trainer.strategy.pipeline_model_parallel_size", "4"],
                                      r"=4 does not divide the model's 2 layers"),
    "tp does not divide processes": Case(["--trainer.strategy.tensor_model_parallel_size", "2"],
                                         r"= 2 does not divide the 1 processes"),
    # agents
    "an environment class that does not exist": Case(
        ["--config", LOOKUP, "--config", "env.yaml"], r"`model.agent.environment`: No module named 'nomod'",
        {"env.yaml": "model:\n  init_args:\n    agent:\n      init_args:\n        environment:\n          class_path: nomod.Env\n"}),
    "a tool whose schema is invalid": Case(
        ["--config", LOOKUP, "--config", "tools.yaml"],
        r"tool mytools\.Broken \(broken\): `parameters` is not a valid JSON schema: 'no-such-type' is not valid",
        {"tools.yaml": "model:\n  init_args:\n    agent:\n      init_args:\n        environment:\n          init_args:\n"
                       "            tools:\n              - class_path: mytools.Broken\n",
         "mytools.py": "from yatt_lightning.agents import Tool\n\nclass Broken(Tool):\n    name = 'broken'\n"
                       "    parameters = {'type': 'object', 'properties': {'x': {'type': 'no-such-type'}}}\n"}),
    "an agent with partial rollouts": Case(
        ["--config", LOOKUP, "--model.init_args.long_tail", "yatt_lightning.rollout.longtail.PartialRollout"],
        r"`model.long_tail: PartialRollout` cannot carry an agent's episodes to the next step yet"),
    "an episode beyond the model's positions": Case(
        ["--config", LOOKUP, "--model.init_args.agent.init_args.max_total_tokens", "300"],
        r"`model.agent.max_total_tokens`=300 is more than the policy's 256 positions; set it to at most 256"),
}  # fmt: skip


def _run_case(case: Case, cwd: Path, extra: list[str] = ()) -> tuple[int, str]:
    for name, content in case.files.items():
        (cwd / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    args = case.args if case.args[:1] == ["--config"] else ["--config", TINY, *case.args]
    return yatt_in_process(["fit", *args, *extra], cwd=cwd)


def _assert_screen(code: int, out: str, expected_code: int, match: str) -> None:
    import re

    assert code == expected_code, out
    assert re.search(match, out, re.S), out
    assert len(out.strip().splitlines()) <= 10, out
    assert "Traceback" not in out, out


@pytest.mark.parametrize("name", CONFIG_CASES)
def test_configuration_error(name, tmp_path):
    code, out = _run_case(CONFIG_CASES[name], tmp_path)
    _assert_screen(code, out, 2, CONFIG_CASES[name].match)


def test_a_reward_the_rows_do_not_fit_is_named_with_the_row_before_any_engine_starts(tmp_path):
    """``def score(prompt, completion, answer)`` and a file whose second row has no ``answer``: the preflight
    names the function, the field and the row's file:line (exit 2) in seconds, where the run would otherwise
    start its engines and fail at the first step (exit 1). The pure cases: tests/test_rewards.py."""
    rows = "".join(json.dumps(row) + "\n" for row in ({"prompt": "a", "answer": "b"}, {"prompt": "c", "text": "d"}))
    reward = "def score(prompt, completion, answer):\n    return 1.0\n"  # a module name no other case imports
    case = Case(["--data.path", "p.jsonl", "--data.batch_size", "1", "--model.reward_fn", "fields_rw.score"], "",
                {"p.jsonl": rows, "fields_rw.py": reward})  # fmt: skip
    t0 = time.monotonic()
    code, out = _run_case(case, tmp_path)
    _assert_screen(code, out, 2, r"p\.jsonl:2: reward function fields_rw\.score\(prompt, completion, answer\) needs the "
                                 r"row field 'answer', which this row lacks \(its fields: text\); add 'answer' to every row")  # fmt: skip
    assert "vLLM engine ready" not in out and time.monotonic() - t0 < 60, out


@pytest.mark.parametrize(
    ("name", "drop", "truncate", "match"),
    [
        ("truncated weights", (), "model.safetensors", r"model\.safetensors is not a readable safetensors file"),
        ("no tokenizer files", ("tokenizer.json", "tokenizer_config.json"), None, r"model[/\w]* has no tokenizer files"),
    ],
)
def test_broken_model_folder(name, drop, truncate, match, tmp_path, tiny_model_path):
    folder = _model_copy(tiny_model_path, tmp_path / "model", drop=drop, truncate=truncate)
    code, out = _run_case(Case(["--model.policy.path", folder], match), tmp_path)
    _assert_screen(code, out, 2, match)


def _checkpoints(root: Path) -> Path:
    """A checkpoint folder as AsyncCheckpoint leaves it: steps 1 and 2 intact, step 3 with a truncated shard."""
    from yatt_lightning.checkpoint import folder as ckpt

    for step in (1, 2, 3):
        folder = root / ckpt.checkpoint_name(step)
        (folder / "weights").mkdir(parents=True)
        (folder / "weights" / "__0_0.distcp").write_bytes(b"x" * 100)
        files = {"weights/__0_0.distcp": ckpt._describe(folder / "weights" / "__0_0.distcp")}
        (folder / ckpt.MANIFEST).write_text(json.dumps({"format": 1, "world_size": 1, "step": step, "files": files}))
    (root / ckpt.TRACKER).write_text(ckpt.checkpoint_name(3))
    (root / "step-00000003" / "weights" / "__0_0.distcp").write_bytes(b"x" * 10)
    return root


def test_bad_checkpoint_arguments(tmp_path):
    """`--ckpt_path` and `yatt export --ckpt_dir` naming nothing, or a truncated checkpoint, before anything starts."""
    ckpts = _checkpoints(tmp_path / "ckpts")
    code, out = _run_case(Case(["--ckpt_path", "nope"], ""), tmp_path)
    _assert_screen(code, out, 2, r"`--ckpt_path`: checkpoint nope is incomplete or corrupted: nope: no such checkpoint folder")
    code, out = _run_case(Case(["--ckpt_path", str(ckpts / "step-00000003")], ""), tmp_path)
    _assert_screen(code, out, 2, r"__0_0\.distcp: 10 bytes, the manifest says 100 \(truncated or overwritten\)")
    code, out = yatt_in_process(["export", "--ckpt_dir", "nope", "--out", "x"], cwd=tmp_path)
    _assert_screen(code, out, 2, r"`--ckpt_dir`: nope does not exist")
    code, out = yatt_in_process(["export", "--ckpt_dir", str(ckpts), "--out", "x"], cwd=tmp_path)
    _assert_screen(code, out, 2, r"cannot export \S+step-00000003: .*truncated.*the newest intact checkpoint is \S+step-00000002")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_accelerator_without_a_gpu_names_the_key_and_the_fix(tmp_path):
    code, out = _run_case(Case(["--trainer.accelerator", "gpu"], ""), tmp_path)
    _assert_screen(code, out, 2, r"`trainer.accelerator`: this machine has no usable GPU .*`--trainer.accelerator cpu`")


def test_a_mistyped_subcommand_gets_the_nearest_one_and_the_list(tmp_path):
    code, out = yatt_in_process(["fti", "--config", "x.yaml"], cwd=tmp_path)
    _assert_screen(code, out, 2, r"unknown subcommand 'fti'; did you mean `yatt fit`\? The subcommands: fit, validate, test, "
                                 r"predict, export\.")  # fmt: skip


@pytest.mark.slow
def test_reward_error_at_run_time(tmp_path):
    """A user's reward returns None at run time: one screen naming the function and the sample, no
    traceback, and no checkpoint. (Every way a reward can fail gives its own message:
    tests/test_rewards.py; they all reach the user by this path.)"""
    (tmp_path / "rw.py").write_text("def score(prompt, completion, **row):\n    return None\n")
    proc = yatt(
        ["fit", "--config", TINY, "--trainer.max_steps", "2", "--model.reward_fn", "rw.score",
         "--trainer.default_root_dir", str(tmp_path / "runs")],
        cwd=tmp_path, timeout=300, check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    errors = [line for line in out.splitlines() if line.startswith("yatt: error:")]
    match = r"reward function rw\.score returned None \(not a finite number\)"
    assert len(errors) == 1 and re.search(match, errors[0]) and "prompt 'after " in errors[0], out
    assert "Traceback" not in out
    assert "full traceback is in" in out
    assert not (tmp_path / "runs" / "grpo_tiny" / "checkpoints" / "step-00000000").exists(), (
        "a run that failed before its first step wrote a checkpoint"
    )


STUCK_REWARD = """
import os, time
def score(prompt, completion, **row):
    if os.path.exists("stuck"):
        if not os.path.exists("entered"):
            open("entered", "w").write(repr(time.time()))
        time.sleep(600)  # a judge's server that never answers
    return 0.5
"""


def _stuck_run(tmp_path: Path, *args: str) -> subprocess.Popen:
    (tmp_path / "rw.py").write_text(STUCK_REWARD)
    cmd = [sys.executable, "-m", "yatt_lightning.run.cli", "fit", "--config", TINY, "--model.reward_fn", "rw.score",
           "--trainer.default_root_dir", str(tmp_path / "runs"), *args]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> float:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.2)
    time.sleep(0.1)
    return float(path.read_text() or time.time())


@pytest.mark.slow
def test_a_reward_that_never_returns_stops_the_run_within_its_deadline_naming_the_function_and_the_row(tmp_path):
    (tmp_path / "stuck").touch()
    proc = _stuck_run(tmp_path, "--trainer.max_steps", "2", "--model.reward_timeout_s", "3")
    entered = _wait_for(tmp_path / "entered", proc)
    out, _ = proc.communicate(timeout=60)
    late = time.time() - entered
    assert proc.returncode == 1, out[-4000:]
    errors = [line for line in out.splitlines() if line.startswith("yatt: error:")]
    assert len(errors) == 1, out[-4000:]
    assert re.search(r"reward function rw\.score did not return within 3 s \(`model\.reward_timeout_s`\) on sample "
                     r"\(AlphabetTask row \d+\) with prompt .after .*raise the deadline, or set `on_error: zero`", errors[0]), errors[0]  # fmt: skip
    assert late < 3 + 20, f"the run stopped {late:.1f} s after the reward got stuck"
    assert "Traceback" not in out


STUCK_ENGINE = """
import threading
from yatt_lightning.engines.vllm_engine import VLLMEngine

class Hung:
    def step(self):
        threading.Event().wait()  # a kernel, or a tensor-parallel peer, that never returns

class StuckEngine(VLLMEngine):
    steps = 0

    def _step(self, engine, what):
        self.steps += 1
        return super()._step(Hung() if self.steps == 20 else engine, what)
"""


@pytest.mark.slow
def test_an_engine_step_that_never_returns_stops_the_run_within_its_deadline_naming_the_key(tmp_path):
    (tmp_path / "eng.py").write_text(STUCK_ENGINE)
    t0 = time.monotonic()
    proc = yatt(
        ["fit", "--config", TINY, "--trainer.max_steps", "50", "--trainer.strategy.engine.class_path", "eng.StuckEngine",
         "--trainer.strategy.engine.step_timeout_s", "3", "--trainer.default_root_dir", str(tmp_path / "runs")],
        cwd=tmp_path, timeout=240, check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert time.monotonic() - t0 < 150
    screen = [line for line in out.splitlines() if "engine deadline:" in line]
    assert len(screen) == 1, out[-3000:]
    assert re.search(r"did not return within 3 s \(`engine.step_timeout_s`\) on rank 0, while generating \d+ of \d+ "
                     r"prompts.*Raise `engine.step_timeout_s`", screen[0]), screen[0]  # fmt: skip
    assert "Traceback" not in out
    log = (tmp_path / "runs" / "grpo_tiny" / "version_0" / "output.log").read_text()
    assert re.search(r'File ".*eng\.py", line \d+ in step', log), log[-3000:]


@pytest.mark.slow
def test_ctrl_c_during_a_stuck_step_stops_once_within_the_grace_period_leaving_latest(tmp_path):
    ckpts = tmp_path / "ckpts"
    saver = [{"class_path": "yatt_lightning.callbacks.AsyncCheckpoint",
              "init_args": {"dirpath": str(ckpts), "every_n_steps": 1, "interrupt_grace_s": 3}}]  # fmt: skip
    proc = _stuck_run(tmp_path, "--trainer.max_steps", "100", "--model.reward_timeout_s", "null",
                      "--trainer.callbacks", json.dumps(saver))  # fmt: skip
    from yatt_lightning.checkpoint import folder as ckpt

    deadline = time.monotonic() + 240
    while not (ckpts.exists() and ckpt.tracked(ckpts) is not None):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    (tmp_path / "stuck").touch()
    _wait_for(tmp_path / "entered", proc)
    latest = ckpt.tracked(ckpts)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)  # once
    out, _ = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 130, out[-4000:]
    assert took < 3 + 15, f"stopped {took:.1f} s after Ctrl-C"
    assert "the step did not finish within 3 s (`interrupt_grace_s`); stopping without saving it" in out
    assert ckpt.tracked(ckpts) == latest and ckpt.verify(latest) == []
    assert "Traceback" not in out and out.count("Ctrl-C: finishing this step") == 1, out[-3000:]


@pytest.mark.slow
def test_a_rank_stuck_in_its_reward_is_named_by_the_watchdog_and_every_rank_exits(tmp_path):
    """Tier 3, 2 processes: rank 1's reward function never returns and has no deadline; rank 0 waits for
    it at the end of scoring. The watchdog's screen names rank 1 and its stage; rank 1's log has its stack."""
    (tmp_path / "rw.py").write_text(
        "import os, time\n"
        "def score(prompt, completion, **row):\n"
        "    if os.environ.get('LOCAL_RANK') == '1':\n"
        "        time.sleep(600)\n"
        "    return 0.5\n"
    )
    t0 = time.monotonic()
    proc = yatt(
        ["fit", "--config", TINY, "--trainer.devices", "2", "--trainer.max_steps", "3", "--model.reward_fn", "rw.score",
         "--model.reward_timeout_s", "null", "--trainer.strategy.watchdog_minutes", "0.05",
         "--trainer.default_root_dir", str(tmp_path / "runs")],
        cwd=tmp_path, timeout=240, check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert time.monotonic() - t0 < 120
    screen = [line for line in out.splitlines() if "watchdog:" in line]
    assert len(screen) == 1 and re.search(r"rank 0 has waited \d+ s at 'scored' of step 0 for its peers: rank 1 is still "
                                          r"at 'reward' of step 0", screen[0]), out[-3000:]  # fmt: skip
    assert "Traceback" not in out and "GLHF" not in out, out[-3000:]
    late = (tmp_path / "runs" / "grpo_tiny" / "version_0" / "output.rank1.log").read_text()
    assert "rank 1 is late" in late and re.search(r"File \".*rw\.py\", line 4 in score", late), late[-3000:]
