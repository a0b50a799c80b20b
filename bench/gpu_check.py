"""The Megatron side of a training step on CUDA with NCCL, without the CPU compatibility layer.

Run by bench/gpu_check.sh under torchrun on a machine with a GPU. Builds the tiny model, loads it
into Megatron-Core (bf16), checks its logits against transformers, runs a GRPO-style forward/backward
through Megatron's schedule, steps Megatron's optimizer and exports the weights under Hugging Face
names. The vLLM engine is not exercised here (its CUDA wheel is too large to carry to the test machine).

Last line: ``gpu_check=ok max_logit_diff=<x> grad_norm=<y> step_ms=<z>`` (or a traceback).
"""

from __future__ import annotations

import os
import time

import torch


def main() -> None:
    assert torch.cuda.is_available(), "gpu_check needs a CUDA device"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    from yatt_lightning.strategy import GPU_PROCESS_GROUP_BACKEND

    torch.distributed.init_process_group(GPU_PROCESS_GROUP_BACKEND)  # what MegatronStrategy uses on GPUs
    for device in ("cpu", "cuda"):  # control messages are CPU tensors, training's are CUDA tensors
        probe = torch.ones(1, device=device)
        torch.distributed.all_reduce(probe)
        assert probe.item() == torch.distributed.get_world_size(), device
    from megatron.core import parallel_state as ps

    from yatt_lightning.models.cpu import cpu_mode
    from yatt_lightning.models.logprobs import token_logprobs
    from yatt_lightning.models.policy import MegatronPolicy
    from yatt_lightning.models.tiny import build_tiny_qwen2
    from yatt_lightning.optim import OptimizerSettings

    assert not cpu_mode(), "the CPU compatibility layer must be inactive on a GPU machine"
    ps.initialize_model_parallel(1, 1)
    path = build_tiny_qwen2()
    policy = MegatronPolicy(path, params_dtype=torch.bfloat16, optimizer=OptimizerSettings(lr=1e-4))
    assert next(policy.local_module().parameters()).is_cuda

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    ids = torch.randint(0, 290, (4, 32), device="cuda")
    seen = []

    def keep(mb, logits):
        seen.append(logits.detach().float())
        return torch.zeros((), device="cuda"), torch.tensor(1, device="cuda"), {}

    policy.forward_backward([{"input_ids": ids}], keep, forward_only=True)
    with torch.no_grad():
        ref = hf(ids).logits.float()
    max_logit_diff = (seen[0] - ref).abs().max().item()

    adv = torch.randn(4, 1, device="cuda")

    def grpo_like(mb, logits):
        lp = token_logprobs(logits[:, :-1], mb["input_ids"][:, 1:])
        ratio = torch.exp(lp - lp.detach())
        loss = -(ratio * adv).sum()
        return loss, torch.tensor(lp.numel(), device="cuda", dtype=torch.int), {}

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    policy.zero_grad_buffers()
    policy.forward_backward([{"input_ids": ids}, {"input_ids": ids.flip(0)}], grpo_like, forward_only=False)
    applied, grad_norm = policy.optimizer_step(0)
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) * 1000
    exported = dict(policy.export_hf())
    assert applied and len(exported) == len(hf.state_dict()), (applied, len(exported))
    if torch.distributed.get_rank() == 0:
        print(f"device: {torch.cuda.get_device_name()}; megatron params: {policy.num_parameters()}")
        print(f"gpu_check=ok max_logit_diff={max_logit_diff:.3e} grad_norm={grad_norm:.3e} step_ms={step_ms:.1f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
