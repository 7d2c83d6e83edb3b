"""trinity.trainer.engine.setup: the LR schedule against its closed form, and grad clipping as the real
megatron-core optimizer applies it (world size 1 on CPU, gloo)."""

from __future__ import annotations

import math

import pytest
import torch

from trinity.config.megatron import MegatronConfig
from trinity.config.schema import OptimConfig
from trinity.trainer.engine.setup import build_scheduler


def _lrs(optim: OptimConfig, total_steps: int) -> dict[int, float]:
    """lr of each step k = 1..total_steps as the SFT loop uses it (scheduler.step(1) before step k)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    sched = build_scheduler(opt, optim, total_steps)
    out = {}
    for k in range(1, total_steps + 1):
        sched.step(increment=1)
        out[k] = opt.param_groups[0]["lr"]
    return out


def test_warmup_then_cosine_closed_form():
    lr, min_lr, warmup, total = 1e-3, 1e-4, 4, 20
    lrs = _lrs(OptimConfig(lr=lr, min_lr=min_lr, lr_warmup_steps=warmup, lr_scheduler="cosine"), total)

    def cosine(k: int) -> float:
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (k - warmup) / (total - warmup)))

    assert lrs[1] == pytest.approx(lr * 1 / warmup, rel=1e-12)  # linear warm-up from 0
    assert lrs[2] == pytest.approx(lr * 2 / warmup, rel=1e-12)
    assert lrs[warmup] == pytest.approx(lr, rel=1e-12)  # end of warm-up: the peak
    mid = warmup + (total - warmup) // 2
    assert lrs[mid] == pytest.approx((lr + min_lr) / 2, rel=1e-12) == cosine(mid)
    assert lrs[total - 1] == pytest.approx(cosine(total - 1), rel=1e-12)
    assert lrs[total] == pytest.approx(min_lr, rel=1e-12)  # the last step reaches min_lr
    assert all(lrs[k] > lrs[k + 1] for k in range(warmup, total))  # strictly decaying after the peak


def test_warmup_then_constant_and_short_runs():
    lr = 3e-3
    lrs = _lrs(OptimConfig(lr=lr, min_lr=1e-4, lr_warmup_steps=2, lr_scheduler="constant"), 10)
    assert lrs[1] == pytest.approx(lr / 2) and lrs[2] == pytest.approx(lr)
    assert all(lrs[k] == pytest.approx(lr) for k in range(2, 11))  # min_lr plays no part
    # No warm-up: the first step trains at the peak.
    assert _lrs(OptimConfig(lr=lr, lr_warmup_steps=0, lr_scheduler="constant"), 3) == pytest.approx({1: lr, 2: lr, 3: lr})
    # A warm-up as long as the run is cut to total_steps - 1, so the last step reaches the peak (then decays).
    short = _lrs(OptimConfig(lr=lr, min_lr=0.0, lr_warmup_steps=10, lr_scheduler="cosine"), 4)
    assert short == pytest.approx({1: lr / 3, 2: 2 * lr / 3, 3: lr, 4: 0.0})


# --- the real megatron-core optimizer at world size 1 on CPU ---------------------------------------


@pytest.fixture(scope="module")
def cpu_world(tmp_path_factory):
    from trinity.compat import cpu_compat
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.testing.tiny_models import make_tiny_hf_model

    was_enabled = cpu_compat.is_enabled()
    init_parallel(device="cpu", layout=ParallelLayout(), seed=3)
    try:
        yield make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2")
    finally:
        destroy()
        if not was_enabled:
            cpu_compat.disable()


def _train_state(model_dir, optim: OptimConfig, megatron: MegatronConfig):
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.trainer.engine.setup import build_train_state

    torch.manual_seed(3)
    chunks = build_model(ModelFacts.from_hf_dir(model_dir), megatron, device="cpu", dtype=torch.float32)
    return build_train_state(chunks, megatron, optim, dtype=torch.float32, total_steps=4)


def _chain(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _step(state, loss_scale: float):
    """One optimizer step on a fixed batch; returns (reported grad norm, grads as the optimizer got
    them before clipping, keyed by parameter)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from trinity.models.build import causal_mask

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).expand(2, 16)

    def forward_step(data_iterator, model):
        out = model(ids, pos, causal_mask(16), labels=ids)
        return out, lambda o: (o.float().mean() * loss_scale, {})

    seen: dict[torch.nn.Parameter, torch.Tensor] = {}
    original = state.optimizer.prepare_grads

    def prepare_grads():  # runs right before the norm and the clipping: the grads as they come
        found_inf = original()
        for opt in _chain(state.optimizer):
            for p in opt.get_parameters():
                seen[p] = p.grad.detach().clone()
        return found_inf

    state.optimizer.prepare_grads = prepare_grads
    try:
        for chunk in state.model:
            chunk.zero_grad_buffer()
        state.optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=None, model=state.model, num_microbatches=1,
            seq_length=16, micro_batch_size=2, forward_only=False,
        )
        state.scheduler.step(increment=1)
        ok, grad_norm, _ = state.optimizer.step()
    finally:
        del state.optimizer.prepare_grads
    assert ok and seen
    return grad_norm, seen


@pytest.mark.parametrize("clip", [1.0, 0.05])
def test_grad_norm_is_reported_before_clipping_and_the_update_uses_clipped_grads(cpu_world, clip):
    optim = OptimConfig(lr=1e-3, lr_warmup_steps=0, weight_decay=0.0, clip_grad=clip)
    state = _train_state(cpu_world, optim, MegatronConfig(use_distributed_optimizer=False))
    assert all(opt.config.clip_grad == clip for opt in _chain(state.optimizer))
    grad_norm, seen = _step(state, loss_scale=50.0)
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in seen.values()))
    assert float(grad_norm) == pytest.approx(norm, rel=1e-5)  # the norm before clipping
    assert norm > 10 * clip, "the test needs gradients far above the clip"
    coeff = clip / (norm + 1e-6)  # megatron-core's clip_grad_by_total_norm_fp32
    beta1 = optim.adam_beta1
    for opt in _chain(state.optimizer):
        for p in opt.get_parameters():
            clipped = seen[p] * coeff
            torch.testing.assert_close(p.grad, clipped, rtol=1e-5, atol=1e-9)  # clipped in place
            # What Adam used: its first moment after one step is (1 - beta1) x the gradient it got.
            exp_avg = opt.optimizer.state[p]["exp_avg"]
            torch.testing.assert_close(exp_avg, (1 - beta1) * clipped, rtol=1e-5, atol=1e-9)
    assert state.lr() == pytest.approx(optim.lr)


def test_no_clipping_below_the_threshold(cpu_world):
    optim = OptimConfig(lr=1e-3, lr_warmup_steps=0, weight_decay=0.0, clip_grad=1e6)
    state = _train_state(cpu_world, optim, MegatronConfig(use_distributed_optimizer=False))
    grad_norm, seen = _step(state, loss_scale=1.0)
    assert 0 < float(grad_norm) < 1e6
    for opt in _chain(state.optimizer):
        for p in opt.get_parameters():
            torch.testing.assert_close(opt.optimizer.state[p]["exp_avg"], (1 - optim.adam_beta1) * seen[p],
                                       rtol=1e-5, atol=1e-9)


def test_checkpoint_io_gathers_distributed_optimizer_state_on_cpu(cpu_world):
    """cpu_compat.checkpoint_io(): megatron-core's fully_reshardable gather
    (get_parameter_state_dp_zero(use_gloo_comm=False)) moves shards with `.cuda()`."""
    from trinity.compat import cpu_compat

    state = _train_state(cpu_world, OptimConfig(lr=1e-3), MegatronConfig(use_distributed_optimizer=True))
    _step(state, loss_scale=1.0)
    (opt,) = _chain(state.optimizer)
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            opt.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
    with cpu_compat.checkpoint_io():
        gathered = opt.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
    (world,) = gathered[0].values()  # buffer 0, keyed by its (param, grad) dtypes
    assert {"param", "exp_avg", "exp_avg_sq"} <= set(world)
    tensors = [world[k] for k in ("param", "exp_avg", "exp_avg_sq")]
    assert all(t.device.type == "cpu" and torch.isfinite(t).all() for t in tensors)
    assert world["exp_avg_sq"].abs().sum() > 0  # the state after one step, not zeros


def test_save_at_dp1_writes_megatrons_fully_reshardable_state_without_the_gather(cpu_world):
    """ReshardableOptimizer at DP=1 (trinity.trainer.engine.optimizer_state._own_model_space_state): the
    same ShardedTensors as megatron-core's gathering path (keys, shapes, offsets, replica ids, values),
    whose data are the optimizer's own tensors, not copies."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from trinity.convert.dist_ckpt import _flat_sharded
    from trinity.compat import cpu_compat
    from trinity.trainer.engine.optimizer_state import ReshardableOptimizer

    state = _train_state(cpu_world, OptimConfig(lr=1e-3), MegatronConfig(use_distributed_optimizer=True))
    _step(state, loss_scale=1.0)
    _step(state, loss_scale=1.0)
    flat, _ = _flat_sharded(state.model)
    with cpu_compat.checkpoint_io():
        ours = ReshardableOptimizer(state.optimizer).sharded_state_dict(flat)
        theirs = state.optimizer.sharded_state_dict(flat, metadata=ReshardableOptimizer.METADATA)
    (opt,) = _chain(state.optimizer)
    assert "sharded_param_state_fully_reshardable" not in vars(opt)  # the class method is back

    def states(sd):  # in megatron-core's order (a key names a stacked tensor of all layers: offsets differ)
        return [t for t in nested_values(sd) if hasattr(t, "key") and t.key.startswith("optimizer.state.")]

    a, b = states(ours), states(theirs)
    n_params = sum(1 for chunk in state.model for p in chunk.parameters() if p.requires_grad)
    assert len(a) == len(b) == 3 * n_params
    moments = {v.untyped_storage().data_ptr() for s in opt.optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0}
    for t, u in zip(a, b):
        key = t.key
        assert type(t) is type(u) and (t.key, t.replica_id) == (u.key, u.replica_id), key
        if isinstance(t, ShardedTensor):  # a factory (the SwiGLU fc1's halves) is built on save, from the same data
            assert (t.global_shape, t.global_offset, t.axis_fragmentations, t.dtype) == \
                   (u.global_shape, u.global_offset, u.axis_fragmentations, u.dtype), key
        assert torch.equal(t.data, u.data), key
        if ".exp_avg" in key:  # a view of the optimizer's moment, not a gathered copy
            assert t.data.untyped_storage().data_ptr() in moments, key
    assert any(t.data.abs().sum() > 0 for t in a if "exp_avg_sq" in t.key)


def test_checkpoint_at_dp1_loads_the_saved_optimizer_state_back(cpu_world, tmp_path):
    """The DP=1 path both ways (save, then load into the states in place): after a save, two more steps
    and a load, every main param and Adam moment is the saved one again, and a step from there equals
    the step taken right after the save."""
    from trinity.convert.dist_ckpt import load_model_checkpoint, save_model_checkpoint
    from trinity.compat import cpu_compat
    from trinity.trainer.engine.optimizer_state import ReshardableOptimizer

    state = _train_state(cpu_world, OptimConfig(lr=1e-3), MegatronConfig(use_distributed_optimizer=True))
    _step(state, loss_scale=1.0)
    (opt,) = _chain(state.optimizer)

    def snapshot():
        return {(i, k): v.clone() for i, s in enumerate(opt.optimizer.state.values()) for k, v in s.items()
                if torch.is_tensor(v) and v.dim() > 0} | \
               {("param", i): p.detach().clone() for i, p in enumerate(opt.optimizer.param_groups[0]["params"])}

    with cpu_compat.checkpoint_io():
        save_model_checkpoint(state.model, tmp_path / "ckpt", optimizer=ReshardableOptimizer(state.optimizer))
    saved = snapshot()
    _step(state, loss_scale=1.0)
    after_save = snapshot()
    _step(state, loss_scale=1.0)
    assert any(not torch.equal(saved[k], v) for k, v in snapshot().items())
    with cpu_compat.checkpoint_io():
        load_model_checkpoint(state.model, tmp_path / "ckpt", optimizer=ReshardableOptimizer(state.optimizer))
    assert "sharded_param_state_fully_reshardable" not in vars(opt)
    loaded = snapshot()
    assert loaded.keys() == saved.keys()
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k
    _step(state, loss_scale=1.0)
    for k, v in snapshot().items():
        if k[0] != "param":  # the moments after the same step from the same state
            torch.testing.assert_close(v, after_save[k], rtol=0, atol=0, msg=str(k))
