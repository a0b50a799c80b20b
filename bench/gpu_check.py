"""The Megatron side of a training step on CUDA with NCCL, without the CPU compatibility layer.

Run by bench/gpu_check.sh under torchrun on a machine with a GPU. Builds the tiny model, loads it
into Megatron-Core (bf16), checks its logits against transformers, runs a GRPO-style forward/backward
through Megatron's schedule, steps Megatron's optimizer and exports the weights under Hugging Face
names. The vLLM engine is not exercised here (its CUDA wheel is too large to carry to the test machine).

Last line: ``gpu_check=ok max_logit_diff=<x> grad_norm=<y> step_ms=<z>`` (or a traceback).

``--smoke`` runs the same steps on CPU (gloo, fp32, with the CPU compatibility layer), one process,
no torchrun needed: it keeps the script from rotting between GPU runs and proves nothing about CUDA.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    smoke = "--smoke" in sys.argv[1:]
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    if smoke:
        for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                           "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():  # fmt: skip
            os.environ.setdefault(key, value)
        torch.distributed.init_process_group("gloo")
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_check needs a CUDA device (or --smoke, which runs the same steps on CPU)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        from yatt_lightning.strategy import GPU_PROCESS_GROUP_BACKEND

        torch.distributed.init_process_group(GPU_PROCESS_GROUP_BACKEND)  # what MegatronStrategy uses on GPUs
    for device_ in {"cpu", device}:  # control messages are CPU tensors, training's are CUDA tensors
        probe = torch.ones(1, device=device_)
        torch.distributed.all_reduce(probe)
        assert probe.item() == torch.distributed.get_world_size(), device_
    from megatron.core import parallel_state as ps

    from yatt_lightning.models.cpu import cpu_mode, megatron_cpu_context
    from yatt_lightning.models.logprobs import token_logprobs
    from yatt_lightning.models.optim import OptimizerSettings
    from yatt_lightning.models.policy import MegatronPolicy
    from yatt_lightning.models.tiny import build_tiny_qwen2

    if cpu_mode() != smoke:
        sys.exit("the CPU compatibility layer must be inactive on a GPU machine (and active in --smoke on CPU)")
    with megatron_cpu_context():
        ps.initialize_model_parallel(1, 1)
    path = build_tiny_qwen2()
    policy = MegatronPolicy(path, params_dtype=dtype, optimizer=OptimizerSettings(lr=1e-4))
    assert next(policy.local_module().parameters()).device.type == device

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    ids = torch.randint(0, 290, (4, 32), device=device)
    seen = []

    def keep(mb, logits):
        seen.append(logits.detach().float())
        return torch.zeros((), device=device), torch.tensor(1, device=device), {}

    policy.forward_backward([{"input_ids": ids}], keep, forward_only=True)
    with torch.no_grad():
        ref = hf(ids).logits.float()
    max_logit_diff = (seen[0] - ref).abs().max().item()

    adv = torch.randn(4, 1, device=device)

    def grpo_like(mb, logits):
        lp = token_logprobs(logits[:, :-1], mb["input_ids"][:, 1:])
        ratio = torch.exp(lp - lp.detach())
        loss = -(ratio * adv).sum()
        return loss, torch.tensor(lp.numel(), device=device, dtype=torch.int), {}

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    policy.zero_grad_buffers()
    policy.forward_backward([{"input_ids": ids}, {"input_ids": ids.flip(0)}], grpo_like, forward_only=False)
    applied, grad_norm = policy.optimizer_step(0)
    sync()
    step_ms = (time.perf_counter() - t0) * 1000
    exported = dict(policy.export_hf())
    assert applied and len(exported) == len(hf.state_dict()), (applied, len(exported))
    if torch.distributed.get_rank() == 0:
        name = torch.cuda.get_device_name() if device == "cuda" else "CPU (--smoke)"
        print(f"device: {name}; megatron params: {policy.num_parameters()}")
        print(f"gpu_check=ok max_logit_diff={max_logit_diff:.3e} grad_norm={grad_norm:.3e} step_ms={step_ms:.1f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
