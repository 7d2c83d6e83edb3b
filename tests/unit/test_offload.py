"""Offload between RL phases on CPU: storages really freed, host copies kept, training unchanged."""

from __future__ import annotations

import pytest
import torch

from trinity.config.megatron import MegatronConfig
from trinity.config.schema import ActorConfig, OptimConfig
from trinity.rollout.generate import SamplingParams, generate
from trinity.trainer.engine.offload import RoleOffloader, optimizer_tensors

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]]


@pytest.fixture(scope="module")
def facts_path(tiny_qwen2_tp1):
    return tiny_qwen2_tp1


def _state(facts, path, distributed: bool):
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model
    from trinity.config.roles import Role
    from trinity.trainer.engine import RoleEngine

    m = MegatronConfig(use_distributed_optimizer=distributed)
    chunks = build_model(facts, m, device="cpu", dtype=torch.float32)
    load_hf_weights(chunks, path, facts)
    return RoleEngine(Role.actor, chunks, m, OptimConfig(lr=1e-3, weight_decay=0.0), dtype=torch.float32, total_steps=10)


def _steps(facts, path, offload: bool, distributed: bool = True, n: int = 3) -> list[float]:
    """n GRPO-like steps (rollout, old log-probs, actor update) with every part offloaded between phases."""
    from trinity.trainer.recipes.rl_update import Experience, actor_update
    from trinity.trainer.recipes.rollout_forward import infer_logprobs

    state = _state(facts, path, distributed)
    off = RoleOffloader(state.model, state.optimizer, param_offload=offload, grad_offload=offload, optimizer_offload=offload)
    cfg = ActorConfig(ppo_mini_batch_size=2)
    losses = []
    for step in range(n):
        off.need(params=True)
        ro = generate(state.model[0], PROMPTS, SamplingParams(max_new_tokens=5), vocab_size=facts.vocab_size, pad_id=0,
                      generator=torch.Generator().manual_seed(step))
        off.need(params=False)  # e.g. the ref's phase
        off.need(params=True)
        old = infer_logprobs(state.model, ro, facts.vocab_size, 2)
        adv = torch.linspace(-1, 1, 4).unsqueeze(1) * ro.response_mask
        off.need(params=True, grads=True, optim=True)
        state.scheduler.step(1)
        m = actor_update(state, Experience(ro, old, adv, adv), cfg, facts.vocab_size, seqs_per_update=2, micro=1)
        losses.append(m["actor/pg_loss"])
    off.need(params=False)
    return losses


@pytest.mark.parametrize("distributed", [True, False])
def test_losses_identical_with_and_without_offload(facts_path, distributed):
    facts, path = facts_path
    plain = _steps(facts, path, offload=False, distributed=distributed)
    moved = _steps(facts, path, offload=True, distributed=distributed)
    assert plain == moved and len(plain) == 3 and any(x != 0 for x in plain)


def test_offload_frees_storages_and_keeps_host_copies(facts_path):
    facts, path = facts_path
    state = _state(facts, path, distributed=True)
    off = RoleOffloader(state.model, state.optimizer, param_offload=True, grad_offload=True, optimizer_offload=True)
    # one real step so Adam's state exists
    _ = [c.zero_grad_buffer() for c in state.model]
    logits = state.model[0](torch.tensor([[1, 2, 3]]), torch.arange(3).unsqueeze(0), None)
    logits.float().square().mean().backward()
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(state.model)
    assert state.optimizer.step()[0]
    before = {n: p.detach().clone() for n, p in state.model[0].module.named_parameters()}
    moments = [t.clone() for t in optimizer_tensors(state.optimizer)]

    off.need(params=False)
    params = list(state.model[0].parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    assert all(b.grad_data.untyped_storage().nbytes() == 0 for b in state.model[0].buffers)
    opt_tensors = list(optimizer_tensors(state.optimizer))
    state_tensors = [t for t in opt_tensors if t.numel() > 1]
    assert state_tensors and all(t.untyped_storage().nbytes() == 0 for t in state_tensors)
    assert off.device_bytes() == {"params": 0, "grads": 0, "optim": 0}
    host = [m.host for m in off._params + list(off._optim.values())]
    assert all(h is not None and h.device.type == "cpu" and h.numel() > 0 for h in host)

    off.need(params=True)  # rollout: params back, grads and optimizer stay off
    assert off.device_bytes()["params"] > 0 and off.device_bytes()["grads"] == 0 and off.device_bytes()["optim"] == 0
    for n, p in state.model[0].module.named_parameters():
        assert torch.equal(p, before[n]), n
    off.need(params=True, grads=True, optim=True)
    assert all(torch.equal(a, b) for a, b in zip(optimizer_tensors(state.optimizer), moments))
    assert all(torch.count_nonzero(b.grad_data) == 0 for b in state.model[0].buffers)


def _one_step(state) -> None:
    from megatron.core.distributed import finalize_model_grads

    _ = [c.zero_grad_buffer() for c in state.model]
    logits = state.model[0](torch.tensor([[1, 2, 3]]), torch.arange(3).unsqueeze(0), None)
    logits.float().square().mean().backward()
    finalize_model_grads(state.model)
    assert state.optimizer.step()[0]


def test_optimizer_state_created_after_first_offload_is_offloaded(facts_path):
    # An RL job offloads before its first update, when Adam's moments do not exist yet; the
    # moments made by that update must be offloaded by the next phase too.
    facts, path = facts_path
    state = _state(facts, path, distributed=True)
    off = RoleOffloader(state.model, state.optimizer, param_offload=True, grad_offload=True, optimizer_offload=True)
    off.need(params=True)  # rollout of step 0: grads and optimizer go before any state exists
    off.need(params=True, grads=True, optim=True)
    _one_step(state)
    moments = [v for inner in getattr(state.optimizer, "chained_optimizers", [state.optimizer])
               for st in inner.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
    assert moments and off.device_bytes()["optim"] > 0
    off.need(params=True)
    assert all(t.untyped_storage().nbytes() == 0 for t in moments)
    assert off.device_bytes()["optim"] == 0


def test_frozen_ref_params_offload(facts_path):
    from trinity.models.build import build_model

    facts, _ = facts_path
    (ref,) = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
    ref.requires_grad_(False)
    keep = {n: p.clone() for n, p in ref.named_parameters()}
    off = RoleOffloader([ref], None, param_offload=True)
    off.need(params=False)
    assert all(p.untyped_storage().nbytes() == 0 for p in ref.parameters())
    off.need(params=True)
    assert all(torch.equal(p, keep[n]) for n, p in ref.named_parameters())
