"""What a vLLM request's output becomes: the check that the engine sampled after exactly the ids it was
given, and the :class:`~yatt_lightning.engines.base.Completion` s of its samples."""

from __future__ import annotations

from yatt_lightning.engines.base import Completion


def check_prompt(out, ids: list[int]) -> None:
    """The engine sampled after exactly the prompt ids it was given (images expanded as the policy has
    them): otherwise its logprobs belong to another sequence than the one trained on."""
    seen = list(out.prompt_token_ids or [])
    if seen != ids:
        at = next((k for k, (a, b) in enumerate(zip(seen, ids, strict=False)) if a != b), min(len(seen), len(ids)))
        raise RuntimeError(
            f"the rollout engine saw other prompt ids than it was given ({len(seen)} vs {len(ids)} tokens, first "
            f"difference at position {at}: {seen[at:at + 5]} vs {ids[at:at + 5]})"
        )


def completions_of(out, versions: tuple[int, int] | None = None) -> list[Completion]:
    group = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        ids = list(c.token_ids)
        lps = [step[tok].logprob for step, tok in zip(c.logprobs, ids, strict=True)]
        group.append(Completion(ids, lps, c.finish_reason or "length", versions))
    return group
