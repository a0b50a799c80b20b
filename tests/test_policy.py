"""Tier 2 (one process, gloo): the Megatron policy against Hugging Face transformers on the tiny model."""

import socket

import pytest
import torch

from yatt_lightning.models.logprobs import token_entropy, token_logprobs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def megatron_world(monkeypatch):
    from megatron.core import parallel_state as ps

    from yatt_lightning.models.cpu import megatron_cpu_context

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    with megatron_cpu_context():
        ps.initialize_model_parallel(1, 1)
    yield


@pytest.fixture
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)


def _policy(path, lr=1e-3, one_storage=False):
    from yatt_lightning.models.optim import OptimizerSettings
    from yatt_lightning.models.policy import MegatronPolicy

    return MegatronPolicy(path, optimizer=OptimizerSettings(lr=lr, clip_grad=0.0), one_storage=one_storage)


def _logits_of(policy, ids):
    out = []

    def keep(mb, logits):
        out.append(logits.detach())
        return torch.zeros(()), torch.tensor(1), {}

    policy.forward_backward([{"input_ids": ids}], keep, forward_only=True)
    return out[0]


def test_megatron_logits_match_transformers(megatron_world, tiny_model_path, hf_model):
    policy = _policy(tiny_model_path)
    ids = torch.randint(0, 290, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(ids).logits
    torch.testing.assert_close(_logits_of(policy, ids), expected, atol=2e-5, rtol=1e-5)


def test_export_returns_the_checkpoint_tensors(megatron_world, tiny_model_path):
    from safetensors.torch import load_file

    policy = _policy(tiny_model_path)
    exported = dict(policy.export_hf())
    original = load_file(str(tiny_model_path / "model.safetensors"))
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_logprobs_and_entropy_of_logits(megatron_world):
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(token_logprobs(logits, targets, 0.7), ref)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(token_entropy(logits), -(p * p.log()).sum(-1))


def test_token_level_loss_aggregation_matches_a_plain_torch_reference(megatron_world, tiny_model_path, hf_model):
    """Two micro-batches holding 3 and 1 loss tokens. The gradient must be that of
    sum(per-token loss) / 4 over all tokens of the step (not the mean of per-micro-batch means)."""
    policy = _policy(tiny_model_path)
    mbs = [
        {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "mask": torch.tensor([[0.0, 1.0, 1.0, 1.0]])},
        {"input_ids": torch.tensor([[11, 12, 13]]), "mask": torch.tensor([[0.0, 1.0]])},
    ]

    def loss_fn(mb, logits):
        lp = token_logprobs(logits[:, :-1], mb["input_ids"][:, 1:])
        return (-lp * mb["mask"]).sum(), mb["mask"].sum().int(), {}

    policy.zero_grad_buffers()
    policy.forward_backward(mbs, loss_fn, forward_only=False)
    megatron_grad = policy.local_module().output_layer.weight.main_grad.clone()

    total = 0
    for mb in mbs:
        logits = hf_model(mb["input_ids"]).logits[:, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, mb["input_ids"][:, 1:, None])[..., 0]
        total = total + (-lp * mb["mask"]).sum()
    (total / 4).backward()
    torch.testing.assert_close(megatron_grad, hf_model.lm_head.weight.grad, atol=1e-6, rtol=1e-4)


def _train_one_step(policy) -> tuple[bool, float]:
    """One optimizer step of next-token likelihood on random ids."""
    ids = torch.randint(0, 290, (2, 8))

    def loss_fn(mb, logits):
        lp = token_logprobs(logits[:, :-1], mb["input_ids"][:, 1:])
        return -lp.sum(), torch.tensor(lp.numel(), dtype=torch.int), {}

    policy.zero_grad_buffers()
    policy.forward_backward([{"input_ids": ids}], loss_fn, forward_only=False)
    return policy.optimizer_step(0)


def test_optimizer_step_changes_weights(megatron_world, tiny_model_path):
    policy = _policy(tiny_model_path, one_storage=True)
    before = {k: v.clone() for k, v in policy.export_hf()}
    applied, grad_norm = _train_one_step(policy)
    after = dict(policy.export_hf())
    assert applied and grad_norm > 0
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before)
    storages = {p.untyped_storage().data_ptr() for p in policy.local_module().parameters()}
    assert len(storages) == 1  # updated in place: a publish still sends the policy as one storage


def test_the_rollout_rank_renames_the_parameters_sent_as_they_are_to_the_export(megatron_world, tiny_model_path):
    """A trainer of one model-parallel rank sends its parameters' one storage as it is; the rollout rank
    renames them (q, k and v flattened out of the fused QKV into buffers it reuses) to exactly the export."""
    from yatt_lightning.placement.weight_buckets import BufferPool, fill, layout, unpack
    from yatt_lightning.placement.weight_channel import renamed

    policy = _policy(tiny_model_path, one_storage=True)
    named = policy.local_tensors()
    entries, sizes = layout(named, bucket_bytes=1 << 20, direct_bytes=1 << 20)
    sent = list(fill(named, entries, sizes, lambda size: torch.empty(size, dtype=torch.uint8)))
    assert sizes == [sum(t.numel() * 4 for _, t in named)] and not sent[0][1]  # one message, not a copy
    pool = BufferPool()
    got, copies = renamed(unpack(entries, [sent[0][0].clone()]), policy.hf_names, pool)
    exported = list(policy.export_hf())
    assert [n for n, _ in got] == [n for n, _ in exported]
    assert all(torch.equal(a, b) and a.shape == b.shape for (_, a), (_, b) in zip(got, exported, strict=True))
    layers = policy.arch.num_layers
    assert len(copies) == 6 * layers  # q, k, v of each layer's weight and bias (2 query groups: not views)
    pool.put(copies)
    _, again = renamed(unpack(entries, [sent[0][0].clone()]), policy.hf_names, pool)
    assert {c.data_ptr() for c in again} == {c.data_ptr() for c in copies}  # the next version reuses them


def test_offload_releases_the_training_state_and_onload_restores_it_bitwise(megatron_world, tiny_model_path):
    """On CPU too: grads and the optimizer's moments (and with ``params`` the weights) lose their storage
    while the engine runs, so whatever reads them then (a save) fails loudly, and come back bitwise."""
    policy = _policy(tiny_model_path)
    _train_one_step(policy)
    moments = policy._offloadable(params=False)
    assert moments, "Adam's moments after a step"
    before = [t.clone() for t in moments]
    aliases = [t.detach() for t in moments]  # what an asynchronous checkpoint's writer reads
    weights = {k: v.clone() for k, v in policy.export_hf()}
    policy.offload(params=True)
    assert policy.offloaded and all(t.untyped_storage().nbytes() == 0 for t in moments)
    assert all(torch.equal(a, b) for a, b in zip(aliases, before, strict=True))  # on CPU nothing is copied
    assert all(p.untyped_storage().nbytes() == 0 for p in policy.model.parameters())
    policy.offload(params=True)  # twice: a second round of dynamic sampling
    policy.onload()
    assert not policy.offloaded and all(torch.equal(a, b) for a, b in zip(moments, before, strict=True))
    assert all(torch.equal(v, weights[k]) for k, v in policy.export_hf())
    assert all(float(b.grad_data.abs().sum()) == 0 for b in policy.model.buffers)  # grads come back zeroed
