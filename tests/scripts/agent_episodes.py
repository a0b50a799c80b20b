"""Episodes on a real vLLM engine (the tiny model) whose environment hangs or raises for some rows: with
``on_error: end`` those episodes end (counted) and the others go on; with ``raise`` the run stops naming the
row. (Token exactness and tool overlap: ``bench/agentic.py``, whose smoke size tests/test_benches.py runs.)
Prints one JSON line."""

import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    from yatt_lightning.run.process_exit import collect_once_at_exit

    collect_once_at_exit()  # as `yatt` ends: without the interpreter's whole-heap collections at exit
    from transformers import AutoTokenizer

    from yatt_lightning.agents import Agent, GuessEnvironment, Observation
    from yatt_lightning.agents.environment import Environment, Episode
    from yatt_lightning.engines.base import SamplingConfig
    from yatt_lightning.engines.vllm_engine import VLLMEngine
    from yatt_lightning.models.tiny import build_tiny_qwen2
    from yatt_lightning.rollout.types import RolloutRequest

    class Broken(Environment):
        """The guess game, except that the episodes of secret ``hang_on`` never answer and those of
        ``raise_on`` raise."""

        def __init__(self, hang_on: int, raise_on: int) -> None:
            self.game, self.hang_on, self.raise_on = GuessEnvironment(), hang_on, raise_on

        def reset(self, row, seed) -> Episode:
            inner, hang, fail = self.game.reset(row, seed), row["secret"] == self.hang_on, row["secret"] == self.raise_on

            class Answers(Episode):
                def step(self, text: str) -> Observation:
                    if hang:
                        time.sleep(60)
                    if fail:
                        raise RuntimeError("the environment broke")
                    return inner.step(text)

            return Answers()

    path = build_tiny_qwen2()
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = VLLMEngine()
    engine.start(path, max_num_seqs=32, max_model_len=48, dtype="float32")
    rows = [{"prompt": f"guess 0 to 7 #{k}", "secret": k % 8} for k in range(8)]
    prompts = [tokenizer(r["prompt"]).input_ids for r in rows]

    def run(env, on_error: str):
        agent = Agent(env, max_turns=3, max_tokens_per_turn=2, max_total_tokens=48, step_timeout_s=1.0,
                      on_error=on_error)  # fmt: skip
        agent.configure(tokenizer, chat=False, model_path=path, max_prompt_tokens=16)
        request = RolloutRequest(rows, prompts, list(range(8)), SamplingConfig(n=2), step=0, weights_version=0,
                                 agent=agent)  # fmt: skip
        return dict(agent.episodes(engine, request))

    t0 = time.perf_counter()
    groups = run(Broken(hang_on=3, raise_on=5), "end")
    out = {
        "errors": {str(g): [e.turns.figures["env_errors"] for e in group] for g, group in sorted(groups.items())},
        "wall": time.perf_counter() - t0,
        "finish": {str(g): [e.finish_reason for e in group] for g, group in sorted(groups.items())},
    }
    try:
        run(Broken(hang_on=-1, raise_on=5), "raise")
        out["raised"] = ""
    except RuntimeError as err:
        out["raised"] = str(err)
    engine.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
