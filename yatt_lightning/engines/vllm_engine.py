"""The vLLM rollout engine: n samples per prompt with logprobs, weights pushed in place.

The engine lives inside the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and reuses the
trainer's default process group: it must be created on every rank at the same point, after Megatron's
parallel state. Data parallel: one engine per rank (``tensor_parallel_size=1``). Tensor parallel: one
engine shared by the TP group (``distributed_executor_backend="external_launcher"``), same seed and same
prompts on every rank of the group.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from yatt_lightning.engines.base import Completion, SamplingConfig, WeightFeed
from yatt_lightning.engines.kv_cache import kv_cache_bytes_for
from yatt_lightning.engines.step_deadline import StepDeadline
from yatt_lightning.engines.vllm_models import engine_overrides
from yatt_lightning.engines.vllm_outputs import check_prompt, completions_of
from yatt_lightning.engines.vllm_text import TextCompletions
from yatt_lightning.multimodal.image_inputs import collapse, expand

log = logging.getLogger(__name__)

# Must be in the environment before vLLM is imported; see ../shared/CPU-STACK.md.
VLLM_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCHDYNAMO_DISABLE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_CONFIGURE_LOGGING": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def set_vllm_env() -> None:
    for key, value in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


class VLLMEngine(TextCompletions):
    """Rollout engine backed by vLLM (``vllm-cpu`` on CPU machines, ``vllm`` on GPUs).

    Constructing it is cheap; the strategy calls :meth:`start` once its process groups exist.

    Every setting an engine starts with, in one place. Set by the user (``trainer.strategy.engine``, or a
    judge's ``engine``): the arguments below. Derived from the run, never set twice: the model folder,
    seed, ``max_num_seqs`` (prompts x ``model.sampling.n`` of one rank's step, times the ranks one engine
    serves), ``max_model_len`` (``model.max_prompt_tokens`` + ``model.sampling.max_new_tokens``) and the
    training dtype reach :meth:`start` as an :class:`~yatt_lightning.rollout.service.EngineSpec`, which
    the module builds from its configuration; the tensor-parallel size is the model-parallel group's size.
    A judge's engine takes the judge's model and ``max_judge_tokens`` instead. ``dtype`` below is the one
    derived setting a user may override.

    Args:
        kv_cache_memory_bytes: KV cache size per engine. ``None``: on CPU, sized from the rollout batch
            (prompts x samples x longest sequence) with 25% headroom; on a GPU, what
            ``gpu_memory_utilization`` leaves after the weights (vLLM's own sizing).
        gpu_memory_utilization: Fraction of GPU memory vLLM may take (GPU only; vLLM ignores it when
            ``kv_cache_memory_bytes`` is set).
        enable_prefix_caching: Reuse the KV cache of shared prompt prefixes (the n samples of a
            prompt share it). The cache is reset after every weight push.
        enforce_eager: Run without CUDA graphs / compilation. Required on CPU.
        dtype: Weight dtype inside the engine; ``None`` uses the policy's training dtype, so the engine's
            logprobs match the trainer's.
        sleep_level: vLLM sleep level used when colocated on a GPU (1 keeps weights in host memory).
        step_timeout_s: How long one engine step (a token for every running sequence, or a batch's
            prefill) may take before the run stops, naming the engine and the rank
            (:mod:`~yatt_lightning.engines.step_deadline`); ``None``: no deadline.
    """

    def __init__(
        self,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.5,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = True,
        dtype: str | None = None,
        sleep_level: int = 1,
        step_timeout_s: float | None = 600.0,
    ) -> None:
        if kv_cache_memory_bytes is not None and kv_cache_memory_bytes < 1 << 20:
            raise ValueError(f"`engine.kv_cache_memory_bytes` must be at least 1 MiB, got {kv_cache_memory_bytes}.")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"`engine.gpu_memory_utilization` must be in (0, 1], got {gpu_memory_utilization}.")
        if sleep_level not in (1, 2):
            raise ValueError(f"`engine.sleep_level` must be 1 or 2, got {sleep_level}.")
        if step_timeout_s is not None and step_timeout_s <= 0:
            raise ValueError(f"`engine.step_timeout_s` must be > 0 (or null for none), got {step_timeout_s}.")
        self.step_timeout_s = step_timeout_s
        self._deadline = StepDeadline(step_timeout_s, "engine.step_timeout_s") if step_timeout_s else None
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enable_prefix_caching = enable_prefix_caching
        self.enforce_eager = enforce_eager
        self.dtype = dtype
        self.sleep_level = sleep_level
        self._batches = 0
        self.multimodal = False  # a vision-language model (known once started)
        self.image_token_id: int | None = None
        self.image_tokens = 0  # tokens per image in the model's sequences
        self.llm = None
        self.asleep = False
        self.weight_feed: WeightFeed | None = None  # newer weights to apply between engine steps (asynchronous RL)
        self._turns: dict[str, tuple[str, list[int], int | None]] = {}  # running turns: key, prompt, first version
        self.lora_request = None  # the policy's LoRA adapter every request of the policy samples with

    # ------------------------------------------------------------------ life cycle
    def preload(self) -> None:
        """Import what :meth:`start` imports on CPU (vLLM's engine, CPU worker, model runner and loader), once,
        in a process whose local ranks are forked from it (:mod:`yatt_lightning.distributed.fork_launcher`):
        each rank would import them itself, ~4 s of a core."""
        set_vllm_env()
        import vllm.model_executor.model_loader  # noqa: F401
        import vllm.v1.engine.llm_engine  # noqa: F401
        import vllm.v1.executor.uniproc_executor  # noqa: F401
        import vllm.v1.worker.cpu_worker  # noqa: F401

    def start(
        self,
        model_path: Path,
        *,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        max_num_seqs: int = 64,
        max_model_len: int = 256,
        dtype: str = "auto",
        lora_rank: int | None = None,
    ) -> None:
        """``lora_rank``: serve the policy's LoRA adapters of that rank (:meth:`push_adapter`)."""
        set_vllm_env()
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_path)
        self.multimodal = hasattr(hf_config, "vision_config")
        if self.multimodal:
            from yatt_lightning.models.vlm import image_token_id
            from yatt_lightning.multimodal import vision_shim
            from yatt_lightning.multimodal.image_inputs import tokens_per_image

            self.image_token_id = image_token_id(hf_config)
            # LLaVA: a fixed count per image; Qwen-VL (None): each image's own, a run of placeholders is one image
            self.image_tokens = tokens_per_image(hf_config)

            vision_shim.install_video_stand_in()
            vision_shim.subprocess_env()
        from vllm import LLM

        from yatt_lightning.engines import vllm_shutdown

        vllm_shutdown.adapt_to_trainer_process()
        on_gpu = torch.cuda.is_available()
        kv_bytes = self.kv_cache_memory_bytes
        if kv_bytes is None and not on_gpu:  # vLLM's CPU backend has no memory profiler to size it
            kv_bytes = kv_cache_bytes_for(model_path, max_num_seqs, max_model_len, tensor_parallel_size)
        kwargs = {}
        if not on_gpu:
            # vLLM's CPU runner cannot rewind a seeded sampler when a prefill is split across engine steps
            # ("CPU Generator does not use offset"); a step budget that holds every sequence never splits one.
            kwargs["max_num_batched_tokens"] = max(8192, max_num_seqs * max_model_len)
        if lora_rank is not None:
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=1)
        if self.multimodal and self.image_tokens is None:  # Qwen-VL: images only (videos are not built yet)
            kwargs["limit_mm_per_prompt"] = {"video": 0}
        import vllm.envs

        vllm.envs.disable_envs_cache()  # an earlier engine froze the environment; this one may differ
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs.update(engine_overrides(hf_config))  # folders as transformers writes them (vllm_models)
        if tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
            # The external launcher reads the torchrun variables; Lightning's own launcher sets only some.
            world = torch.distributed
            os.environ.setdefault("RANK", str(world.get_rank()))
            os.environ.setdefault("WORLD_SIZE", str(world.get_world_size()))
            os.environ.setdefault(
                "LOCAL_RANK", str(world.get_rank() % torch.cuda.device_count() if on_gpu else world.get_rank())
            )
        self.llm = LLM(
            model=str(model_path),
            tensor_parallel_size=tensor_parallel_size,
            seed=seed,
            dtype=self.dtype or dtype,
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=kv_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_sleep_mode=on_gpu,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="yatt_lightning.engines.worker_extension.WeightSyncExtension",
            **kwargs,
        )
        self.kv_cache_bytes = kv_bytes
        log.info(
            "vLLM engine ready: %s, tp=%d, kv cache %s", model_path, tensor_parallel_size,
            f"{kv_bytes / 2**20:.1f} MiB" if kv_bytes else f"gpu_memory_utilization={self.gpu_memory_utilization}",
        )  # fmt: skip

    def shutdown(self) -> None:
        if self.llm is None:
            return
        from yatt_lightning.engines import vllm_shutdown

        vllm_shutdown.shutdown_engine(self.llm)
        self.llm = None

    # ------------------------------------------------------------------ work
    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        seeds: list[int],
        max_new_tokens: list[int] | None = None,
        images: list[list[Any]] | None = None,
    ) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt, in prompt order."""
        results: list[list[Completion]] = [[] for _ in prompts]
        for index, group in self.generate_stream(prompts, sampling, seeds, max_new_tokens, images):
            results[index] = group
        return results

    def generate_stream(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        seeds: list[int],
        max_new_tokens: list[int] | None = None,
        images: list[list[Any]] | None = None,
    ) -> Iterator[tuple[int, list[Completion]]]:
        """Yield ``(prompt index, its n completions)`` as each prompt's samples all finish.

        ``max_new_tokens`` overrides ``sampling.max_new_tokens`` per prompt. ``images``: per prompt, its
        decoded images; its ids hold each image as the model's run of image tokens, or as one image token
        (vLLM gets one and expands it). Closing the iterator early aborts the requests still running (over-provisioning keeps the
        first groups that finish).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(seeds)} seeds")
        engine = self._llm().llm_engine
        self._batches += 1
        pending: dict[str, int] = {}
        sent: dict[str, list[int] | None] = {}  # the ids the engine must see, image placeholders expanded
        for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
            params = SamplingParams(
                n=sampling.n,
                max_tokens=sampling.max_new_tokens if max_new_tokens is None else max_new_tokens[i],
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                logprobs=0,
                seed=seed,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,  # one output per prompt, with all n samples
            )
            request_id = f"yatt-{self._batches}-{i}"
            inputs = TokensPrompt(prompt_token_ids=prompt)
            sent[request_id] = prompt
            if images is not None and images[i]:
                # The model sees each image as a run of placeholder tokens; vLLM wants one and expands it.
                if prompt.count(self.image_token_id) != len(images[i]):  # expanded, as the policy has it
                    prompt = collapse(prompt, self.image_token_id, self.image_tokens)
                elif self.image_tokens is not None:
                    sent[request_id] = expand(prompt, self.image_token_id, self.image_tokens)
                else:  # one per image, of counts only the engine's processor knows: nothing to check against
                    sent[request_id] = None
                inputs = TokensPrompt(prompt_token_ids=prompt)
                inputs["multi_modal_data"] = {"image": images[i]}
            engine.add_request(request_id, inputs, params, lora_request=self.lora_request)
            pending[request_id] = i
        feed = self.weight_feed
        first = feed.version if feed is not None else None
        updated = False
        try:
            while pending:
                if feed is not None and (named := feed.newer()) is not None:  # between two engine steps
                    self._load(named)
                    updated = True
                for out in self._step(engine, f"generating {len(pending)} of {len(prompts)} prompts"):
                    if out.finished and out.request_id in pending:
                        if (expected := sent.pop(out.request_id)) is not None:
                            check_prompt(out, expected)
                        versions = (first, feed.version) if feed is not None else None
                        yield pending.pop(out.request_id), completions_of(out, versions)
        finally:
            if pending:
                engine.abort_request(list(pending))
            if updated:  # nothing runs now: the cached prefixes of the old weights can go
                self._reset_caches()

    # ------------------------------------------------------------------ one turn at a time (agents)
    def add_turn(self, key: str, prompt: list[int], sampling: SamplingConfig, seed: int, max_tokens: int) -> None:
        """Queue one sample's next turn: at most ``max_tokens`` tokens after ``prompt`` (the episode so far,
        token ids as trained on), seeded by ``seed``; :meth:`step_turns` returns it once it finished. The
        turns of many episodes run batched; the earlier turns' keys and values come from the prefix cache."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1, max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, logprobs=0, seed=seed, detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )  # fmt: skip
        self._batches += 1
        request_id = f"yatt-turn-{self._batches}"
        self._llm().llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params,
                                           lora_request=self.lora_request)  # fmt: skip
        feed = self.weight_feed
        self._turns[request_id] = (key, prompt, feed.version if feed is not None else None)

    def step_turns(self) -> list[tuple[str, Completion]]:
        """One engine step (newer weights applied first, in asynchronous RL): the turns that finished in it,
        by key."""
        feed = self.weight_feed
        if feed is not None and (named := feed.newer()) is not None:
            self._load(named)
        done = []
        for out in self._step(self._llm().llm_engine, f"running {len(self._turns)} agent turns"):
            if out.finished and out.request_id in self._turns:
                key, prompt, first = self._turns.pop(out.request_id)
                check_prompt(out, prompt)
                versions = (first, feed.version) if feed is not None else None
                done.append((key, completions_of(out, versions)[0]))
        return done

    def abort_turns(self) -> None:
        """Abort every turn still running (an episode runner that stops early)."""
        if self._turns:
            self._llm().llm_engine.abort_request(list(self._turns))
            self._turns.clear()

    def _step(self, engine, what: str) -> list:
        """One step of vLLM's engine, under :attr:`step_timeout_s`."""
        if self._deadline is None:
            return engine.step()
        with self._deadline.step(what):
            return engine.step()

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._load(named_tensors)
        self._reset_caches()

    def push_adapter(self, folder: Path) -> None:
        """Sample from now on with the LoRA adapter in ``folder`` (PEFT's format), under a new adapter id;
        the previous adapter is removed. The base weights stay as they are."""
        from vllm.lora.request import LoRARequest

        engine = self._llm().llm_engine
        previous = self.lora_request
        self.lora_request = LoRARequest(
            f"policy-{self._batches}", (previous.lora_int_id + 1) if previous else 1, str(folder)
        )
        if previous is not None:
            engine.remove_lora(previous.lora_int_id)
        self._llm().reset_prefix_cache()

    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = [(name, t.detach()) for name, t in named_tensors]
        self._llm().collective_rpc("yatt_reload_weights", args=(weights,))

    def _reset_caches(self) -> None:
        # Cached keys/values, and encoder outputs of images, were computed with the old weights; vLLM clears
        # the runner's encoder cache on reload but its scheduler would still count on it (CPU-STACK.md).
        # (Running requests keep the keys and values they computed: a request that spans a weight update
        # goes on from them, as in-flight updates do.)
        self._llm().reset_prefix_cache()
        if self.multimodal:
            self._llm().llm_engine.reset_encoder_cache()

    def engine_parameter(self, name: str) -> torch.Tensor:
        return self._llm().collective_rpc("yatt_named_parameter", args=(name,))[0]

    def sleep(self) -> None:
        if torch.cuda.is_available() and not self.asleep:
            self._llm().sleep(level=self.sleep_level)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self._llm().wake_up()
            self.asleep = False

    def _llm(self) -> Any:
        if self.llm is None:
            raise RuntimeError("VLLMEngine used before start() (or after shutdown()).")
        return self.llm
