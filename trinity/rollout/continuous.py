"""The continuous-batching rollout engine: a pool of KV-cache slots sized from a memory budget.

Why: the static path (`trinity.rollout.reference.reference_generate`) decodes every row of a rollout as
one batch until its longest row ends, over a cache of the final length, with no memory bound. Here:
- the KV cache is a pool of `slots` rows of `cache_len` tokens per layer of this pipeline stage, with
  `slots = min(max_num_seqs, budget // bytes per slot, rows)`; the budget is `kv_cache_memory_gib`, else
  `gpu_memory_utilization` x the memory free when the rollout starts (host memory on CPU)
  (`trinity.rollout.kv_budget`);
- a row that ends (EOS or `max_new_tokens`) frees its slot; waiting rows are prefilled into free slots
  (a rollout larger than the pool runs in waves, each row's tokens unchanged);
- identical prompts (a prompt's n samples) are prefilled ONCE per admission and their keys/values copied
  to each sample's slot; on CUDA a decode step's split-KV kernel reads the prompt's keys from one of
  those slots for all of its samples (`ContinuousScheduler.set_leads`), so that they come from DRAM
  about once per step instead of n times;
- every slot has its own position, so a row's RoPE and causal mask are those of the row alone. A decode
  step runs the slots [0, b) with b the batch bucket above the highest live slot (`trinity.rollout.buckets`:
  powers of two, then multiples of 64, leaving out on CUDA those whose GEMMs are slower than a larger
  one's), attending over the first `L` cache positions, L the longest live context rounded up to
  `scheduler.LEN_BUCKET` (a step reads the live context, not the whole cache). When no rows wait, live slots are
  compacted to the front so that the tail of a rollout runs small buckets.
The prefill and decode steps over the pool (per-row RoPE, the attention kernels, one CUDA graph per
(batch bucket, length bucket) on CUDA) are `trinity.rollout.slots.SlotDecoder`'s.

Sampling (temperature / top-k / top-p), EOS handling, the returned `Rollout` layout and log-probs are
those of `trinity.rollout.reference` (the same `trinity.rollout.sampler.Sampler`, log p under the
temperature-1 distribution). With the fused sampler a row's draws are named by (output row, token index)
and do not depend on its slot or wave. On CUDA (one stage, TP=1, the fused sampler) a decode step's
sampling and bookkeeping are captured in the step's CUDA graph with its layers: one replay per step
(at TP>1 the graph holds the layers and their all-reduces, the sampling runs after it).
Tensor parallelism: TP rank 0's samples are broadcast to its group. Pipeline parallelism: each stage
keeps its own layers' KV cache, hidden states go stage to stage (`trinity.rollout.parallel.Pipeline`), the last stage samples
and broadcasts the tokens every step; every rank derives "which rows ended" from those tokens with the
same rule, so all ranks of a model-parallel group make the same scheduling decisions (the slot count
is the minimum over the group). Virtual pipeline stages (VPP): a rank holds several model chunks, each
with its own `SlotDecoder` (its layers' KV cache) sharing one slot state (tokens, positions, ended
flags); every prefill and decode step runs the chunks in order, hidden states going around the ring of
stages between them (`Pipeline`). On CUDA "which rows ended" is read one step late (the host does not
wait for each step); a row that ended keeps a slot one extra step, computing nothing that is kept.

Here: the entry point (`generate_continuous`: the pool's size, the buckets, the decoders, the sampler)
and the built-in `RolloutEngine` (`ActorRollout`). The scheduler (admission, prefill, retirement,
compaction, the shared-prompt leads, the decode loop) is `trinity.rollout.scheduler.ContinuousScheduler`,
its host-side bookkeeping `trinity.rollout.slot_table.SlotTable`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch

from trinity.rollout.buckets import decode_buckets
from trinity.rollout.kernels import DecodeKernels
from trinity.rollout.kv_budget import KVBudget, kv_bytes_per_token, plan_slots
from trinity.rollout.parallel import Pipeline
from trinity.rollout.sampler import Sampler
from trinity.rollout.scheduler import ContinuousScheduler
from trinity.rollout.slot_table import group_prompts
from trinity.rollout.slots import SlotDecoder
from trinity.rollout.types import Rollout, RolloutStats, SamplingParams

if TYPE_CHECKING:
    from trinity.rollout.partial import PartialGroup, PartialOutcome

_CACHE_MULTIPLE = 64


@torch.no_grad()
def generate_continuous(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    vocab_size: int,
    pad_id: int,
    budget: KVBudget = KVBudget(),
    generator: torch.Generator | None = None,
    cuda_graphs: bool = True,
    response_lengths: Sequence[int] | None = None,
    stats: RolloutStats | None = None,
    kernels: DecodeKernels = DecodeKernels(),
) -> Rollout:
    """Sample responses for `prompts` with a megatron GPTModel (or its DDP wrapper) through a slot pool
    (module doc); with virtual pipeline stages `model` is the rank's list of model chunks (in order). Every
    rank of a model-parallel group calls it with the same prompts and gets the same `Rollout` (left-padded
    prompts, right-padded responses, as `trinity.rollout.reference.reference_generate`).

    response_lengths: benchmark-only: row i also ends after response_lengths[i] tokens (a schedule of
    "EOS" positions for random-weight models that never emit one). kernels: the fast paths the decode
    steps may take (`trinity.rollout.kernels`; default: all, where they run)."""
    plens = [len(p) for p in prompts]
    if not prompts or min(plens) == 0:
        raise ValueError("generate_continuous: every prompt needs at least one token")
    # the rows grouped by prompt (a prompt's samples are prefilled once when admitted together)
    groups = group_prompts(prompts)
    with open_engine(model, params, rows=len(prompts), longest_prompt=max(plens), vocab_size=vocab_size,
                     pad_id=pad_id, budget=budget, generator=generator, cuda_graphs=cuda_graphs,
                     response_lengths=response_lengths, stats=stats, kernels=kernels,
                     shared_prompts=any(len(g.rows) > 1 for g in groups)) as scheduler:
        scheduler.add(groups)
        scheduler.run()
    return scheduler.finish(prompts)


@contextmanager
def open_engine(
    model: Any, params: SamplingParams, *, rows: int, longest_prompt: int, vocab_size: int, pad_id: int,
    budget: KVBudget = KVBudget(), generator: torch.Generator | None = None, cuda_graphs: bool = True,
    response_lengths: Sequence[int] | None = None, stats: RolloutStats | None = None,
    kernels: DecodeKernels = DecodeKernels(), shared_prompts: bool = True, keyed: bool = False,
    seed: int | None = None,
) -> Iterator[ContinuousScheduler]:
    """A `ContinuousScheduler` over a slot pool for `rows` output rows whose prompts (what is prefilled)
    are at most `longest_prompt` tokens, with the model in eval mode until the block ends (then the pool
    is freed). `shared_prompts`: some prompts have several samples (their keys are read once);
    `keyed`: the torch sampler draws per row by its key too (`Sampler(keyed=True)`); `seed`: the keyed
    draws' seed (else drawn from `generator`)."""
    from trinity.models.build import unwrap

    gpts = [unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
    param = next(gpts[0].parameters())
    device = param.device
    stats = stats if stats is not None else RolloutStats()
    max_new = params.max_new_tokens
    cache_len = -(-(longest_prompt + max_new) // _CACHE_MULTIPLE) * _CACHE_MULTIPLE
    slots = plan_slots(gpts, budget, rows, cache_len, device)
    # the batch buckets (CUDA: tuned by timing this stage's GEMMs, before the cache takes the memory)
    buckets = decode_buckets(gpts, slots, device, tuned=kernels.tuned_buckets)
    stats.bucket_note = buckets.note
    pipe = Pipeline(gpts, device, param.dtype)
    sampler = Sampler(params, generator, device, vocab_size, fused=kernels.fused_sampler, keyed=keyed, seed=seed)
    # one decoder per model chunk; `dec` (chunk 0) holds the slot state all of them read; tail_key: what
    # the sampling captured with a step compiles for (SlotDecoder warms a shape up once per process)
    tail_key = (sampler.label, params.temperature, vocab_size, max_new, rows, len(set(params.eos_token_ids)))
    # a prompt's samples read one copy of its keys
    share = shared_prompts and kernels.shared_prompt_keys
    dec = SlotDecoder(gpts[0], slots, cache_len, cuda_graphs=cuda_graphs, tail_key=tail_key, share_prefix=share,
                      kernels=kernels)
    decs = [dec] + [SlotDecoder(g, slots, cache_len, cuda_graphs=cuda_graphs, state_from=dec, tail_key=tail_key,
                                share_prefix=share, kernels=kernels) for g in gpts[1:]]
    stats.rows, stats.slots, stats.cache_len, stats.kv_bytes_per_token = rows, slots, cache_len, kv_bytes_per_token(gpts)
    # one CUDA graph per step for the layers, the sampling and the bookkeeping: one stage, one chunk, the
    # fused sampler (the torch ops' multinomial draws from a generator the graph would not advance), TP=1
    # (at TP>1 the graph holds the layers; the sampler's broadcast from TP rank 0 runs after it)
    graph_tail = dec.use_graph and pipe.size == 1 and len(decs) == 1 and sampler.fused and dec.tp_group is None
    stats.sampler, stats.graph_tail = sampler.label, graph_tail
    scheduler = ContinuousScheduler(decs, pipe, sampler, buckets, params, rows=rows, pad_id=pad_id, stats=stats,
                                    graph_tail=graph_tail, response_lengths=response_lengths)
    was_training = [g.training for g in gpts]
    for g in gpts:
        g.eval()
    try:
        yield scheduler
    finally:
        for g, training in zip(gpts, was_training):
            g.train(training)
        scheduler.close()


@dataclass
class ActorRollout:
    """The built-in `RolloutEngine`: `generate_continuous` over the actor's own model chunks (hybrid
    engine: no second copy of the weights, no weight sync); `stats` describes its last call."""

    model: Any
    vocab_size: int
    pad_id: int
    budget: KVBudget = KVBudget()
    stats: RolloutStats = field(default_factory=RolloutStats)
    time_buckets: bool = False  # time the decode steps per batch bucket (a profiled RL step sets it)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator | None = None) -> Rollout:
        self.stats = RolloutStats(time_buckets=self.time_buckets)
        return generate_continuous(self.model, prompts, params, vocab_size=self.vocab_size, pad_id=self.pad_id,
                                   budget=self.budget, generator=generator, stats=self.stats)

    def generate_partial(self, carried: Sequence[PartialGroup], fresh: Callable[[], PartialGroup],
                         params: SamplingParams, generator: torch.Generator | None = None, **kw: Any) -> PartialOutcome:
        """A partial rollout (`trinity.rollout.partial.generate_partial`; `kw`: its n, need, inflight,
        version, longest_prompt)."""
        from trinity.rollout.partial import generate_partial

        self.stats = RolloutStats(time_buckets=self.time_buckets)
        return generate_partial(self.model, carried, fresh, params, vocab_size=self.vocab_size, pad_id=self.pad_id,
                                budget=self.budget, generator=generator, stats=self.stats, **kw)
