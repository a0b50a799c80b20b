"""LoRA on the Megatron policy: adapters equal to PEFT's on the same base, frozen base weights, and TP=2 /
PP=2 equal to one process (tier 1 one process over gloo, tier 2 two processes)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, spawn_gloo
from tests.test_policy import megatron_world  # noqa: F401 (a fixture)
from yatt_lightning.models.lora import LoRASettings


def _policy(path, lora, lr=1e-2):
    from yatt_lightning.models.optim import OptimizerSettings
    from yatt_lightning.models.policy import MegatronPolicy

    return MegatronPolicy(path, optimizer=OptimizerSettings(lr=lr, clip_grad=1.0), lora=lora, seed=3)


def _nll(mb, logits):
    from yatt_lightning.models.logprobs import token_logprobs

    ids = mb["input_ids"]
    lp = token_logprobs(logits[:, :-1], ids[:, 1:], 1.0)  # vocab-parallel logits under TP
    return -lp.sum(), torch.tensor(lp.numel(), dtype=torch.int), {"nll": -lp.sum().detach()}


def _train(policy, steps=3) -> list[float]:
    """``steps`` optimizer steps on fixed sequences; the loss of each (per token)."""
    ids = torch.randint(3, 290, (4, 12), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(steps):
        policy.zero_grad_buffers()
        out = policy.forward_backward([{"input_ids": ids[:2]}, {"input_ids": ids[2:]}], _nll, forward_only=False)
        policy.optimizer_step(step)
        losses.append(sum(float(o["nll"]) for o in out) / (4 * 11) if out else float("nan"))
    return losses


def test_settings_name_the_key():
    with pytest.raises(ValueError, match=r"`model.lora.target_modules`: \['qkv'\] is not a projection"):
        LoRASettings(target_modules=["qkv"])
    with pytest.raises(ValueError, match=r"`model.lora.rank` must be >= 1"):
        LoRASettings(rank=0)
    assert LoRASettings(target_modules=["v_proj", "q_proj"]).targets() == ["q_proj", "v_proj"]


def test_adapters_give_peft_logits_and_train_only_themselves(megatron_world, tiny_model_path, tmp_path):  # noqa: F811
    """Adapters with random B on every projection: the Megatron policy's logits equal transformers + PEFT loading
    the exported adapter folder; after 3 optimizer steps the base weights are bitwise the same, the adapters moved,
    and only they are trainable."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from yatt_lightning.models.lora import save_peft

    settings = LoRASettings(rank=4, alpha=8)
    policy = _policy(tiny_model_path, settings)
    module = policy.local_module()
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora." in n for n in trainable)
    assert policy.lora_params == sum(p.numel() for p in module.parameters() if p.requires_grad)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for n, p in module.named_parameters():
            if n.endswith("_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    base_before = {n: t.clone() for n, t in policy.export_hf()}
    _train(policy)
    assert all(torch.equal(t, base_before[n]) for n, t in policy.export_hf())
    adapter = dict(policy.export_adapter())
    assert len(adapter) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    save_peft(tmp_path / "adapter", adapter, settings, tiny_model_path)
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                                   tmp_path / "adapter")  # fmt: skip
    ids = torch.randint(3, 290, (2, 10), generator=torch.Generator().manual_seed(5))
    seen = []
    policy.forward_backward([{"input_ids": ids}], lambda mb, lg: (seen.append(lg.detach()), (torch.zeros(()), torch.tensor(1), {}))[1],
                           forward_only=True)  # fmt: skip
    with torch.no_grad():
        expected = hf(ids).logits
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert (expected - plain(ids).logits.detach()).abs().max() > 1e-2  # the adapter changes the logits
    torch.testing.assert_close(seen[0], expected, atol=1e-4, rtol=1e-4)
    # `lora.merge`: the weights with the adapter merged in, as the engine would receive them
    plain.load_state_dict(dict(policy.export_merged()), strict=False)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, expected, atol=1e-4, rtol=1e-4)


def test_a_mixture_of_experts_takes_adapters_on_its_attention_as_peft_does(megatron_world, tmp_path):  # noqa: F811
    """The built-in Qwen3-MoE (QK-norm, 8 experts) with adapters on its attention projections: after 3 optimizer
    steps the experts, router and base weights are bitwise the same, and the logits equal transformers + PEFT
    loading the exported adapter folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from yatt_lightning.checkpoint.model_source import resolve_model_path
    from yatt_lightning.models.lora import save_peft

    path = resolve_model_path("builtin:tiny-qwen3-moe")
    settings = LoRASettings(rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    policy = _policy(path, settings)
    base_before = {n: t.clone() for n, t in policy.export_hf()}
    _train(policy)
    assert all(torch.equal(t, base_before[n]) for n, t in policy.export_hf())
    adapter = dict(policy.export_adapter())
    assert len(adapter) == 2 * 4 * 2 and any(not torch.equal(t, torch.zeros_like(t)) for n, t in adapter.items() if "lora_B" in n)
    save_peft(tmp_path / "adapter", adapter, settings, path)
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tmp_path / "adapter")
    ids = torch.randint(3, 290, (2, 10), generator=torch.Generator().manual_seed(5))
    seen = []
    policy.forward_backward([{"input_ids": ids}], lambda mb, lg: (seen.append(lg.detach()), (torch.zeros(()), torch.tensor(1), {}))[1],
                           forward_only=True)  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(seen[0], hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_the_language_model_of_a_llava_policy_takes_adapters_as_peft_does(megatron_world, tmp_path):  # noqa: F811
    """A LLaVA policy with adapters on its language model (the vision tower and projector frozen as the base):
    after an update, its logits on two images equal transformers' LLaVA with the exported PEFT folder loaded,
    whose pattern leaves the vision tower's projections of the same names alone."""
    from peft import PeftModel
    from transformers import LlavaForConditionalGeneration

    from tests.test_vlm_policy import _inputs, _logits_of_images
    from yatt_lightning.models.lora import save_peft
    from yatt_lightning.models.tiny_llava import build_tiny_llava

    path = build_tiny_llava()
    settings = LoRASettings(rank=4, alpha=8)
    policy = _policy(path, settings)
    module = policy.local_module()
    assert all(".lora." in n and "language_model" in n for n, p in module.named_parameters() if p.requires_grad)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for n, p in module.named_parameters():
            if n.endswith("_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ids, pixels = _inputs(path, [(220, 30, 30), (40, 60, 230)])
    save_peft(tmp_path / "adapter", dict(policy.export_adapter()), settings, path, vision_language=True)
    hf = PeftModel.from_pretrained(LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32),
                                   tmp_path / "adapter").eval()  # fmt: skip
    adapted = [n for n, _ in hf.named_modules() if n.endswith(".lora_A")]
    assert len(adapted) == 7 * 2 and all(".language_model." in n for n in adapted)
    with torch.no_grad():
        expected = hf(input_ids=ids, pixel_values=pixels).logits
        plain = hf.get_base_model()
        with hf.disable_adapter():
            assert (plain(input_ids=ids, pixel_values=pixels).logits - expected).abs().max() > 1e-2
    torch.testing.assert_close(_logits_of_images(policy, ids, pixels), expected, atol=1e-4, rtol=1e-4)


def _layout_run(rank: int, port: int, queue, world: int, tp: int, pp: int, path: str, saved: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    from yatt_lightning.models.cpu import megatron_cpu_context

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    with megatron_cpu_context():
        ps.initialize_model_parallel(tp, pp)
    settings = LoRASettings(rank=4, alpha=8, target_modules="all-linear")
    policy = _policy(path, settings)
    losses = _train(policy)
    adapter = {n: t.numpy().copy() for n, t in policy.export_adapter()}  # by value: the process ends next
    # The checkpoint's adapters and optimizer in this layout, loaded into a fresh policy: one more step of each
    # is the same, bit for bit.
    from megatron.core import dist_checkpointing

    from yatt_lightning.checkpoint import folder as ckpt

    os.makedirs(saved, exist_ok=True)
    with megatron_cpu_context():
        dist_checkpointing.save(ckpt._sharded_state(policy, is_loading=False), saved)
        fresh = _policy(path, settings)
        state = dist_checkpointing.load(ckpt._sharded_state(fresh, is_loading=True), saved)
    fresh.local_module().load_state_dict({k.removeprefix("model."): v for k, v in state["model"].items()}, strict=False)
    fresh.optimizer.load_state_dict(state["optimizer"])
    same = repr(_train(policy, steps=1)) == repr(_train(fresh, steps=1))  # nan on a first PP stage
    same &= all(torch.equal(a, b) for (_, a), (_, b) in zip(policy.export_adapter(), fresh.export_adapter(), strict=True))
    queue.put((rank, (losses, adapter, policy.lora_params, same, sorted(state["model"]))))


def _spawn(world, tp, pp, path, saved):
    import functools

    run = functools.partial(_layout_run, world=world, tp=tp, pp=pp, path=str(path), saved=str(saved))
    return spawn_gloo(run, world=world, timeout=240)


@pytest.mark.distributed
def test_tp2_and_pp2_equal_one_process_and_checkpoint_the_adapters_only(tiny_model_path, tmp_path):
    """3 optimizer steps of every projection's adapters: TP=2 and PP=2 reach one process's losses and adapter
    weights within 1e-5 (B starts at zero, so the steps move both A and B). Each layout's checkpoint holds the
    adapters only, whole (each TP shard where it belongs), and a policy loaded from it takes the next step
    bit for bit as the one that wrote it."""
    from yatt_lightning.checkpoint.export import _unstack, read_model_tensors
    from yatt_lightning.models.lora import peft_name

    one = _spawn(1, 1, 1, tiny_model_path, tmp_path / "one")[0]
    for tp, pp in ((2, 1), (1, 2)):
        saved = tmp_path / f"tp{tp}pp{pp}"
        runs = _spawn(2, tp, pp, tiny_model_path, saved)
        assert all(run[3] for run in runs.values()), (tp, pp, "a policy loaded from the checkpoint took another step")
        assert all(".lora." in key for run in runs.values() for key in run[4])
        written = {peft_name(n, 0): t for name, full in read_model_tensors(saved).items() for n, t in _unstack(name, full)}
        assert written.keys() == one[1].keys()
        assert all(torch.equal(written[k], torch.from_numpy(runs[0][1][k])) for k in written), (tp, pp)
        losses = runs[1][0] if pp == 2 else runs[0][0]  # the last stage computes the loss
        assert losses == pytest.approx(one[0], abs=1e-5), (tp, pp, losses, one[0])
        adapter = runs[0][1]
        assert adapter.keys() == one[1].keys()
        worst = max(abs(adapter[k] - one[1][k]).max() for k in adapter)
        assert worst < 1e-5, (tp, pp, worst)
        if pp == 2:  # each stage holds its layers' adapters
            assert runs[0][2] + runs[1][2] == one[2]


@pytest.mark.slow
def test_a_killed_lora_run_resumes_bitwise_exports_both_forms_and_refuses_adapters_that_do_not_fit(tmp_path):
    """GRPO with adapters, saved every 2 steps, SIGKILLed after the first optimizer step of step 4: resumed with
    `--ckpt_path last`, the adapters (and the untouched base) end bit for bit where an uninterrupted run's do.
    Its checkpoint holds the adapters and their optimizer only, with its base named and hashed; `yatt export`
    writes a PEFT folder that `peft` loads onto the base and a merged folder, both with the policy's logits.
    Resuming it on another base, rank or scale, or without `model.lora`, is one screen before any engine. The
    engine's logprobs equal the policy's at every step: it samples with the adapter pushed after each update."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tests.helpers import read_scalars, yatt, yatt_in_process
    from tests.test_checkpoint import _faults, _records, _resumed_step, _saver, _weights
    from yatt_lightning.checkpoint import folder as ckpt
    from yatt_lightning.checkpoint.export import read_model_tensors

    common = ["--trainer.max_steps", "5", "--model.mini_batches", "2", "--model.lora", '{"rank": 8}']
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    _faults(whole, *common, "--trainer.callbacks", _saver(whole / "ckpts", 2))
    _faults(cut, "--kill", "train:4", *common, "--trainer.callbacks", _saver(cut / "ckpts", 2), expect_kill=True)
    log = _faults(cut, *common, "--trainer.callbacks", _saver(cut / "ckpts", 2), "--ckpt_path", "last")
    assert _resumed_step(log) == 2, log[-3000:]
    a, b = _weights(whole), _weights(cut)
    assert a.keys() == b.keys() and sum(k.startswith("adapter.") for k in a) == 28
    assert all(torch.equal(a[k], b[k]) for k in a) and _records(whole) == _records(cut)
    # the engine samples with the adapter it received after each update (the logits move by > 1e-2, below)
    scalars = read_scalars(whole / "tb")
    assert len(scalars["rollout/logprob_diff_max"]) >= 3 and max(v for _, v in scalars["rollout/logprob_diff_max"]) < 1e-3
    assert {v for _, v in scalars["lora/sync_bytes"]} == {131072.0}  # 32768 fp32 adapter parameters a push

    saved = ckpt.tracked(whole / "ckpts")
    tensors = read_model_tensors(saved / ckpt.WEIGHTS)
    assert len(tensors) == 14 and all(".lora." in k for k in tensors)  # A and B of 7 projections, layers stacked
    assert sum(t.numel() for t in tensors.values()) == 32768
    reference = json.loads((saved / "lora_base.json").read_text())
    base = Path(reference["base"])
    assert reference["rank"] == 8 and len(reference["base_sha256"]) == 64

    yatt(["export", "--ckpt_dir", str(whole / "ckpts"), "--out", str(tmp_path / "hf")], cwd=tmp_path)
    probe = torch.load(whole / "logits.pt")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        assert (plain(probe["ids"]).logits - probe["logits"]).abs().max() > 1e-2  # the adapters moved the policy
        peft = PeftModel.from_pretrained(plain, tmp_path / "hf" / "adapter")
        for model in (merged, peft):
            torch.testing.assert_close(model(probe["ids"]).logits, probe["logits"], atol=1e-4, rtol=1e-4)

    other = tmp_path / "other-base"  # the same model with one weight changed by 1e-3
    shutil.copytree(base, other)
    weights = load_file(str(other / "model.safetensors"))
    first = sorted(weights)[0]
    weights[first] = weights[first] + 1e-3
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    grpo, at = str(REPO / "configs" / "grpo_tiny.yaml"), ["--ckpt_path", str(saved)]
    for extra, screen in (
        (["--model.lora", '{"rank": 8}', "--model.policy.path", str(other)],
         f"the adapters in {saved} were trained on {base} (weights SHA-256 {reference['base_sha256'][:16]}...), and this run's base is {other}"),
        (["--model.lora", '{"rank": 4}'], "`model.lora.rank`: the adapters in"),
        (["--model.lora", '{"rank": 8, "alpha": 8}'], "`model.lora.alpha`: the adapters in"),
        ([], f"{saved} holds LoRA adapters (rank 8 on {base}), and this run has no `model.lora`"),
    ):  # fmt: skip
        code, err = yatt_in_process(["fit", "--config", grpo, *at, *extra], cwd=tmp_path)
        assert code == 2 and screen in err, (extra, err[-2000:])
    code, err = yatt_in_process(["export", "--ckpt_dir", str(saved), "--out", str(tmp_path / "x"), "--base", str(other)],
                                cwd=tmp_path)  # fmt: skip
    assert code != 0 and f"`--base`: {other} is not the base the adapters in {saved}" in err, err[-2000:]


@pytest.mark.slow
def test_sft_trains_adapters_and_saves_only_them(tmp_path):
    """configs/sft_tiny.yaml with `model.lora`: 10 steps lower the answers' loss by more than 0.5 nats a token,
    and the checkpoint holds the adapters (and their optimizer) only, with its base named."""
    from tests.helpers import read_scalars, yatt
    from yatt_lightning.checkpoint import folder as ckpt
    from yatt_lightning.checkpoint.export import read_model_tensors

    yatt(["fit", "--config", str(REPO / "configs" / "sft_tiny.yaml"), "--trainer.max_steps", "10",
          "--model.init_args.lora", '{"rank": 8}', "--model.init_args.optimizer.lr", "1e-2",
          "--data.init_args.val_task", "null", "--trainer.num_sanity_val_steps", "0",
          "--trainer.default_root_dir", str(tmp_path)], cwd=tmp_path)  # fmt: skip
    loss = [v for _, v in read_scalars(tmp_path)["sft/loss"]]
    assert len(loss) == 10 and sum(loss[-3:]) / 3 < loss[0] - 0.5, loss
    saved = ckpt.tracked(tmp_path / "sft_tiny" / "checkpoints")
    assert (saved / "lora_base.json").is_file()
    assert len(tensors := read_model_tensors(saved / ckpt.WEIGHTS)) == 14 and all(".lora." in k for k in tensors)


def test_what_lora_cannot_run_is_refused_before_start(tmp_path):
    from tests.helpers import yatt_in_process

    def fit(*lora: str, more: tuple[str, ...] = ()) -> tuple[int, str]:  # the tiny model: nothing to build
        config = ["--config", str(REPO / "configs" / "grpo_tiny.yaml"), "--model.init_args.lora", *lora]
        return yatt_in_process(["fit", *config, *more], cwd=tmp_path)

    placement = ("--trainer.devices", "2", "--trainer.strategy.placement", "yatt_lightning.placement.PartialColocation")
    code, err = fit('{"rank": 8}', more=placement)
    assert code == 2 and "`model.lora` with `trainer.strategy.placement: PartialColocation` is not supported" in err, err
    code, err = fit('{"target_modules": ["qkv"]}')
    assert code == 2 and "`model.lora.target_modules`: ['qkv'] is not a projection" in err, err
    code, err = fit('{"rank": 4}', more=("--model.policy.path", "builtin:tiny-qwen3-moe"))
    assert code == 2 and "is a mixture of experts (8 experts), and adapters on its experts (gate_proj, up_proj, down_proj)" in err, err
    code, err = fit('{"rank": 100}')
    assert code == 2 and "`model.lora.rank` (100) exceeds what k_proj of" in err and "rank at most 64" in err, err
