"""RL on one GPU: GRPO-style steps with offload off/on give the same losses, and offload releases memory.

Run on a GPU machine: `python -m pytest tests/gpu/test_rl_gpu.py -q -s` (prints time and memory per phase).
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT_LEN, NEW_TOKENS, BATCH = 64, 32, 16


@pytest.fixture(scope="module")
def setup(qwen2_small_cuda):
    return qwen2_small_cuda


def _state(facts, path):
    from trinity.config.megatron import MegatronConfig
    from trinity.config.schema import OptimConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model
    from trinity.config.roles import Role
    from trinity.trainer.engine import RoleEngine

    m = MegatronConfig()
    chunks = build_model(facts, m, device="cuda", dtype=torch.bfloat16)
    load_hf_weights(chunks, path, facts)
    return RoleEngine(Role.actor, chunks, m, OptimConfig(lr=1e-5, weight_decay=0.0), dtype=torch.bfloat16, total_steps=10)


def _phase(name: str, log: dict, fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    log[name] = (time.perf_counter() - t0, torch.cuda.memory_allocated() / 2**30)
    return out


def _run(facts, path, offload: bool, steps: int = 2):
    from trinity.config.schema import ActorConfig
    from trinity.rollout.reference import reference_generate
    from trinity.rollout.types import SamplingParams
    from trinity.trainer.engine.offload import RoleOffloader
    from trinity.trainer.recipes.rl_update import Experience, actor_update
    from trinity.trainer.recipes.rollout_forward import infer_logprobs

    state = _state(facts, path)
    off = RoleOffloader(state.model, state.optimizer, param_offload=offload, grad_offload=offload, optimizer_offload=offload)
    state.offloader = off  # the engine brings the optimizer states back for its step itself, as in a job
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, facts.vocab_size, (BATCH, PROMPT_LEN), generator=g).tolist()
    losses, logs, released = [], [], []
    for step in range(steps):
        log: dict = {}
        off.need(params=True)
        ro = _phase("rollout", log, lambda: reference_generate(state.model[0], prompts, SamplingParams(max_new_tokens=NEW_TOKENS),
                                                      vocab_size=facts.vocab_size, pad_id=0, generator=torch.Generator().manual_seed(step)))
        old = _phase("old_logp", log, lambda: infer_logprobs(state.model, ro, facts.vocab_size, 4))
        adv = torch.linspace(-1, 1, BATCH, device="cuda").unsqueeze(1) * ro.response_mask
        off.need(params=True, grads=True)  # the update phase's needs (trinity.trainer.recipes.rl)
        state.scheduler.step(1)
        m = _phase("update", log, lambda: actor_update(state, Experience(ro, old, adv, adv), ActorConfig(ppo_mini_batch_size=BATCH),
                                                        facts.vocab_size, seqs_per_update=BATCH, micro=4).metrics)
        losses.append(m["actor/pg_loss"])
        optim_after = off.device_bytes()["optim"]  # offload: gone right after the optimizer step
        before = torch.cuda.memory_allocated()
        off.need(params=False)
        released.append((before - torch.cuda.memory_allocated(), sum(off.device_bytes().values()), optim_after))
        logs.append(log)
    off.need(params=True, grads=True, optim=True)
    del state, off
    gc.collect()  # megatron's DDP hooks hold reference cycles: free this state before the next run
    torch.cuda.empty_cache()
    return losses, logs, released


def test_offload_same_losses_and_releases_memory(setup):
    facts, path = setup
    plain, logs_off, _ = _run(facts, path, offload=False)
    moved, logs_on, released = _run(facts, path, offload=True)
    for name, logs in (("offload off", logs_off), ("offload on", logs_on)):
        print(name, {k: f"{t:.3f}s {mem:.2f}GiB" for k, (t, mem) in logs[-1].items()})
    assert plain == moved
    n_params = facts.num_parameters()
    # the optimizer states (fp32 main params and two Adam moments, 12 B) left with the optimizer step; the
    # phase after the update frees bf16 params (2 B) + fp32 grads (4 B)
    for freed, left, optim_after in released:
        print(f"released {freed / 2**30:.3f} GiB, expected about {n_params * 6 / 2**30:.3f} GiB")
        assert left == 0 and optim_after == 0
        assert freed >= 0.9 * n_params * 6

