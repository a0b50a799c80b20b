"""A critic for PPO: the policy's architecture with a scalar value head in place of the vocabulary.

The GPT is built without its output stage (``post_process=False``: no final norm, no output layer), so
the last pipeline stage returns hidden states; this module adds the final RMSNorm (loaded from the
checkpoint's ``model.norm.weight``, like the policy's) and ``value_head``, a ``hidden -> 1`` linear layer
replicated over the tensor-parallel group (the hidden states are complete on every TP rank). The head
starts at zero, so the first values are 0 and the trunk keeps the checkpoint's features until the head
has learned something. Sharded checkpointing works as for the LLaVA module: the GPT's shards plus the
replicated head.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule


class ValueModel(MegatronModule):
    """One pipeline stage of a critic; the last stage returns values ``[b, s]`` (float32)."""

    def __init__(self, gpt: torch.nn.Module, hidden_size: int, eps: float, *, post_process: bool) -> None:
        super().__init__(config=gpt.config)
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.language_model = gpt
        self.is_last_stage = post_process
        if post_process:
            self.final_norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=gpt.config.params_dtype)
            self.value_head = torch.nn.Linear(hidden_size, 1, dtype=gpt.config.params_dtype)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
            for param in (*self.final_norm.parameters(), *self.value_head.parameters()):
                set_tensor_model_parallel_attributes(param, False, -1, 1)

    # What Megatron's schedules and gradient finalisation look up on the model they run.
    @property
    def model_type(self) -> object:
        return self.language_model.model_type

    @property
    def pre_process(self) -> bool:
        return self.language_model.pre_process

    @property
    def post_process(self) -> bool:
        return self.is_last_stage

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return False

    def set_input_tensor(self, tensor) -> None:
        self.language_model.set_input_tensor(tensor)

    def load_norm(self, get) -> None:
        """Copy the checkpoint's final norm (``get(hf name)``) into this stage's ``final_norm``."""
        if self.is_last_stage:
            with torch.no_grad():
                self.final_norm.weight.copy_(get("model.norm.weight").to(self.final_norm.weight.dtype))

    def forward(self, input_ids, position_ids, attention_mask) -> torch.Tensor:
        hidden = self.language_model(input_ids, position_ids, attention_mask)  # [s, b, h]
        if not self.is_last_stage:
            return hidden
        return self.value_head(self.final_norm(hidden)).squeeze(-1).transpose(0, 1).float()
