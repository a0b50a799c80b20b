"""An agent written against the OpenAI API (the real ``openai`` client) drives episodes on a vLLM engine (the
tiny model) through the endpoint; with and without a chat template. Prints one JSON line."""

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def agent(row: dict, base_url: str, api_key: str) -> float | None:
    """Two requests: the question, then a tool's result as the next message; the reward is whether the
    second reply holds a digit. Rows with ``rewrite`` send a second request whose history was edited."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="yatt-policy", messages=messages, max_tokens=3)
    said = first.choices[0].message.content
    if row.get("rewrite"):
        said = said + " (edited)"
    messages += [{"role": "assistant", "content": said}, {"role": "user", "content": "= 7"}]
    try:
        second = client.chat.completions.create(model="yatt-policy", messages=messages, max_tokens=3)
    except openai.APIStatusError as err:
        return -float(err.status_code)
    return float(any(c.isdigit() for c in second.choices[0].message.content))


def main() -> None:
    from yatt_lightning.run.process_exit import collect_once_at_exit

    collect_once_at_exit()  # as `yatt` ends: without the interpreter's whole-heap collections at exit
    from transformers import AutoTokenizer

    from yatt_lightning.agents import Agent, OpenAIEndpoint
    from yatt_lightning.engines.base import SamplingConfig
    from yatt_lightning.engines.vllm_engine import VLLMEngine
    from yatt_lightning.models.tiny import build_tiny_qwen2
    from yatt_lightning.rollout.types import RolloutRequest

    path = build_tiny_qwen2()
    engine = VLLMEngine()
    engine.start(path, max_num_seqs=16, max_model_len=160, dtype="float32")
    given: dict[str, list] = {}
    add, step = engine.add_turn, engine.step_turns

    def add_turn(key, prompt, sampling, seed, max_tokens):
        given.setdefault(key, []).append([list(prompt), []])
        add(key, prompt, sampling, seed, max_tokens)

    def step_turns():
        done = step()
        for key, completion in done:
            given[key][-1][1] = completion.token_ids
        return done

    engine.add_turn, engine.step_turns = add_turn, step_turns
    rows = [{"prompt": "after c", "_id": 0}, {"prompt": "after x", "_id": 1, "rewrite": True}]
    out = {}
    for mode in ("plain", "chat"):
        given.clear()
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.chat_template = CHATML if mode == "chat" else None
        agent_cfg = Agent(OpenAIEndpoint("tests.scripts.agent_endpoint.agent"), max_turns=4, max_tokens_per_turn=3,
                          max_total_tokens=160, on_error="end")  # fmt: skip
        agent_cfg.configure(tokenizer, chat=mode == "chat", model_path=path, max_prompt_tokens=16)
        request = RolloutRequest(rows, [[1]] * 2, [3, 4], SamplingConfig(n=2), step=0, weights_version=0, agent=agent_cfg)
        groups = dict(agent_cfg.episodes(engine, request))
        exact, first_rendered = True, True
        for g, group in groups.items():
            for j, episode in enumerate(group):
                history = given[f"episode-{g}-{j}"]
                exact &= all(nxt[: len(p) + len(o)] == p + o for (p, o), (nxt, _) in zip(history, history[1:], strict=False))
                exact &= episode.prompt_ids + episode.token_ids == history[-1][0] + history[-1][1]
                want = [{"role": "user", "content": rows[g]["prompt"]}]
                rendered = (tokenizer.apply_chat_template(want, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
                            if mode == "chat" else tokenizer(rows[g]["prompt"]).input_ids)  # fmt: skip
                first_rendered &= episode.prompt_ids == list(rendered)
        out[mode] = {
            "exact": exact, "first_rendered": first_rendered,
            "turns": {str(g): [e.turns.figures["turns"] for e in group] for g, group in sorted(groups.items())},
            "rewards": {str(g): [e.turns.rewards for e in group] for g, group in sorted(groups.items())},
            "errors": {str(g): [e.turns.figures["env_errors"] for e in group] for g, group in sorted(groups.items())},
            "text": tokenizer.decode(groups[0][0].prompt_ids + groups[0][0].token_ids),
        }  # fmt: skip
    engine.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    sys.exit(main())
