"""Offload between RL phases on CPU: storages really freed, host copies kept, training unchanged."""

from __future__ import annotations

import pytest
import torch

from trinity.config.megatron import MegatronConfig
from trinity.config.schema import ActorConfig, OptimConfig
from trinity.rollout.reference import reference_generate
from trinity.rollout.types import SamplingParams
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


def _steps(facts, path, offload: bool, distributed: bool = True, n: int = 3, watch=None) -> list[float]:
    """n GRPO-like steps (rollout, old log-probs, actor update of 2 optimizer steps) with every part
    offloaded between phases, as the RL recipes' phases move them (the update phase asks for params and
    grads; the engine brings the optimizer states back for each optimizer step). `watch(state, off)`: a
    hook before the steps."""
    from trinity.trainer.recipes.rl_update import Experience, actor_update
    from trinity.trainer.recipes.rollout_forward import infer_logprobs

    state = _state(facts, path, distributed)
    off = RoleOffloader(state.model, state.optimizer, param_offload=offload, grad_offload=offload, optimizer_offload=offload)
    state.offloader = off
    if watch is not None:
        watch(state, off)
    cfg = ActorConfig(ppo_mini_batch_size=2)
    losses = []
    for step in range(n):
        off.need(params=True)
        ro = reference_generate(state.model[0], PROMPTS, SamplingParams(max_new_tokens=5), vocab_size=facts.vocab_size, pad_id=0,
                      generator=torch.Generator().manual_seed(step))
        off.need(params=False)  # e.g. the ref's phase
        off.need(params=True)
        old = infer_logprobs(state.model, ro, facts.vocab_size, 2)
        adv = torch.linspace(-1, 1, 4).unsqueeze(1) * ro.response_mask
        off.need(params=True, grads=True)
        state.scheduler.step(1)
        m = actor_update(state, Experience(ro, old, adv, adv), cfg, facts.vocab_size, seqs_per_update=2, micro=1).metrics
        losses.append(m["actor/pg_loss"])
    off.need(params=False)
    return losses


@pytest.mark.parametrize("distributed", [True, False])
def test_losses_identical_with_and_without_offload(facts_path, distributed):
    facts, path = facts_path
    plain = _steps(facts, path, offload=False, distributed=distributed)
    moved = _steps(facts, path, offload=True, distributed=distributed)
    assert plain == moved and len(plain) == 3 and any(x != 0 for x in plain)


def test_optimizer_states_are_on_the_device_only_for_each_optimizer_step(facts_path):
    # A 7B GRPO update at DP=4 ran out of memory with its Adam states (21 GiB) on the GPU beside the
    # micro batches' activations: they now come back only for the step, and go right after it.
    facts, path = facts_path
    forward, step, after = [], [], []

    def watch(state, off):
        def optim_bytes(into: list[int]) -> None:
            into.append(off.device_bytes()["optim"])

        def on_forward(*_):
            if torch.is_grad_enabled():  # the update's forwards, not the old log-prob passes
                optim_bytes(forward)

        state.chunks[0].register_forward_hook(on_forward)
        inner_step, inner_train = state._step, state.train_batch

        def stepped(code):
            optim_bytes(step)
            return inner_step(code)

        def train_batch(*a, **k):
            result = inner_train(*a, **k)
            optim_bytes(after)
            return result

        state._step, state.train_batch = stepped, train_batch

    losses = _steps(facts, path, offload=True, watch=watch)
    assert len(step) == 6 and len(after) == 6 and forward  # 3 updates of 2 optimizer steps
    # Adam's moments exist from the first step on: on the device for every later step, never in a forward
    assert step[0] == 0 and all(b > 0 for b in step[1:]), step
    assert set(forward) == {0} and set(after) == {0}, (forward, after)
    assert losses == _steps(facts, path, offload=False)


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


# ---------------------------------------------------------------- SFT: optimizer_offload = optimizer on the host


def _sft_engine(facts, path, distributed: bool, on_host: bool):
    from trinity.config.roles import Role
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model
    from trinity.trainer.engine import RoleEngine

    m = MegatronConfig(use_distributed_optimizer=distributed, optimizer_offload=on_host)
    chunks = build_model(facts, m, device="cpu", dtype=torch.float32)
    load_hf_weights(chunks, path, facts)
    # clip_grad small enough that clipping acts: the host step must scale the gradients as megatron does
    return RoleEngine(Role.actor, chunks, m, OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5),
                      dtype=torch.float32, total_steps=10, optimizer_on_host=on_host)


def _sft_batches(step: int, vocab: int) -> list:
    from trinity.trainer.recipes.sft import TokenRows

    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(2):  # two micro batches: gradients accumulate before the host step
        tokens = torch.randint(1, vocab, (1, 12), generator=g)
        out.append(TokenRows(tokens, torch.arange(12).unsqueeze(0), torch.zeros(1, 12, dtype=torch.long),
                             tokens.roll(-1, 1), torch.ones(1, 12), torch.device("cpu")))
    return out


def _sft_run(engine, facts, steps: int = 3) -> list[tuple[float, float]]:
    from trinity.trainer.recipes.sft import train_step

    return [train_step(engine, _sft_batches(s, facts.vocab_size), loss_tokens=24, device=torch.device("cpu"),
                       vocab_size=facts.vocab_size) for s in range(steps)]


@pytest.mark.parametrize("distributed", [False, True])
def test_sft_optimizer_on_host_computes_the_same_update(facts_path, distributed, monkeypatch):
    """The host step (grads copied out in several buckets, clipped, AdamW on host masters, weights copied
    back) gives the losses, grad norms and weights of megatron-core's own step."""
    from trinity.trainer.engine import host_optimizer

    facts, path = facts_path
    plain = _sft_engine(facts, path, distributed, on_host=False)
    expected = _sft_run(plain, facts)
    monkeypatch.setattr(host_optimizer, "BUCKET_BYTES", 4096)  # several buckets on the tiny model
    moved = _sft_engine(facts, path, distributed, on_host=True)
    assert moved.host is not None and len(moved.host.buckets) > 2
    got = _sft_run(moved, facts)
    assert plain.host is None
    for (l0, g0), (l1, g1) in zip(expected, got):
        assert l1 == pytest.approx(l0, rel=1e-6) and g1 == pytest.approx(g0, rel=1e-6)
    assert expected[0][1] > 0.5  # the clip acted
    assert expected[-1][0] != expected[0][0]  # the weights moved
    for (n, a), (_, b) in zip(plain.modules[0].named_parameters(), moved.modules[0].named_parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=n)
    # Masters and Adam states are host tensors of their own, none shares a model parameter's storage.
    model = {p.untyped_storage().data_ptr() for p in moved.modules[0].parameters()}
    held = list(moved.host.host_tensors())
    assert len(held) == 4 * len(moved.host.entries)  # master, step, exp_avg, exp_avg_sq
    assert all(t.device.type == "cpu" and t.untyped_storage().data_ptr() not in model for t in held)


def test_sft_optimizer_on_host_saves_and_resumes(facts_path, tmp_path):
    """A checkpoint of the host optimizer loads into a fresh one (torch puts loaded states beside their
    parameters: `relocate` brings them back to the host) and the next step equals the uninterrupted one."""
    facts, path = facts_path
    first = _sft_engine(facts, path, distributed=True, on_host=True)
    _sft_run(first, facts, steps=2)
    first.save(tmp_path / "ckpt", hf_dir=path, extra={"step": 2}, meta={"kind": "training", "role": "actor", "step": 2})
    resumed = _sft_engine(facts, path, distributed=True, on_host=True)
    assert resumed.load(tmp_path / "ckpt")["step"] == 2
    model = {p.untyped_storage().data_ptr() for p in resumed.modules[0].parameters()}
    held = list(resumed.host.host_tensors())
    assert len(held) == 4 * len(resumed.host.entries)
    assert all(t.device.type == "cpu" and t.untyped_storage().data_ptr() not in model for t in held)
    for e_first, e_resumed in zip(first.host.entries, resumed.host.entries):
        assert torch.equal(e_first.host, e_resumed.host)
    from trinity.trainer.recipes.sft import train_step

    resumed.scheduler.load_state_dict(first.scheduler.state_dict())  # the checkpoint manager's part
    for step in (7, 8):  # the second loss depends on the first update: loaded moments and step counts
        batch = _sft_batches(step, facts.vocab_size)
        a = train_step(first, batch, loss_tokens=24, device=torch.device("cpu"), vocab_size=facts.vocab_size)
        b = train_step(resumed, batch, loss_tokens=24, device=torch.device("cpu"), vocab_size=facts.vocab_size)
        assert b == pytest.approx(a, rel=1e-6), step


def test_a_phase_frees_every_roles_parts_before_any_role_reloads(facts_path, monkeypatch):
    # The update phase after the ref phase: the ref's params must be gone before the actor's grad buffer
    # comes back (on a GPU the two together ran a 7B GRPO job out of memory).
    from trinity.config.roles import Role
    from trinity.models.build import build_model
    from trinity.trainer.engine import RoleEngine
    from trinity.trainer.recipes.rl import Phases

    facts, path = facts_path
    flags = MegatronConfig(param_offload=True, grad_offload=True, optimizer_offload=True)
    actor = _state(facts, path, distributed=True)
    actor.offloader = RoleOffloader(actor.model, actor.optimizer, param_offload=True, grad_offload=True,
                                    optimizer_offload=True)
    ref = RoleEngine(Role.ref, build_model(facts, flags, device="cpu", dtype=torch.float32), flags, None,
                     dtype=torch.float32, total_steps=1)

    def ref_bytes() -> int:
        return sum(p.untyped_storage().nbytes() for p in ref.chunks[0].parameters())

    seen: list[int] = []
    set_grads = actor.offloader._set_grads

    def watch(resident: bool) -> None:
        if resident and not actor.offloader.on_grads:
            seen.append(ref_bytes())
        set_grads(resident)

    monkeypatch.setattr(actor.offloader, "_set_grads", watch)
    phases = Phases(torch.device("cpu"), {"actor": actor, "ref": ref})
    phases.run("rollout", {"actor": {"params": True}}, lambda: None)
    phases.run("ref", {"ref": {"params": True}}, lambda: None)
    assert ref_bytes() > 0 and actor.offloader.device_bytes()["params"] == 0
    phases.run("update_actor", {"actor": {"params": True, "grads": True, "optim": True}}, lambda: None)
    assert seen == [0] and ref_bytes() == 0 and actor.offloader.device_bytes()["grads"] > 0
