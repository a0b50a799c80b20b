"""Text completions of the engine, one per prompt, without the policy's adapter: what a judge or a generative
reward model says (greedy by default, optionally constrained to a set of strings). A part of
:class:`~yatt_lightning.engines.vllm_engine.VLLMEngine` (it uses the engine's ``_llm``, ``_step`` and request
counter)."""

from __future__ import annotations


class TextCompletions:
    def complete(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, choices: list[str] | None = None
    ) -> list[str]:
        """One completion per prompt as text (greedy by default): what a judge model says. ``choices``
        constrains the text to one of those strings (vLLM structured outputs)."""
        ids = self.submit(prompts, max_new_tokens, temperature, choices)
        done: dict[str, str] = {}
        while len(done) < len(ids):
            done.update(self.poll())
        return [done[i] for i in ids]

    def submit(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, choices: list[str] | None = None
    ) -> list[str]:
        """Queue text completions without waiting (continuous batching); :meth:`poll` collects them."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        structured = StructuredOutputsParams(choice=choices) if choices else None
        params = SamplingParams(
            n=1, max_tokens=max_new_tokens, temperature=temperature, seed=0, structured_outputs=structured,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )  # fmt: skip
        engine = self._llm().llm_engine
        ids = []
        for prompt in prompts:
            self._batches += 1
            request_id = f"yatt-text-{self._batches}"
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
            ids.append(request_id)
        return ids

    def poll(self) -> dict[str, str]:
        """One engine step: the texts of the requests that finished in it."""
        outputs = self._step(self._llm().llm_engine, "completing a judge's or a reward model's requests")
        return {out.request_id: out.outputs[0].text for out in outputs if out.finished}
