"""Agents without an engine: call formats, tools, the tool environment's errors, the sandbox, the tokens
between turns, the built-in games, and the training mask and turn rewards of an episode."""

from __future__ import annotations

import http.server
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import run_script
from yatt_lightning.agents import (
    Calculator,
    EnvironmentReward,
    GuessEnvironment,
    HermesCalls,
    Lookup,
    Observation,
    Python,
    RegexCalls,
    Tool,
    ToolEnvironment,
    ToolError,
)
from yatt_lightning.agents.turn_tokens import TurnTokens


# ------------------------------------------------------------------------------------------ call formats
def test_hermes_calls_read_json_calls_and_report_what_cannot_be_read():
    fmt = HermesCalls()
    calls = fmt.parse(
        'think <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"q\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
    )
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("calculator", {"expression": "2+3"}, True),
        ("lookup", {"key": "q"}, True),
    ]
    assert "not valid JSON" in calls[2].error and '"name"' in calls[3].error
    assert fmt.parse("the answer is 5") == []
    assert fmt.render(["5"]) == "<tool_response>\n5\n</tool_response>"


def test_regex_calls_fill_one_argument_and_refuse_a_pattern_without_one_group():
    fmt = RegexCalls(r"^\s*([a-z])", "lookup", "key", prefix=" =")
    assert fmt.parse(" q r")[0].arguments == {"key": "q"}
    assert fmt.parse("7") == []
    with pytest.raises(ValueError, match="exactly one group"):
        RegexCalls(r"[a-z]", "lookup", "key")


# ------------------------------------------------------------------------------------------ tools
def test_calculator_evaluates_arithmetic_only():
    calc = Calculator()
    assert calc.run({"expression": "(3 + 4) * 2"}, {}, 1.0) == "14"
    assert calc.run({"expression": "7 / 2"}, {}, 1.0) == "3.5"
    for bad in ("__import__('os')", "2 ** 100000", "1 / 0", "x + 1"):
        with pytest.raises(ToolError):
            calc.run({"expression": bad}, {}, 1.0)


def test_a_tool_with_an_invalid_schema_is_refused_at_construction_naming_it():
    class Broken(Tool):
        name = "broken"
        parameters = {"type": "object", "properties": {"x": {"type": "no-such-type"}}}

    with pytest.raises(ValueError, match=r"Broken \(broken\): `parameters` is not a valid JSON schema"):
        Broken()


class _Raises(Tool):
    name = "crash"
    parameters = {"type": "object", "properties": {}}

    def run(self, arguments, row, timeout_s):
        raise RuntimeError("boom")


class _Hangs(Tool):
    name = "hang"
    parameters = {"type": "object", "properties": {}}

    def run(self, arguments, row, timeout_s):
        time.sleep(30)


def _call(name: str, arguments: str = "{}") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def test_failed_calls_become_error_observations_and_are_counted_and_the_episode_goes_on():
    env = ToolEnvironment([Lookup(), _Raises(), _Hangs(timeout_s=0.3)])
    episode = env.reset({"prompt": "key q", "store": {"q": "7"}}, seed=0)
    ok = episode.step(_call("lookup", '{"key": "q"}'))
    assert (ok.text, ok.done, ok.figures["tool_calls"], ok.figures["tool_errors"]) == (
        "<tool_response>\n7\n</tool_response>", False, 1.0, 0.0,
    )  # fmt: skip
    cases = {
        "<tool_call>{oops</tool_call>": "not valid JSON",
        _call("search"): "no tool named 'search'",
        _call("lookup", '{"k": "q"}'): "bad arguments for lookup: 'key' is a required property",
        _call("lookup", '{"key": "z"}'): "no key 'z'",
        _call("crash"): "RuntimeError: boom",
    }
    for text, message in cases.items():
        obs = episode.step(text)
        assert message in obs.text and obs.text.startswith("<tool_response>\nerror: ") and not obs.done
        assert obs.figures["tool_errors"] == 1.0
    t0 = time.monotonic()
    hung = episode.step(_call("hang"))
    assert "hang did not return within 0.3 s" in hung.text and time.monotonic() - t0 < 5
    final = episode.step("the answer is 7")
    assert final.done and final.reward is None


def test_on_tool_error_raise_stops_instead_and_tools_off_answers_every_call_with_an_error():
    with pytest.raises(RuntimeError, match="boom"):
        ToolEnvironment([_Raises()], on_tool_error="raise").reset({}, 0).step(_call("crash"))
    off = ToolEnvironment([], call_format=RegexCalls(r"^\s*([a-z])", "lookup", "key"))
    obs = off.reset({"store": {"q": "7"}}, 0).step("q")
    assert "no tool named 'lookup'" in obs.text and obs.figures["tool_errors"] == 1.0


def test_the_lookup_task_scores_the_final_answer_through_the_environment():
    env = ToolEnvironment(
        [Lookup()], call_format=RegexCalls(r"^\s*([a-z])", "lookup", "key", " ="),
        score="yatt_lightning.agents.lookup_score",
    )  # fmt: skip
    row = {"prompt": "key q", "store": {"q": "7"}, "answer": "7"}
    episode = env.reset(row, 0)
    assert episode.step(" q").text == " =7"
    assert episode.step(" 7").reward == 1.0
    assert env.reset(row, 0).step("3").reward == 0.0


def test_the_guess_game_answers_higher_lower_and_rewards_fewer_turns():
    game = GuessEnvironment(penalty=0.2)
    episode = game.reset({"prompt": "guess 0 to 7", "secret": 5}, 0)
    assert [episode.step(t).text for t in ("3", "x", "6")] == [" +", " ?", " -"]
    last = episode.step("5")
    assert last.done and last.reward == pytest.approx(0.4)


# ------------------------------------------------------------------------------------------ the sandbox
class _Quiet(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"reached")

    def log_message(self, *args):
        pass


def test_the_python_sandbox_runs_code_and_fences_files_network_and_time(tmp_path: Path):
    py = Python(timeout_s=3.0)
    assert py.run({"code": "print(6 * 7)"}, {}, 3.0) == "42\n"
    assert py.run({"code": "open('mine.txt', 'w').write('ok'); print(open('mine.txt').read())"}, {}, 3.0) == "ok\n"
    outside = tmp_path / "escape.txt"
    out = py.run({"code": f"open({str(outside)!r}, 'w').write('x')"}, {}, 3.0)
    assert "PermissionError" in out and "[exit code 1]" in out and not outside.exists()
    server = http.server.HTTPServer(("127.0.0.1", 0), _Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{server.server_port}').read())"
        out = py.run({"code": code}, {}, 3.0)
        assert "reached" not in out and "[exit code 1]" in out
    finally:
        server.shutdown()
    out = py.run({"code": "import subprocess; subprocess.run(['true'])"}, {}, 3.0)
    assert "PermissionError" in out
    cut = Python(max_output_chars=50).run({"code": "print('y' * 500 + 'z')"}, {}, 3.0)
    assert cut == "y" * 25 + "\n[452 characters cut]\n" + "y" * 23 + "z\n"
    t0 = time.monotonic()
    with pytest.raises(ToolError, match="did not finish within 1 s"):
        py.run({"code": "while True: pass"}, {}, 1.0)
    assert time.monotonic() - t0 < 4


# ------------------------------------------------------------------------------------------ tokens between turns
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from transformers import AutoTokenizer

    from yatt_lightning.models.tiny import build_tiny_qwen2

    return AutoTokenizer.from_pretrained(build_tiny_qwen2())


def test_observations_between_turns_hold_the_templates_tokens_and_are_tokenized_once(tiny_tokenizer):
    tok = tiny_tokenizer
    tok.chat_template = CHATML
    try:
        turns = TurnTokens(tok, chat=True)
        end = tok("<|im_end|>", add_special_tokens=False)["input_ids"]
        assert turns.close_ids == end + tok("\n", add_special_tokens=False)["input_ids"]
        prompt = tok.apply_chat_template([{"role": "user", "content": "key q"}], add_generation_prompt=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        turn1 = tok("q", add_special_tokens=False)["input_ids"]  # the model did not close its turn
        between = turns.between(turn1, Observation("=7"))
        turn2 = tok("7", add_special_tokens=False)["input_ids"] + end  # this one it closed itself
        ids = prompt + turn1 + between + turn2
        text = tok.decode(ids)
        conversation = [
            {"role": "user", "content": "key q"}, {"role": "assistant", "content": "q"},
            {"role": "tool", "content": "=7"}, {"role": "assistant", "content": "7"},
        ]  # fmt: skip
        assert text == tok.apply_chat_template(conversation, tokenize=False).removesuffix("\n")
        assert ids[: len(prompt) + len(turn1)] == prompt + turn1  # the sampled ids stay as they are
    finally:
        tok.chat_template = None
    plain = TurnTokens(tok, chat=True)  # no template: the observation's text as it is
    assert plain.between([5], Observation(" =7")) == tok(" =7", add_special_tokens=False)["input_ids"]
    assert plain.between([5], Observation(token_ids=[9, 9])) == [9, 9]


# ------------------------------------------------------------------------------------------ training on episodes
def test_the_loss_skips_observation_tokens_and_turn_rewards_land_on_their_turns_last_token():
    from yatt_lightning.engines.base import Completion, Turns
    from yatt_lightning.rollout.batch import RolloutBatch
    from yatt_lightning.training.batch import TrainingBatch

    class Tok:
        def batch_decode(self, ids, skip_special_tokens=True):
            return [" ".join(map(str, x)) for x in ids]

    episode = Completion([5, 6, 7, 8, 9, 10], [-0.5, -0.6, 0.0, 0.0, -0.9, -1.0], "stop",
                         turns=Turns([1, 1, 0, 0, 1, 1], ends=[1, 5], rewards=[0.25, 1.0]))  # fmt: skip
    batch = RolloutBatch.from_samples([(0, {"prompt": "p"}, [1, 2, 3], episode)], Tok())
    tokens = EnvironmentReward().rollout_scores(batch)
    assert tokens.token_rewards == [[0.0, 0.25, 0.0, 0.0, 0.0, 1.0]]
    assert tokens.metrics == {"reward/environment/sum": 1.25}
    (mb,) = TrainingBatch.of(batch).microbatches([0], micro_batch_size=4, pad_id=0)
    # position t predicts token t + 1: the completion starts at position 2 (after the 3 prompt tokens)
    assert mb.loss_mask[0, :8].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert mb.completion_mask[0, :8].tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    values = torch.arange(mb.loss_mask.shape[1], dtype=torch.float).unsqueeze(0)
    assert TrainingBatch.unpack_per_token(mb, values)[0].tolist() == [2, 3, 4, 5, 6, 7]  # every completion token


# ------------------------------------------------------------------------------------------ on a real engine
def test_on_a_real_engine_a_hanging_or_raising_environment_ends_its_episodes_or_stops_the_run_naming_the_row():
    out = run_script("agent_episodes.py", timeout=300)
    # on_error: end: the hanging episodes end at their 1 s deadline, the raising ones at once, both counted
    # and cut short; the other rows' episodes run to their end
    assert out["errors"] == {str(g): [1.0, 1.0] if g in (3, 5) else [0.0, 0.0] for g in range(8)}
    assert out["finish"]["3"] == out["finish"]["5"] == ["length", "length"] and out["wall"] < 10
    # on_error: raise: the run stops naming the environment's error and the row
    assert "raised RuntimeError: the environment broke on the row {'prompt': 'guess 0 to 7 #5'" in out["raised"]


# ------------------------------------------------------------------------------------------ through yatt fit
@pytest.mark.slow
def test_deterministic_agent_runs_resume_bitwise_and_tp2_and_dp2_episodes_match_one_process(tmp_path):
    """The lookup config with ``deterministic: true`` and a checkpoint every 2 steps. SIGKILL as step 4 starts,
    then ``--ckpt_path last``: every step's episodes and rewards and the final weights equal those of a run
    never interrupted. TP=2 (one engine over two ranks) samples the same episodes as the one process; so
    does DP=2 (each rank half the rows: each of rank 0's episodes is one of the one process's, prompt and
    all)."""
    import json
    import signal
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.helpers import REPO

    script = REPO / "tests" / "scripts" / "async_fit.py"
    saver = lambda out: json.dumps([{"class_path": "yatt_lightning.callbacks.AsyncCheckpoint",  # noqa: E731
                                     "init_args": {"every_n_steps": 2, "dirpath": str(out / "ckpts")}}])  # fmt: skip
    common = ["--base", str(REPO / "configs" / "agent_lookup_tiny.yaml"), "--trainer.max_steps=6",
              "--model.init_args.agent.init_args.deterministic=true"]  # fmt: skip

    def fit(out, *args, batch=8):
        return subprocess.run(
            [sys.executable, str(script), str(out), *common, f"--data.init_args.batch_size={batch}",
             "--trainer.callbacks", saver(out), *args],
            cwd=REPO, capture_output=True, text=True, timeout=300, start_new_session=True,
        )  # fmt: skip

    def records(out):
        rows = [json.loads(line) for line in (out / "record.jsonl").read_text().splitlines()]
        return {row["step"]: row for row in rows}

    whole, cut, tp, dp = (tmp_path / name for name in ("whole", "cut", "tp", "dp"))
    assert fit(whole).returncode == 0
    killed = fit(cut, "--kill", "sigkill:4")
    assert killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), killed.stderr[-3000:]
    resumed = fit(cut, "--ckpt_path", "last")
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout + resumed.stderr, resumed.stderr[-3000:]
    a, b = records(whole), records(cut)
    assert sorted(a) == sorted(b) == list(range(6))
    for step in a:
        assert a[step]["completions"] == b[step]["completions"], f"step {step}: different episodes"
        assert a[step]["rewards"] == b[step]["rewards"], f"step {step}: different rewards"
    assert max(len(c) for c in a[0]["completions"]) > 3, "episodes of more than one turn"
    wa, wb = load_file(whole / "weights.safetensors"), load_file(cut / "weights.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "the resumed run's final weights differ"

    two = ["--trainer.devices=2", "--trainer.enable_checkpointing=false", "--trainer.max_steps=3"]  # 3 steps suffice
    assert fit(tp, *two, "--trainer.strategy.init_args.tensor_model_parallel_size=2").returncode == 0
    assert fit(dp, *two, batch=4).returncode == 0
    t, d = records(tp), records(dp)
    assert sorted(t) == sorted(d) == [0, 1, 2]
    for step in t:
        assert t[step]["completions"] == a[step]["completions"], f"TP=2, step {step}: other episodes"
        pairs = [p + [-1] + c for p, c in zip(a[step]["prompts"], a[step]["completions"], strict=True)]
        mine = [p + [-1] + c for p, c in zip(d[step]["prompts"], d[step]["completions"], strict=True)]
        assert len(mine) == 32 and all(m in pairs for m in mine), f"DP=2, step {step}: episodes one process never had"


def test_the_prompt_describes_the_tools_through_the_chat_template(tiny_tokenizer):
    from yatt_lightning.chat import PromptFormat

    template = "{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function.name') | join(', ') }}" \
               "<|im_end|>\n{% endif %}" + CHATML  # fmt: skip
    env = ToolEnvironment([Calculator(), Lookup()])
    fmt = PromptFormat(tiny_tokenizer, template, tools=env.tool_schemas())
    text = tiny_tokenizer.decode(fmt.ids({"prompt": "what is 2+3?"}))
    assert text.startswith("<|im_start|>system\nTools: calculator, lookup<|im_end|>\n<|im_start|>user\nwhat is 2+3?")
    assert env.tool_schemas()[0]["function"]["parameters"]["required"] == ["expression"]


def test_a_users_own_tool_in_their_own_file_is_selected_from_yaml(tmp_path, monkeypatch):
    """The README's example: ``my_tools.Weather`` in the working directory, named in the config."""
    from tests.helpers import REPO
    from yatt_lightning.run.cli import YattCLI

    (tmp_path / "my_tools.py").write_text(
        "from yatt_lightning.agents import Tool, ToolError\n\n"
        "class Weather(Tool):\n"
        "    name = 'weather'\n"
        "    parameters = {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}\n\n"
        "    def run(self, arguments, row, timeout_s):\n"
        "        if arguments['city'] not in row['forecast']:\n"
        "            raise ToolError(f\"no forecast for {arguments['city']}\")\n"
        "        return row['forecast'][arguments['city']]\n"
    )
    (tmp_path / "tools.yaml").write_text(
        "model:\n  init_args:\n    agent:\n      init_args:\n        environment:\n          init_args:\n"
        "            tools:\n              - class_path: my_tools.Weather\n            call_format: null\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cli = YattCLI(args=["--config", str(REPO / "configs" / "agent_lookup_tiny.yaml"), "--config", "tools.yaml"], run=False)
    env = cli.model.agent.environment
    episode = env.reset({"forecast": {"Paris": "rain"}}, 0)
    assert episode.step(_call("weather", '{"city": "Paris"}')).text == "<tool_response>\nrain\n</tool_response>"
    assert "no forecast for Rome" in episode.step(_call("weather", '{"city": "Rome"}')).text


def test_an_agent_on_the_openai_client_makes_token_exact_episodes_through_the_endpoint():
    """The real ``openai`` client against the endpoint, with and without a chat template (whose tokens come
    between the turns): every turn's prompt is the episode so far, the trajectory is its last turn's prompt
    and output, the first prompt is the first request rendered once, and a request that rewrites the
    conversation is refused (409) and counted."""
    out = run_script("agent_endpoint.py", timeout=300)
    for mode in ("plain", "chat"):
        got = out[mode]
        assert got["exact"] and got["first_rendered"], (mode, got)
        assert got["turns"] == {"0": [2.0, 2.0], "1": [1.0, 1.0]}, (mode, got)  # row 1 rewrote its history
        assert got["rewards"]["1"] == [[-409.0], [-409.0]] and got["errors"] == {"0": [0.0, 0.0], "1": [1.0, 1.0]}
    assert "<|im_end|>\n<|im_start|>user\n= 7<|im_end|>\n<|im_start|>assistant\n" in out["chat"]["text"]
