"""Do agents learn from their tools, are their trajectories the engine's tokens, and do tool calls hide
behind generation?

One invocation, in order:

* ``agent_gain``: ``yatt fit --config configs/agent_lookup_tiny.yaml`` (the answer is only in the tool's
  store): mean reward over the last 10 steps minus the first 10 (target >= 0.4, and above ``no_tool_gain`` by
  at least 0.3);
* ``no_tool_gain``: the same with ``tools: []`` (switched off): the policy learns to answer a digit, at random,
  so its reward rises from about 0 to chance (0.1) and no further. The gain is not the target; the level is:
  the last 10 steps' mean reward is printed beside chance (target: within 0.05 of 0.1);
* ``token_exact``: episodes of the guessing game on a vLLM engine: 1 when every turn's prompt was the
  episode so far (prompt, the engine's own ids of the earlier turns, the observations' ids) and every
  trajectory is its last turn's prompt and output, with the mask on exactly the sampled tokens;
* ``multiturn_logprob_diff``: ``bench/rollout_consistency.py --multiturn``: the engine's logprobs of the
  episodes' sampled tokens against the Megatron policy's, after training (target < 1e-3), over
  ``multiturn_tokens`` sampled tokens (0 would make the difference 0 and mean nothing);
* ``tool_overlap``: the same episodes with an environment that sleeps S seconds per answer: wall time /
  (the wall time without the sleep + answers x S); 1.0 would be the answers one after the other, with
  nothing else running (target <= 0.5).

    python bench/agentic.py [--smoke] [--steps 200] [--sleep 0.3]

``--smoke``: 0.1 s answers, no learning runs (their gains print nan): ``tests/test_soak.py`` runs the lookup
config's 200 steps with the tool (it must learn, and nothing may grow); the run without the tool left the suite
for its time. Measured when it was there (deterministic runs of 2026-12-06): with the tool the policy must
learn to call it and then to copy the digit it returned, which starts to pay after about 80 steps: gains with /
without the tool 0.109 / 0.097 at 60 steps, 0.124 / 0.103 at 80, 0.157 / 0.090 at 90, 0.182 / 0.067 at 100,
0.249 / 0.111 at 120; a learning rate of 2e-3 or 3e-3 instead of 1e-3 was no faster, and unstable.

Last line: ``agent_gain=X no_tool_gain=Y token_exact=1 multiturn_logprob_diff=Z tool_overlap=W multiturn_tokens=N``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOOKUP = str(REPO / "configs" / "agent_lookup_tiny.yaml")
CHANCE = 0.1  # the lookup task's answer is one digit in ten


def _gain(folder: Path, steps: int, extra: list[str]) -> tuple[float, float]:
    """(first-10, last-10) mean reward of a ``yatt fit`` of the lookup config (fewer steps: halves)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cmd = [sys.executable, "-m", "yatt_lightning.run.cli", "fit", "--config", LOOKUP, "--trainer.max_steps",
           str(steps), "--trainer.default_root_dir", str(folder), "--trainer.callbacks", "[]", *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=folder)
    if proc.returncode != 0:
        raise SystemExit(f"yatt fit failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    events = sorted(folder.rglob("events.out.tfevents.*"))[-1]
    acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
    acc.Reload()
    rewards = [e.value for e in acc.Scalars("reward/mean")]
    k = min(10, len(rewards) // 2)
    return statistics.mean(rewards[:k]), statistics.mean(rewards[-k:])


def _episodes(sleep_s: float, turns: int) -> dict:
    """Episodes of the guessing game on the tiny model's engine: token exactness, and wall times with and
    without an environment that sleeps ``sleep_s`` per answer."""
    from transformers import AutoTokenizer

    from yatt_lightning.agents import Agent, GuessEnvironment, Observation
    from yatt_lightning.agents.environment import Environment, Episode
    from yatt_lightning.engines.base import SamplingConfig
    from yatt_lightning.engines.vllm_engine import VLLMEngine
    from yatt_lightning.models.tiny import build_tiny_qwen2
    from yatt_lightning.rollout.types import RolloutRequest

    class Sleepy(Environment):
        def __init__(self, sleep_s: float) -> None:
            self.game, self.sleep_s = GuessEnvironment(), sleep_s

        def reset(self, row, seed) -> Episode:
            inner, sleep = self.game.reset(row, seed), self.sleep_s

            class Slow(Episode):
                def step(self, text: str) -> Observation:
                    time.sleep(sleep)  # a tool that takes its time
                    return inner.step(text)

            return Slow()

    path = build_tiny_qwen2()
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = VLLMEngine()
    engine.start(path, max_num_seqs=64, max_model_len=64, dtype="float32")
    given: dict[str, list] = {}  # episode -> [prompt ids, output ids, logprobs] per turn
    add, step = engine.add_turn, engine.step_turns

    def add_turn(key, prompt, sampling, seed, max_tokens):
        given.setdefault(key, []).append([list(prompt), [], []])
        add(key, prompt, sampling, seed, max_tokens)

    def step_turns():
        done = step()
        for key, completion in done:
            given[key][-1][1:] = [completion.token_ids, completion.logprobs]
        return done

    engine.add_turn, engine.step_turns = add_turn, step_turns
    rows = [{"prompt": f"guess 0 to 7 #{k}", "secret": k % 8} for k in range(16)]
    prompts = [tokenizer(r["prompt"]).input_ids for r in rows]

    def run(env) -> tuple[dict, float]:
        given.clear()
        agent = Agent(env, max_turns=turns, max_tokens_per_turn=2, max_total_tokens=64)
        agent.configure(tokenizer, chat=False, model_path=path, max_prompt_tokens=16)
        request = RolloutRequest(rows, prompts, list(range(len(rows))), SamplingConfig(n=4), step=0,
                                 weights_version=0, agent=agent)  # fmt: skip
        t0 = time.perf_counter()
        groups = dict(agent.episodes(engine, request))
        return groups, time.perf_counter() - t0

    run(Sleepy(0.0))  # warm-up
    groups, bare = run(Sleepy(0.0))
    exact = True
    for g, group in groups.items():
        for j, episode in enumerate(group):
            history, prompt = given[f"{g}.{j}"], prompts[g]
            exact &= history[0][0] == prompt
            exact &= all(nxt[: len(p) + len(o)] == p + o for (p, o, _), (nxt, _, _) in zip(history, history[1:], strict=False))
            exact &= prompt + episode.token_ids == history[-1][0] + history[-1][1]
            sampled = [t for t, m in zip(episode.token_ids, episode.turns.mask, strict=True) if m]
            exact &= sampled == [t for _, o, _ in history for t in o]
            exact &= [lp for lp, m in zip(episode.logprobs, episode.turns.mask, strict=True) if m] == [
                lp for _, _, lps in history for lp in lps
            ]
    groups, slept = run(Sleepy(sleep_s))
    answers = sum(e.turns.figures["turns"] for group in groups.values() for e in group)
    engine.shutdown()
    return {"token_exact": int(exact), "tool_overlap": slept / (bare + answers * sleep_s), "bare_s": bare,
            "slept_s": slept, "answers": answers}  # fmt: skip


def main() -> None:
    if sys.argv[1:2] == ["--episodes"]:  # the engine part, in a process of its own
        print(json.dumps(_episodes(float(sys.argv[2]), int(sys.argv[3]))))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sleep", type=float, default=0.3, help="seconds each answer of the slow environment takes")
    p.add_argument("--smoke", action="store_true", help="0.1 s answers, no learning runs (their gains print nan)")
    args = p.parse_args()
    if args.smoke:
        args.sleep = 0.1
    run = [sys.executable, __file__, "--episodes", str(args.sleep), "4"]
    episodes = json.loads(subprocess.run(run, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    consistency = subprocess.run(
        [sys.executable, str(REPO / "bench" / "rollout_consistency.py"), "--multiturn", *(["--smoke"] if args.smoke else [])],
        capture_output=True, text=True, check=True, cwd=REPO,
    ).stdout  # fmt: skip
    diff = float(re.search(r"multiturn_logprob_diff=(\S+)", consistency).group(1))
    tokens = int(re.search(r"sampled tokens compared: (\d+)", consistency).group(1))
    gain = off_gain = math.nan  # the smoke size skips the learning runs (tests/test_soak.py runs them)
    if not args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "on").mkdir()
            (Path(tmp) / "off").mkdir()
            on = _gain(Path(tmp) / "on", args.steps, [])
            off = _gain(Path(tmp) / "off", args.steps, ["--model.init_args.agent.init_args.environment.init_args.tools", "[]"])
        for name, (first, last) in (("with the tool", on), ("tools off", off)):
            print(f"{name}: mean reward {first:.3f} over the first steps -> {last:.3f} over the last ({args.steps} steps)")
        print(f"tools off, the last steps against chance ({CHANCE}): {off[1]:.3f}, {abs(off[1] - CHANCE):.3f} away "
              f"(target: within 0.05; a policy that found the answer without the tool would be far above)")  # fmt: skip
        gain, off_gain = on[1] - on[0], off[1] - off[0]
    print(f"episodes: {episodes['answers']:.0f} answers; {episodes['bare_s']:.2f} s without sleeping, "
          f"{episodes['slept_s']:.2f} s with {args.sleep} s per answer")  # fmt: skip
    print(
        f"agent_gain={gain:.3f} no_tool_gain={off_gain:.3f} token_exact={episodes['token_exact']} "
        f"multiturn_logprob_diff={diff:.3e} tool_overlap={episodes['tool_overlap']:.3f} multiturn_tokens={tokens}"
    )


if __name__ == "__main__":
    main()
