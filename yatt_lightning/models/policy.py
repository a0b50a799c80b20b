"""A Megatron-Core GPT loaded from a Hugging Face folder: this rank's TP shard of its PP stage.

:class:`MegatronPolicy` is what the RL module trains (wrapped in Megatron's DDP with Megatron's
optimizer) and what it uses as a frozen reference (no wrapper, no optimizer). It runs micro-batches
through Megatron's own forward/backward schedules (which also drive pipeline parallelism) and exports
its weights under Hugging Face names for the rollout engine.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from yatt_lightning.models import convert, live_state, vlm
from yatt_lightning.models.cpu import check_version, megatron_cpu_context, model_parallel_manual_seed
from yatt_lightning.models.expert_gather import ExpertExchange
from yatt_lightning.models.families import arch_of, family_for
from yatt_lightning.models.gpt import build_gpt, transformer_config
from yatt_lightning.models.hf_names import HFNames
from yatt_lightning.models.hf_weights import load_hf_weights, safetensors_reader
from yatt_lightning.models.one_storage import into_one_storage
from yatt_lightning.models.optim import OptimizerSettings
from yatt_lightning.models.router_figures import RouterFigures


class MegatronPolicy(torch.nn.Module):
    """Args:
    path: Hugging Face model folder.
    params_dtype: Training dtype of the parameters (fp32 on CPU, bf16 on GPU).
    optimizer: Optimizer settings; ``None`` builds a frozen model (reference policy).
    seed: Seed of Megatron's RNG tracker.
    value_head: Build a critic (:class:`~yatt_lightning.models.value_model.ValueModel`): the same trunk,
        a scalar value per position instead of logits. It is never exported to an engine.
    one_storage: Keep the trained parameters in one storage per dtype (a disaggregated trainer's publish
        sends them as they are, in one message; a checkpoint then writes each as a copy of its view).
    lora: Train low-rank adapters on the frozen weights instead of the weights
        (:class:`~yatt_lightning.models.lora.LoRASettings`).
    """

    def __init__(
        self,
        path: Path,
        *,
        params_dtype: torch.dtype = torch.float32,
        optimizer: OptimizerSettings | None = None,
        seed: int = 0,
        value_head: bool = False,
        one_storage: bool = False,
        lora: Any = None,
    ) -> None:
        super().__init__()
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        check_version()
        self.path = Path(path)
        hf_config = AutoConfig.from_pretrained(self.path)
        self.vision_language = vlm.is_vision_language(hf_config)  # vision parts (its family's) + this GPT
        if value_head and self.vision_language:
            raise ValueError(
                f"`model.critic`: {self.path} is a vision-language model; a critic on one is not supported yet "
                "(use an estimator without a critic, or a text model's folder as `model.critic.path`)."
            )
        self.arch = arch_of(hf_config)  # its family reads it (models/families)
        tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
        self.ep = ps.get_expert_model_parallel_world_size() if self.arch.moe is not None else 1
        self.arch.check_parallel(tp, pp, self.ep)
        self.local_experts = self.arch.moe.num_experts // self.ep if self.arch.moe is not None else 0
        self.expert_offset = ps.get_expert_model_parallel_rank() * self.local_experts if self.ep > 1 else 0  # global number of its first
        self.experts = ExpertExchange(ps.get_expert_model_parallel_group()) if self.ep > 1 else None  # how every rank gets them all
        self.tp_rank, self.tp = ps.get_tensor_model_parallel_rank(), tp
        self.is_first_stage = ps.is_pipeline_first_stage()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.settings = optimizer
        self.offloaded = False
        self._named_parameters: list | None = None
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []  # CPU offload: (tensor, an alias of its storage)
        self.config = transformer_config(self.arch, tp=tp, pp=pp, params_dtype=params_dtype, ep=self.ep)
        with megatron_cpu_context():
            model_parallel_manual_seed(seed)
            from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

            gpt = build_gpt(
                self.arch, self.config, pre_process=self.is_first_stage,
                post_process=self.is_last_stage and not value_head, tied=not value_head,
            )  # fmt: skip
            self.layer_offset = get_transformer_layer_offset(self.config)
            family = family_for(hf_config)
            self.hf_names = HFNames(self.arch, family.vision_names if self.vision_language else None, self.layer_offset)
            get = safetensors_reader(self.path)
            reader = vlm.text_reader(get) if self.vision_language else get
            load_hf_weights(gpt, reader, self.arch, self.tp_rank, tp, self.layer_offset, source=self.path,
                            expert_offset=self.expert_offset)  # fmt: skip
            if value_head:
                from yatt_lightning.models.value_model import ValueModel

                gpt = ValueModel(gpt, self.arch.hidden_size, self.arch.rms_norm_eps, post_process=self.is_last_stage)
                gpt.load_norm(get)
            if self.vision_language:
                gpt = family.vision_model(hf_config, gpt, pre_process=self.is_first_stage)
                vlm.load_vision_weights(gpt, get)
            self.lora, self.lora_params = lora, 0
            if lora is not None:  # the weights frozen, adapters on the language model's linear layers
                from yatt_lightning.models import lora as adapters

                gpt.requires_grad_(False)
                language = gpt.language_model if self.vision_language else gpt
                self.lora_params = adapters.attach(language, lora, self.arch, self.tp_rank, tp, self.layer_offset, seed)
            if torch.cuda.is_available():
                gpt.cuda(torch.cuda.current_device())
            self.router_figures = RouterFigures.attach(gpt, self.arch) if optimizer is not None else None
            if optimizer is None:
                gpt.requires_grad_(False)
                gpt.eval()
                self.model = gpt
                self.optimizer = None
            else:
                if one_storage:
                    into_one_storage(gpt)
                self.model, self.optimizer = _wrap_for_training(gpt, self.config, optimizer)
                self.config.finalize_model_grads_func = self._timed(self.config.finalize_model_grads_func)
        # Seconds spent in the schedules' gradient synchronisation (waiting for the data-parallel peers and
        # the all-reduce), summed over this policy's life: a step's compute time is its wall time less the
        # change of this counter (the load balancer's cost model learns from that).
        self.grad_sync_seconds = 0.0

    def _timed(self, finalize: Callable) -> Callable:
        def timed_finalize(*args, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the compute launched before the sync belongs to the compute time
            start = time.perf_counter()
            try:
                return finalize(*args, **kwargs)
            finally:
                self.grad_sync_seconds += time.perf_counter() - start

        return timed_finalize

    # ------------------------------------------------------------------ running micro-batches
    def forward_backward(
        self,
        microbatches: list[dict[str, torch.Tensor]],
        loss_fn: Callable[[dict, torch.Tensor], tuple],
        *,
        forward_only: bool,
    ) -> list[dict]:
        """Run ``microbatches`` through Megatron's schedule; returns ``loss_fn``'s dicts (last PP stage only).

        Each micro-batch holds ``input_ids`` ``[b, s]`` (right-padded); ``loss_fn(microbatch, logits)``
        returns ``(loss_sum, num_tokens, metrics_dict)``. Gradients are divided by the number of tokens
        summed over micro-batches and data-parallel ranks (token-level aggregation).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model) -> tuple:
            mb = next(data_iterator)
            ids = mb["input_ids"]
            seq = ids.shape[1]
            position_ids = torch.arange(seq, device=ids.device).unsqueeze(0).expand_as(ids)
            causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=ids.device), diagonal=1)
            images = {k: mb[k] for k in ("pixel_values", "image_grid_thw", "prompt_lengths") if k in mb}
            output = model(ids, position_ids, causal, **images)
            return output, partial(loss_fn, mb)

        seq_length = max(mb["input_ids"].shape[1] for mb in microbatches)
        self.model.train(not forward_only)
        grad = torch.no_grad() if forward_only else contextlib.nullcontext()
        with megatron_cpu_context(), grad:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(microbatches),
                model=[self.model],
                num_microbatches=len(microbatches),
                seq_length=seq_length,
                micro_batch_size=microbatches[0]["input_ids"].shape[0],
                forward_only=forward_only,
            )

    def take_moe_figures(self) -> dict[str, float]:
        """A mixture-of-experts policy's routing figures over its training forwards since the last call
        (:mod:`~yatt_lightning.models.router_figures`); collective over the training ranks. Empty for a dense one."""
        return self.router_figures.take() if self.router_figures is not None else {}

    def zero_grad_buffers(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self, step: int) -> tuple[bool, float]:
        """One optimizer step at the learning rate of optimizer step ``step``; returns (applied, grad norm)."""
        live_state.before_update()  # an asynchronous checkpoint still reading these tensors copies the rest
        lr = self.settings.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with megatron_cpu_context():
            applied, grad_norm, _ = self.optimizer.step()
        return bool(applied), float(grad_norm) if grad_norm is not None else float("nan")

    # ------------------------------------------------------------------ colocation
    def offload(self, params: bool = False) -> None:
        """Free this rank's memory for training state while the rollout engine runs.

        Gradient buffers are released and optimizer state (and with ``params`` the parameter buffers)
        moves to host memory. On a GPU through Megatron-Core's RL helpers. On CPU, where host memory is
        the memory, the same effect on the tensors without a copy: each gives its storage to a host alias
        and is left empty until :meth:`onload` (so the suite exercises what reads the state while it is
        away); an alias taken before (an asynchronous checkpoint's) still reads the data.
        """
        if self.optimizer is None or self.offloaded:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            for buffer in self.model.buffers + self.model.expert_parallel_buffers:
                buffer.offload_to_cpu(move_params=params, move_grads=True)
            self.optimizer.offload_to_cpu()
            torch.cuda.empty_cache()
        else:
            self._host = [(t, t.detach()) for t in self._offloadable(params)]
            for buffer in self.model.buffers + self.model.expert_parallel_buffers:
                buffer.offload_to_cpu(move_params=False, move_grads=True)  # released, zeroed on return
            with torch.no_grad():
                for tensor, _ in self._host:
                    tensor.set_(torch.empty(0, dtype=tensor.dtype))
        self.offloaded = True

    def onload(self) -> None:
        """Undo :meth:`offload` before training (or before anything reads the training state: a save)."""
        if not self.offloaded:
            return
        for buffer in self.model.buffers + self.model.expert_parallel_buffers:
            buffer.reload_from_cpu(move_params=True, move_grads=True)
        if torch.cuda.is_available():
            self.optimizer.restore_from_cpu()
            torch.cuda.synchronize()
        else:
            with torch.no_grad():
                for tensor, alias in self._host:
                    tensor.set_(alias)  # its own storage back, at the same offset, sizes and strides
            self._host = []
        self.offloaded = False

    def _offloadable(self, params: bool) -> list[torch.Tensor]:
        """The optimizer's state tensors (and the parameter buffers and parameters, views of them), once each."""
        seen, out = set(), []
        buffers = [b.param_data for b in self.model.buffers + self.model.expert_parallel_buffers]
        tensors = [] if not params else [b for b in buffers if b is not None] + list(self.model.parameters())
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", None)
            for state in inner.state.values() if inner is not None else []:
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
        for t in tensors:
            key = id(t)
            if key not in seen and t.untyped_storage().nbytes() > 0:
                seen.add(key)
                out.append(t)
        return out

    # ------------------------------------------------------------------ weights
    def local_module(self) -> torch.nn.Module:
        """The GPT module itself (inside Megatron's DDP wrapper when training)."""
        return self.model.module if self.optimizer is not None else self.model

    @torch.no_grad()
    def export_hf(self) -> Iterator[tuple[str, torch.Tensor]]:
        """All weights under Hugging Face names as full tensors: TP shards gathered, every PP stage's
        layers broadcast to the whole pipeline group, stage by stage; some are views (of the parameters, of
        another expert-parallel rank's experts: models/expert_gather.py), so copy what you keep.
        Collective over the model-parallel group: every rank of it must iterate to the end.
        """
        yield from self._across_stages(self._export_stage)

    @torch.no_grad()
    def export_adapter(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapters under PEFT's names as full tensors (TP shards gathered, every stage's broadcast
        to the pipeline group); collective over the model-parallel group, as :meth:`export_hf`."""
        yield from self._across_stages(self._adapter_stage)

    @torch.no_grad()
    def export_merged(self, adapters: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """:meth:`export_hf` with the LoRA adapters (``adapters``: :meth:`export_adapter`'s, if already taken)
        merged into the weights they adapt (``W + scale B A``); the weights themselves stay as they are.
        Collective, as :meth:`export_hf`."""
        adapters = dict(self.export_adapter()) if adapters is None else adapters
        for name, tensor in self.export_hf():
            peft = "base_model.model." + name.removesuffix(".weight")
            if f"{peft}.lora_A.weight" in adapters:
                a, b = adapters[f"{peft}.lora_A.weight"], adapters[f"{peft}.lora_B.weight"]
                tensor = tensor + self.lora.scale * (b.float() @ a.float()).to(tensor.dtype)
            yield name, tensor

    def _across_stages(self, stage_tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]):
        """``stage_tensors()`` of every pipeline stage, on every rank of the pipeline group, stage by stage."""
        from megatron.core import parallel_state as ps

        pp = ps.get_pipeline_model_parallel_world_size()
        if pp == 1:
            yield from stage_tensors()
            return
        group = ps.get_pipeline_model_parallel_group()
        ranks = torch.distributed.get_process_group_ranks(group)
        mine = ps.get_pipeline_model_parallel_rank()
        device = next(self.local_module().parameters()).device
        for stage in range(pp):
            tensors = [(n, t.contiguous()) for n, t in stage_tensors()] if stage == mine else None
            meta = [[(n, t.shape, t.dtype) for n, t in tensors] if tensors is not None else None]
            torch.distributed.broadcast_object_list(meta, src=ranks[stage], group=group)
            for i, (name, shape, dtype) in enumerate(meta[0]):
                t = tensors[i][1] if tensors is not None else torch.empty(shape, dtype=dtype, device=device)
                torch.distributed.broadcast(t, src=ranks[stage], group=group)
                yield name, t

    def _export_stage(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This PP stage's weights under Hugging Face names, gathered over the TP group."""
        from megatron.core import parallel_state as ps

        group, experts = ps.get_tensor_model_parallel_group(), []
        for name, param in self.local_module().named_parameters():
            if ".lora." in name:  # adapters: export_adapter
                continue
            local = param.detach()
            if self.ep > 1 and ".local_experts." in name:  # every rank's experts, gathered layer by layer below
                experts.append((name, local))
                continue
            table_name = name.removeprefix("language_model.")  # a vision-language policy's GPT
            if self.tp > 1 and convert.tp_split_dim(table_name, self.arch) is not None:
                shards = [torch.empty_like(local) for _ in range(self.tp)]
                torch.distributed.all_gather(shards, local.contiguous(), group=group)
                full = convert.unshard(table_name, shards, self.arch)
            else:
                full = local
            yield from self.hf_names(name, full)
        for name, full in self.experts.gather(experts, self.local_experts) if experts else ():
            yield from self.hf_names(name, full)

    def _adapter_stage(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This PP stage's adapters under PEFT's names, gathered over the TP group."""
        from megatron.core import parallel_state as ps

        from yatt_lightning.models import lora

        for name, param in self.local_module().named_parameters():
            if not lora.is_lora(name):
                continue
            local, proj_which = param.detach(), name.rsplit(".", 1)[-1].rsplit("_", 1)
            dim = lora.split_dim(*proj_which)
            if self.tp > 1 and dim is not None:
                shards = [torch.empty_like(local) for _ in range(self.tp)]
                torch.distributed.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
                local = torch.cat(shards, dim=dim)
            yield lora.peft_name(name.removeprefix("language_model."), self.layer_offset, self.vision_language), local

    def local_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's parameters under their Megatron names, as views (no copy); with TP = PP = 1, what
        :meth:`export_hf` exports before :attr:`hf_names` renames them."""
        if self._named_parameters is None:  # the same parameter objects for the policy's life
            self._named_parameters = list(self.local_module().named_parameters())
        return [(name, param.detach()) for name, param in self._named_parameters]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.local_module().parameters())


def _wrap_for_training(gpt, config, settings: OptimizerSettings) -> tuple[Any, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=settings.use_distributed_optimizer,
        ),
        gpt,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=settings.lr,
            weight_decay=settings.weight_decay,
            adam_beta1=settings.adam_beta1,
            adam_beta2=settings.adam_beta2,
            adam_eps=settings.adam_eps,
            clip_grad=settings.clip_grad,
            bf16=config.bf16,
            fp16=config.fp16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=settings.use_distributed_optimizer,
        ),
        [ddp],
    )
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return ddp, optimizer
