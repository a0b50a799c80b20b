"""Methods added to every vLLM worker (``LLM(worker_extension_cls=...)``) for in-place weight updates."""

from __future__ import annotations

import torch


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker.

    ``reload_weights`` (not ``model.load_weights``) is used because vLLM repacks some weights after
    loading (for oneDNN on CPU, for quantised kernels on GPU) and only the reload path repeats that.
    """

    def yatt_reload_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        self.model_runner.reload_weights(weights_iterator=iter(weights))
        _retie_output_embedding(self.model_runner.model, self.model_runner.model_config.hf_config)
        _prepack_cpu_experts(self.model_runner.model)
        return len(weights)

    def yatt_named_parameter(self, name: str) -> torch.Tensor:
        """A copy of one of the engine's parameters (tests compare it with the pushed tensor)."""
        return dict(self.model_runner.model.named_parameters())[name].detach().clone().cpu()


def _retie_output_embedding(model: torch.nn.Module, hf_config) -> None:
    """Tied embeddings (Llama 3.2, Qwen2.5 0.5B, ...): the output layer shares the input embedding, and no
    ``lm_head.weight`` is pushed. vLLM 0.32's layer-wise reload then gives the output layer back its old
    kernel tensors (``ParallelLMHead: Failed to load weights``; on CPU its packed copy of the old
    embedding), so the engine would sample from the initial output layer forever (measured: logprobs 0.09
    off after one step, 0.23 after three). Tie it again to the reloaded embedding and redo its kernel
    preparation, as the first load did."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    tied = getattr(hf_config.get_text_config(), "tie_word_embeddings", None)
    if not (tied if tied is not None else getattr(hf_config, "tie_word_embeddings", False)):  # Qwen-VL: the outer
        return
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    embeddings = [m for m in model.modules() if type(m) is VocabParallelEmbedding]
    if len(heads) != 1 or len(embeddings) != 1:
        raise RuntimeError(
            f"tied embeddings: expected one output layer and one token embedding in the engine's model, found "
            f"{len(heads)} and {len(embeddings)}"
        )
    head = heads[0].tie_weights(embeddings[0])
    head.quant_method.process_weights_after_loading(head)


def _prepack_cpu_experts(model: torch.nn.Module) -> None:
    """Mixture-of-experts layers on CPU: vLLM 0.32 prepacks the experts' weights into its grouped-GEMM layout
    after the first load only (``_setup_kernel`` skips ``fused_experts.process_weights_after_loading`` on a
    weight update), so a reload leaves the new weights unpacked where the kernel reads packed ones (measured:
    logprobs 0.1 off after any push, also after pushing the initial weights back). Prepack them again. A
    layer whose experts vLLM had padded cannot be repacked from the reloaded (unpadded) tensors: refused."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a GPU build: its kernels take the reloaded layout
        return
    for layer in model.modules():
        experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):
            continue
        if experts._padded_intermediate_size(experts.moe_config) != experts.moe_config.intermediate_size_per_partition:
            raise RuntimeError(
                "the engine's CPU expert kernel pads this model's expert size "
                f"({experts.moe_config.intermediate_size_per_partition}); weights pushed into it cannot be repacked"
            )
        experts.process_weights_after_loading(layer)
