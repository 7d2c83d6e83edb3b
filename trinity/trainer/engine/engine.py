"""A role engine: one role's model chunks and everything that trains, runs and stores them.

Built from (model facts, the role's megatron block, optimizer settings or None, weight source, value
head or not). A trained engine wraps its chunks in megatron-core DDP and owns the optimizer, the LR
schedule and the offloader; a frozen one (the ref) owns bare chunks, forward only. Recipes see only:

- `train_batch(micro_batches, loss_fn, denom=)`: THE training step of every algorithm (zero the grads,
  run megatron's pipeline schedule over the micro batches, step the optimizer unless the loss or the
  grad norm is not finite: trinity.trainer.nonfinite);
- `infer_batch(micro_batches, reduce_fn, result_shape)`: forward only, micro batch by micro batch,
  through the pipeline schedule at PP>1 with the result broadcast to every stage;
- `need(params=, grads=, optim=)`: what the next phase needs resident (offload);
- `save(path, ...)` / `load(path)`: the role's part of a training checkpoint.

The engine knows a micro batch (`MicroBatch`) by its token ids [b, s] (the schedule's shapes) and its
own forward; everything else in it is the loss's (`LossFn`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence, TypeVar

import torch

from trinity.config.roles import Role
from trinity.config.weights import WeightSource
from trinity.distributed import collectives
from trinity.errors import UserError
from trinity.trainer.engine.offload import RoleOffloader
from trinity.trainer.nonfinite import NonFiniteGuard, loss_code, problem

if TYPE_CHECKING:
    from trinity.config.megatron import MegatronConfig
    from trinity.config.schema import OptimConfig
    from trinity.config.schema.actor_rollout_ref import LoraConfig
    from trinity.models.facts import ModelFacts


class MicroBatch(Protocol):
    """What the engine runs: one micro batch's token ids [b, s] (on every pipeline stage: the schedule
    sizes its buffers by them) and the stage's forward over it. The kinds are frozen dataclasses, one per
    layout: `trinity.trainer.recipes.sft.TokenRows` (SFT / PT / DPO rows), and the RL ones of
    `trinity.trainer.recipes.rollout_forward` (`PaddedRollout`, `PackedMicro`) and
    `trinity.trainer.recipes.rl_update.ExperienceMicro` (either of them with its sequences' experience)."""

    @property
    def tokens(self) -> torch.Tensor: ...

    def forward(self, chunk: torch.nn.Module) -> torch.Tensor:
        """This stage's output: the last stage's logits (values), other stages' hidden states."""
        ...


M = TypeVar("M", bound=MicroBatch)
M_contra = TypeVar("M_contra", bound=MicroBatch, contravariant=True)

# The denominator a loss is normalised by: a count over the whole (global) batch, a tensor where it was
# all-reduced over DP (RL's token / sequence counts).
Denominator = torch.Tensor | float


class LossFn(Protocol[M_contra]):
    """The loss of one micro batch, on the last pipeline stage, from the stage's `output`.

    `denom`: what the loss is normalised by (the global batch's token / sequence / pair count, given to
    `train_batch`); `scale`: the factor that cancels megatron's division by the number of micro batches
    and DDP's average over DP (micro batches x DP, the engine's), so that the gradient is the global
    batch's on every layout. Returns (the loss to back-propagate, times `scale`; detached metrics, which
    the schedule collects per micro batch)."""

    def __call__(self, micro: M_contra, output: torch.Tensor, *, denom: Denominator,
                 scale: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


@dataclass
class StepResult:
    """What one `train_batch` gives back: the last stage's per-micro-batch metric dicts (empty on other
    stages), the global grad norm (every rank), and whether the update was skipped (a non-finite loss or
    grad norm under trainer.skip_nonfinite_steps: the weights are unchanged)."""

    outputs: list[dict[str, torch.Tensor]]
    grad_norm: float
    skipped: bool = False


class RoleEngine:
    def __init__(
        self, role: Role, chunks: list[torch.nn.Module], megatron: MegatronConfig, optim: OptimConfig | None, *,
        dtype: torch.dtype, total_steps: int, optimizer_on_host: bool = False, lora: LoraConfig | None = None,
        facts: ModelFacts | None = None, nonfinite: NonFiniteGuard | None = None,
    ):
        """`optimizer_on_host`: `megatron.optimizer_offload` keeps the optimizer in host memory and steps it
        there (single-phase recipes: `trinity.trainer.engine.host_optimizer`) instead of moving it
        between phases (RL: `trinity.trainer.engine.offload`). `lora` (actor.lora with rank >= 1, trained
        roles only): adapters are added to the loaded chunks and only they are trained (trinity.models.lora);
        DDP buffers, optimizer and checkpoints then hold the adapters only; with `lora.adapter_path` they
        start as that PEFT folder's adapters (`facts`: the model's, to map its names). `nonfinite`: the run's
        decisions on non-finite updates (trinity.trainer.nonfinite); unset, the first one stops."""
        self.role, self.megatron = role, megatron
        self.nonfinite = nonfinite if nonfinite is not None else NonFiniteGuard()
        self.device = next(p.device for chunk in chunks for p in chunk.parameters())  # before any offload
        self.optimizer = self.scheduler = self.host = None
        self.lora = lora if optim is not None and lora is not None and lora.rank > 0 else None
        self.lora_params = self.lora_loaded = 0  # adapter parameters; linears loaded from lora.adapter_path
        if self.lora is not None:
            from trinity.models.lora import apply_lora

            self.lora_params = apply_lora(chunks, self.lora)  # before DDP: its buffers see only adapters
            if self.lora.adapter_path:
                from trinity.convert.peft_io import load_peft_adapters

                if facts is None:
                    raise ValueError("RoleEngine: lora.adapter_path needs the model's facts")
                # before DDP and the optimizer copy the parameters: both start from the folder's values
                self.lora_loaded = load_peft_adapters(chunks, self.lora.adapter_path, facts, rank=self.lora.rank,
                                                      alpha=self.lora.alpha)
        self.chunks = list(chunks)  # without wrappers (DDP wraps these very modules)
        if optim is None:
            for chunk in chunks:
                chunk.eval()
                chunk.requires_grad_(False)
            self.model = chunks
        else:
            from trinity.trainer.engine.setup import build_train_state

            host = optimizer_on_host and megatron.optimizer_offload
            state = build_train_state(chunks, megatron, optim, dtype=dtype, total_steps=total_steps, host_optimizer=host)
            self.model, self.optimizer, self.scheduler, self.host = state.model, state.optimizer, state.scheduler, state.host
        self.offloader = RoleOffloader(
            self.model, self.optimizer, param_offload=megatron.param_offload, grad_offload=megatron.grad_offload,
            optimizer_offload=megatron.optimizer_offload and self.host is None,
        )

    @classmethod
    def build(
        cls, role: Role, facts: ModelFacts, megatron: MegatronConfig, optim: OptimConfig | None, source: WeightSource, *,
        device: str, dtype: torch.dtype, total_steps: int, chunks: list[torch.nn.Module] | None = None,
        optimizer_on_host: bool = False, lora: LoraConfig | None = None, nonfinite: NonFiniteGuard | None = None,
    ) -> "RoleEngine":
        """Build the role's GPTModel chunks (value head for the critic), load `source` into them and wrap
        them; `chunks` are already built and loaded ones (the worker's actor)."""
        if chunks is None:
            from trinity.models.build import build_model
            from trinity.convert.load import load_weights

            chunks = build_model(facts, megatron, device=device, dtype=dtype, value_head=role.value_head)
            load_weights(chunks, source, facts, value_head=role.value_head)
        return cls(role, chunks, megatron, optim, dtype=dtype, total_steps=total_steps, optimizer_on_host=optimizer_on_host,
                   lora=lora, facts=facts, nonfinite=nonfinite)

    # ------------------------------------------------------------------ what recipes read

    @property
    def trained(self) -> bool:
        return self.optimizer is not None

    @property
    def modules(self) -> list[torch.nn.Module]:
        """The GPTModel chunks without their DDP wrappers (generation, export)."""
        return list(self.chunks)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def advance_schedule(self) -> None:
        """Set the LR of the next optimizer step(s): the schedule's value at the next step (warm-up starts
        above 0). Recipes call it once per training step, before `train_batch`."""
        self.scheduler.step(increment=1)

    def need(self, *, params: bool, grads: bool = False, optim: bool = False) -> None:
        self.offloader.need(params=params, grads=grads, optim=optim)

    def release(self, *, params: bool, grads: bool = False, optim: bool = False) -> None:
        """Offload what a phase does not need, bringing nothing back (`RoleOffloader.release`)."""
        self.offloader.release(params=params, grads=grads, optim=optim)

    def all_resident(self) -> None:
        """Params and optimizer on the device (checkpoint save / export); grads stay where they are
        (a recipe without phases, SFT, never moves anything)."""
        self.need(params=True, grads=self.offloader.on_grads, optim=True)

    # ------------------------------------------------------------------ the step

    def train_batch(self, micro_batches: Sequence[M], loss_fn: LossFn[M], *, denom: Denominator) -> StepResult:
        """One optimizer step over this rank's micro batches, each loss normalised by `denom` (`LossFn`).
        Their number may differ between DP ranks (RL's packed micro batches: each rank's loss scale cancels
        its own count); at PP>1 the RL recipes give all of one call one shape, as SFT's fixed-length rows
        have (the schedule is told the first one's). An update whose loss or grad norm is not finite is not
        applied; the run's guard stops the job or counts it."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        b, s = micro_batches[0].tokens.shape
        scale = float(len(micro_batches) * ps.get_data_parallel_world_size())

        # The interleaved (VPP) schedule runs micro batches in groups of PP and refuses a count that is not
        # a multiple of PP, which RL's packed micro batches cannot promise: a short call is filled up with
        # copies of its last micro batch whose loss is multiplied by 0 (no gradient, outputs dropped), and
        # the real ones' losses by len(run) / real, undoing the schedule's division by len(run).
        group = ps.get_pipeline_model_parallel_world_size() if len(self.model) > 1 else 1
        real = len(micro_batches)
        run = list(enumerate(list(micro_batches) + list(micro_batches[-1:]) * (-real % group)))
        fix = len(run) / real
        losses: list[torch.Tensor] = []  # the real micro batches' losses (last stage): the non-finite check

        def scaled(micro: M, weight: float, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss, metrics = loss_fn(micro, output, denom=denom, scale=scale)
            if not weight:
                return loss * weight, {}
            losses.append(loss.detach())
            return (loss if weight == 1.0 else loss * weight), metrics

        def forward_step(data_iterator: Iterator[tuple[int, M]], chunk: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
            i, micro = next(data_iterator)
            output = micro.forward(chunk)
            return output, partial(scaled, micro, 1.0 if len(run) == real else fix if i < real else 0.0)

        # One iterator per VPP chunk: the interleaved schedule runs every micro batch through each chunk.
        iterators = [iter(run) for _ in self.model]
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=len(run),
            seq_length=_schedule_seq_length(self.model, s),
            micro_batch_size=b,
            forward_only=False,
        )
        with self.offloader.optimizer_step():
            norm, skipped = self._step(loss_code(losses, self.device))
        return StepResult(list(outputs)[:real], norm, skipped)

    def _step(self, code: torch.Tensor) -> tuple[float, bool]:
        """The optimizer step when the loss (`code`, trinity.trainer.nonfinite) and the grad norm are finite;
        returns (grad norm, whether the update was skipped). Every rank decides alike: both are global."""
        from trinity.trainer.engine import optimizer_step

        host = self.host
        norm = host.grad_norm() if host is not None else optimizer_step.grad_norm(self.optimizer)
        what = problem(int(code.item()), norm)  # read after the norm's own host sync: it waits for nothing
        if what is None:
            if host is not None:
                host.apply(norm)
            else:
                optimizer_step.apply(self.optimizer, norm)
            return norm, False
        self.nonfinite.update(f"update_{self.role.value}", what, f"{self.role.config_path}.optim.lr")
        return norm, True

    @torch.no_grad()
    def infer_batch(self, micro_batches: Sequence[M], reduce_fn: Callable[[torch.Tensor, M], torch.Tensor],
                    result_shape: tuple[int, ...]) -> torch.Tensor:
        return forward_only(self.model, micro_batches, reduce_fn, result_shape)

    # ------------------------------------------------------------------ checkpoint part

    def save(self, path: Path, *, hf_dir: str | Path | None, extra: dict[str, object], meta: dict[str, object]) -> None:
        """Model + optimizer as a reshardable trinity dist checkpoint at `path` (all ranks call)."""
        from trinity.convert.dist_ckpt import save_model_checkpoint
        from trinity.compat import cpu_compat
        from trinity.trainer.engine.optimizer_state import ReshardableOptimizer

        if self.lora is not None:  # adapters + optimizer only: the base comes from the weight source on resume
            meta = {**meta, "lora": self.lora.model_dump(mode="json")}
        with cpu_compat.checkpoint_io():
            save_model_checkpoint(
                self.model, path, hf_dir=hf_dir, extra_common=extra, optimizer=ReshardableOptimizer(self.optimizer),
                force=True, meta=meta, exclude=self.frozen_keys(),
            )

    def _check_lora_matches(self, path: Path) -> None:
        """A LoRA checkpoint holds adapters only, a full one no adapters: resuming one with the other's
        config is refused naming the setting, before megatron-core reports missing tensors."""
        from trinity.convert.dist_ckpt import META, read_meta

        if not (Path(path) / META).is_file():
            return  # not trinity's: the key comparison of the load names what differs
        stored = read_meta(path).get("lora")
        key = "actor_rollout_ref.actor.lora"
        if stored and self.lora is None:
            raise UserError(f"trainer.resume: {path} holds LoRA adapters only (rank {stored.get('rank')}), but {key} is off; "
                            f"set {key}.rank: {stored.get('rank')} as the run that wrote it, or trainer.resume=disable")
        if self.lora is not None and not stored:
            raise UserError(f"trainer.resume: {path} is a full-model checkpoint, but {key} is on; remove {key} to "
                            "resume it, or start the LoRA run elsewhere (another trainer.output_dir, or trainer.resume=disable)")
        if stored and int(stored.get("rank", -1)) != self.lora.rank:
            raise UserError(f"{key}.rank: {self.lora.rank} differs from the checkpoint's {stored.get('rank')} ({path}); "
                            "resume with the rank it was trained with, or trainer.resume=disable")

    def frozen_keys(self) -> tuple[str, ...]:
        """Sharded keys a checkpoint of this role leaves out: with LoRA every base tensor (frozen, as loaded
        from the weight source), so a LoRA checkpoint holds the adapters, their optimizer state and the
        job state only."""
        if self.lora is None:
            return ()
        from trinity.convert.dist_ckpt import _flat_sharded

        flat, _ = _flat_sharded(self.model)
        return tuple(sorted({v.key for v in flat.values() if ".lora.lora_" not in v.key}))

    def load(self, path: Path) -> dict[str, object]:
        """Model + optimizer from `path`; returns the checkpoint's `extra`. The optimizer's
        hyper-parameters stay the config's (a resume with a changed optim.lr applies it)."""
        from trinity.convert.dist_ckpt import load_model_checkpoint
        from trinity.compat import cpu_compat
        from trinity.trainer.engine.optimizer_state import ReshardableOptimizer, keep_config_hyperparams

        self._check_lora_matches(path)

        with cpu_compat.checkpoint_io():
            extra = keep_config_hyperparams(
                self.optimizer, lambda: load_model_checkpoint(
                    self.model, path, optimizer=ReshardableOptimizer(self.optimizer), exclude=self.frozen_keys()
                )
            )
        if self.host is not None:
            self.host.relocate()  # the load put states beside their params, and fp32 masters are the model's
        return extra


def _schedule_seq_length(model: Sequence[torch.nn.Module], s: int) -> int:
    """The sequence length megatron's schedule sizes its pipeline buffers by: with sequence parallel the
    forwards pad rows to a multiple of TP (`trinity.trainer.recipes.rollout_forward.forward_output`)."""
    from trinity.distributed.sequence_parallel import round_up, sp_multiple

    return round_up(s, sp_multiple(model[0]))


@torch.no_grad()
def forward_only(
    model: Sequence[torch.nn.Module], micro_batches: Sequence[M], reduce_fn: Callable[[torch.Tensor, M], torch.Tensor],
    result_shape: tuple[int, ...],
) -> torch.Tensor:
    """`reduce_fn(micro.forward(chunk), micro)` of every micro batch, concatenated along dim 0, on every
    rank. At PP>1 through megatron's pipeline schedule (forward only): the last stage computes it and
    broadcasts it (fp32, `result_shape`) to the other stages. With virtual pipeline stages (several
    chunks per rank) through megatron's interleaved schedule, forward only."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return torch.cat([reduce_fn(part.forward(model[0]), part) for part in micro_batches])
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator: Iterator[M], chunk: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
        part = next(data_iterator)
        output = part.forward(chunk)
        return output, lambda out: (out.new_zeros(()), {"out": reduce_fn(out, part)})

    # The interleaved schedule runs micro batches in groups of PP per chunk and refuses a count that is
    # not a multiple of PP: a short run is filled up with copies of its last micro batch, whose results
    # are dropped (forward only: nothing else sees them).
    group = ps.get_pipeline_model_parallel_world_size() if len(model) > 1 else 1

    out: list[torch.Tensor] = []
    # the schedule's point-to-point buffers have one shape: one call per run of equal-sized micro batches
    start = 0
    device = micro_batches[0].tokens.device
    while start < len(micro_batches):
        shape = micro_batches[start].tokens.shape
        end = start
        while end < len(micro_batches) and micro_batches[end].tokens.shape == shape:
            end += 1
        run = list(micro_batches[start:end])
        run = run + run[-1:] * (-len(run) % group)
        store = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter(run) for _ in model] if len(model) > 1 else iter(run),
            model=model if len(model) > 1 else model[0], num_microbatches=len(run),
            seq_length=_schedule_seq_length(model, shape[1]), micro_batch_size=shape[0], forward_only=True,
        )
        out.extend(d["out"] for d in list(store)[: end - start])
        start = end
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        result = torch.cat(out).float().contiguous()
    else:
        result = torch.empty(result_shape, dtype=torch.float32, device=device)
    return collectives.broadcast_(result, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
