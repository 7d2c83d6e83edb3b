"""Non-finite losses and gradient norms at run time (trinity.trainer.nonfinite) through the real engine: a tiny
Qwen2 on CPU, megatron-core's optimizers (and the host optimizer of SFT's optimizer_offload). A non-finite
update is never applied; the run stops with one line naming the step and the phase, or skips up to
trainer.skip_nonfinite_steps such steps; every rank decides alike (PP=2: the loss exists on the last stage only)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from trinity.config.megatron import MegatronConfig
from trinity.config.roles import Role
from trinity.config.schema import OptimConfig
from trinity.errors import UserError
from trinity.trainer.nonfinite import NonFiniteGuard
from trinity.trainer.recipes.sft import SFTLoss, TokenRows

FIX = "check this step's data, or set trainer.skip_nonfinite_steps to skip such steps"


class Poisoned(SFTLoss):
    """SFT's loss, made non-finite in one of three ways: `loss_nan` / `loss_inf` add a constant (the gradients
    stay finite: only the loss shows it), `grad_nan` adds sqrt(0 x logits), 0 with a nan gradient."""

    def __init__(self, vocab_size: int, how: str | None):
        super().__init__(vocab_size)
        self.how = how

    def __call__(self, batch, logits, *, denom, scale):
        loss, metrics = super().__call__(batch, logits, denom=denom, scale=scale)
        if self.how in ("loss_nan", "loss_inf"):
            loss = loss + float("nan" if self.how == "loss_nan" else "inf")
        elif self.how == "grad_nan":
            loss = loss + torch.sqrt((logits * 0).square().sum())
        return loss, metrics


def batches(step: int, vocab: int) -> list[TokenRows]:
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(2):
        tokens = torch.randint(1, vocab, (1, 12), generator=g)
        out.append(TokenRows(tokens, torch.arange(12).unsqueeze(0), torch.zeros(1, 12, dtype=torch.long),
                             tokens.roll(-1, 1), torch.ones(1, 12), torch.device("cpu")))
    return out


def engine(facts, path, guard: NonFiniteGuard, *, role: Role = Role.actor, on_host: bool = False, clip: float = 1.0,
           pp: int = 1):
    from trinity.convert.builtin import load_hf_weights
    from trinity.models.build import build_model
    from trinity.trainer.engine import RoleEngine

    m = MegatronConfig(optimizer_offload=on_host, pipeline_model_parallel_size=pp)
    chunks = build_model(facts, m, device="cpu", dtype=torch.float32)
    load_hf_weights(chunks, path, facts)
    return RoleEngine(role, chunks, m, OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=clip), dtype=torch.float32,
                      total_steps=10, optimizer_on_host=on_host, nonfinite=guard)


def weights(e) -> list[torch.Tensor]:
    return [p.detach().clone() for m in e.modules for p in m.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def step(e, facts, n: int, how: str | None):
    e.advance_schedule()
    # 2 micro batches x DP 1 / 48: each micro batch's token sum / 24
    return e.train_batch(batches(n, facts.vocab_size), Poisoned(facts.vocab_size, how), denom=48)


@pytest.mark.parametrize("how,on_host,clip,what", [
    ("loss_nan", False, 1.0, "the loss is nan"),
    ("loss_inf", True, 1.0, "the loss is inf"),
    ("grad_nan", False, 0.0, "the gradient norm is nan"),  # clip 0: megatron-core's step measures no norm
    ("grad_nan", True, 0.0, "the gradient norm is nan"),
])
def test_nonfinite_update_stops_naming_step_and_phase(tiny_qwen2_tp1, how, on_host, clip, what):
    facts, path = tiny_qwen2_tp1
    guard = NonFiniteGuard()
    e = engine(facts, path, guard, on_host=on_host, clip=clip)
    guard.start(1)
    first = step(e, facts, 1, None)
    assert not first.skipped and 0 < first.grad_norm < 1e3  # measured with clip_grad 0 too
    guard.saved_at(1)
    guard.start(2)
    before = weights(e)
    with pytest.raises(UserError) as err:
        step(e, facts, 2, how)
    assert str(err.value) == (f"step 2, update_actor: {what}; nothing was saved past step 1. "
                              f"Lower actor_rollout_ref.actor.optim.lr, {FIX}")
    assert same(before, weights(e))  # the update was not applied


def test_skips_up_to_the_budget_then_stops(tiny_qwen2_tp1):
    facts, path = tiny_qwen2_tp1
    lines: list[str] = []
    guard = NonFiniteGuard(1, log=lines.append)
    e = engine(facts, path, guard, role=Role.critic)  # a critic's update: its phase and its lr
    before = weights(e)
    guard.start(1)
    for _ in range(2):  # two non-finite updates of one step count as one skipped step
        result = step(e, facts, 1, "loss_nan")
        assert result.skipped and same(before, weights(e))
    assert guard.metrics() == {"skipped_nonfinite_steps": 1}
    assert lines[0] == "step 1, update_critic: the loss is nan; the update was skipped (1 of " \
                       "trainer.skip_nonfinite_steps = 1 steps)"
    guard.start(2)
    result = step(e, facts, 2, None)
    assert not result.skipped and not same(before, weights(e))
    guard.start(3)
    with pytest.raises(UserError) as err:
        step(e, facts, 3, "grad_nan")
    assert str(err.value) == ("step 3, update_critic: the gradient norm is nan after 1 skipped steps "
                              "(trainer.skip_nonfinite_steps = 1); nothing was saved. Lower critic.optim.lr, check this "
                              "step's data, or raise trainer.skip_nonfinite_steps to skip such steps")


def test_non_finite_weights_are_never_written(tiny_qwen2_tp1):
    facts, path = tiny_qwen2_tp1
    guard = NonFiniteGuard()
    e = engine(facts, path, guard)
    guard.start(4)
    guard.check_weights({"actor": e}, "save", torch.device("cpu"))  # finite: nothing to say
    with torch.no_grad():
        next(e.modules[0].parameters())[0].fill_(float("inf"))
    with pytest.raises(UserError) as err:
        guard.check_weights({"actor": e}, "export", torch.device("cpu"))
    assert str(err.value) == ("step 4, export: the actor weights are not finite; nothing was saved. "
                              "Lower actor_rollout_ref.actor.optim.lr")


def _pp_worker(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.facts import ModelFacts

    init_parallel(device="cpu", layout=MegatronConfig(pipeline_model_parallel_size=2).layout(), seed=3)
    try:
        facts = ModelFacts.from_hf_dir(model_dir)
        guard = NonFiniteGuard()
        e = engine(facts, model_dir, guard, pp=2)
        guard.start(5)
        before = weights(e)
        try:
            step(e, facts, 5, "loss_nan")  # only the last stage computes the loss; the gradients stay finite
            message = None
        except UserError as exc:
            message = str(exc)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"message": message, "same": same(before, weights(e))}))
    finally:
        destroy()


@pytest.mark.multiproc
@pytest.mark.slow
def test_pipeline_stages_decide_alike(tmp_path):
    from tests.conftest import run_two_ranks
    from trinity.testing.tiny_models import make_tiny_hf_model

    model_dir = make_tiny_hf_model("qwen2", tmp_path / "qwen2", num_hidden_layers=2)
    run_two_ranks(_pp_worker, str(model_dir), str(tmp_path))
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"message": f"step 5, update_actor: the loss is nan; nothing was saved. "
                                  f"Lower actor_rollout_ref.actor.optim.lr, {FIX}", "same": True}, (rank, got)
