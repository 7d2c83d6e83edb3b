"""The reference generator (the tests' oracle): static-batch generation with the actor's megatron-core GPTModel.

The engine the RL recipes, `trinity generate` and evaluation use is the continuous-batching one in
`trinity.rollout.continuous` (a slot pool under a KV-cache budget); this module decodes all rows as one
batch until the longest ends, and the tests check the continuous engine against it (and the cached
decode steps against its `use_cache=False` full forwards). Both pick tokens through
`trinity.rollout.sampler.Sampler`, lay out their `Rollout` with `trinity.rollout.layout` and hand over
between model-parallel ranks through `trinity.rollout.parallel`.

Layout: prompts are LEFT-padded to the batch's longest prompt, so every row's next token sits at the same
KV-cache slot and one static KV cache serves the whole batch. megatron's GPT applies RoPE by
cache slot (it ignores position_ids for RoPE), and RoPE only depends on the distance between two tokens,
so a row shifted right by its padding sees exactly the attention scores it would see unpadded. Padding
keys are masked out; a padding query attends to itself only (a query with every key masked gives NaN in
SDPA, and that NaN would reach real tokens through the next layer's values).

Steps: one prefill call over the prompts, then one call per new token, both through
`trinity.rollout.decode.StaticDecoder` (a KV cache of the final length, a CUDA graph per decode step
where possible). Logits are gathered over TP (`runtime_gather_output=True`) and the padded vocabulary
columns are dropped before sampling. All ranks of a TP group must feed the same token:
TP rank 0's sample is broadcast to the group.

`Rollout.logprobs` are log p(token) under the model's own distribution at temperature 1 over the full
(unpadded) vocabulary, NOT under the temperature / top-k / top-p distribution the token was drawn from.
That is what PPO's ratio compares against (the trainer recomputes old log-probs with a training forward
anyway, which also absorbs KV-cache vs full-forward rounding in bf16); at temperature 1 without
truncation both definitions coincide. Rows stop at the first EOS id (the EOS token is part of the
response and of the response mask); later positions hold `pad_id` and mask 0.

Pipeline parallelism: every stage runs its own layers (and, with the cache, holds their KV cache only).
The first stage embeds; each non-last stage sends its hidden states [s, b, h] to the next stage over the
pipeline group (`torch.distributed.send` / `recv`); the last stage computes the logits and samples (so
only its generator is drawn from), and broadcasts the tokens to its pipeline group every step (the first
stage needs them as the next input, every stage needs them to stop at EOS) and the log-probs once at the
end: every rank returns the same `Rollout`. With virtual pipeline stages every rank passes its list of
model chunks; each step runs chunk 0..V-1 in turn, handing hidden states around the ring of stages
(`trinity.rollout.parallel.Pipeline`), each chunk with its own decoder (its own layers' KV cache).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from trinity.rollout.layout import assemble, left_pad
from trinity.rollout.parallel import Pipeline
from trinity.rollout.sampler import Sampler
from trinity.rollout.types import Rollout, SamplingParams


def attention_mask(key_mask: torch.Tensor, sq: int | None = None) -> torch.Tensor:
    """Megatron boolean mask (True = masked) [B, 1, sq, sk] for the last `sq` queries over `sk` keys:
    causal, padding keys masked, a padding query keeps its own key (see module doc)."""
    b, sk = key_mask.shape
    sq = sk if sq is None else sq
    q_pos = torch.arange(sk - sq, sk, device=key_mask.device).view(1, sq, 1)
    k_pos = torch.arange(sk, device=key_mask.device).view(1, 1, sk)
    pad_key = (key_mask == 0).view(b, 1, sk)
    masked = (k_pos > q_pos) | (pad_key & (k_pos != q_pos))
    return masked.unsqueeze(1)


class _StopFlag:
    """Tells the decode loop when every row has stopped. On CPU it reads `done.all()` at once; on
    CUDA it copies the flag to pinned host memory without waiting and reads the previous step's copy
    (its step has finished by the time the next one is queued), so the loop runs one step past the
    last EOS and `width` drops that step."""

    def __init__(self, device: torch.device) -> None:
        self.lagged = device.type == "cuda"
        self.width = 0
        if self.lagged:
            self._flags = torch.zeros(2, dtype=torch.bool, pin_memory=True)
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
            self._pending: int | None = None

    def all_done(self, done: torch.Tensor, step: int) -> bool:
        if not self.lagged:
            self.width = step + 1
            return bool(done.all())
        slot = step % 2
        self._flags[slot].copy_(done.all(), non_blocking=True)
        self._events[slot].record()
        previous, self._pending = self._pending, slot
        if previous is None:
            return False
        self._events[previous].synchronize()
        if bool(self._flags[previous]):
            self.width = step  # rows all stopped at step - 1: this step produced padding only
            return True
        return False


@torch.no_grad()
def reference_generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    vocab_size: int,
    pad_id: int,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    cuda_graphs: bool = True,
    compile: bool = False,
    fused_sampler: bool = True,
) -> Rollout:
    """Sample responses for `prompts` (token id lists) with a megatron GPTModel (or its DDP wrapper);
    at PP>1 every rank of the pipeline calls it with its own stage and gets the same `Rollout`; with
    virtual pipeline stages `model` is the rank's list of model chunks (in order).

    use_cache=False re-runs the whole sequence every step (the reference the KV-cache path is tested
    against); cuda_graphs=False runs the cached decode steps eagerly, compile=True compiles them with
    torch.compile (see `trinity.rollout.decode`); fused_sampler=False samples with the torch ops where the
    fused sampler would run (benchmarks/generate.py).
    Returns a `Rollout` whose response width is the longest response generated.
    """
    from trinity.models.build import unwrap
    from trinity.rollout.decode import StaticDecoder

    gpts = [unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
    param = next(gpts[0].parameters())
    device = param.device
    pipe = Pipeline(gpts, device, param.dtype)
    was_training = [g.training for g in gpts]
    for g in gpts:
        g.eval()
    tokens, prompt_mask = left_pad(prompts, pad_id, device)
    batch, plen = tokens.shape
    eos = torch.tensor(sorted(set(params.eos_token_ids)) or [-1], device=device)
    key_mask = prompt_mask
    decoders = [StaticDecoder(g, batch, plen + params.max_new_tokens, cuda_graphs=cuda_graphs, compile=compile)
                for g in gpts] if use_cache else None
    out_tokens = torch.full((batch, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_logp = torch.zeros((batch, params.max_new_tokens), dtype=torch.float32, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    sampler = Sampler(params, generator, device, vocab_size, fused=fused_sampler)
    rows = torch.arange(batch, device=device)
    # "every row has stopped" is read one step late on CUDA: reading it at once would make the host
    # wait for each step before queueing the next, leaving the GPU idle in between.
    stop = _StopFlag(device)
    seq, width = tokens, 0
    try:
        for step in range(params.max_new_tokens):
            for v, gpt in enumerate(gpts):  # the rank's model chunks in order (one without VPP)
                hidden = pipe.recv(seq.shape[1] if decoders is None or step == 0 else 1, batch, v)
                if decoders is None:
                    pos = torch.arange(seq.shape[1], device=device).expand(batch, -1)
                    if hidden is not None:
                        gpt.set_input_tensor(hidden)
                    out = gpt(seq, pos, attention_mask(key_mask), runtime_gather_output=True)
                    # the model's last chunk: logits [b, s, V]; other chunks: hidden [s, b, h]
                    out = out[:, -1] if gpt.post_process or pipe.size == 1 else out
                elif step == 0:
                    out = decoders[v].prefill(seq, key_mask, hidden)
                else:
                    out = decoders[v].step(seq[:, -1], plen + step - 1, hidden)
                pipe.send(out, v)
            if pipe.last:
                # the draw of row i's token `step` is named i x max_new + step, as the continuous engine names it
                nxt, logp = sampler(out, rows * params.max_new_tokens + step)
            else:
                nxt = torch.empty(batch, dtype=torch.long, device=device)
                logp = torch.zeros(batch, dtype=torch.float32, device=device)
            nxt = pipe.from_last(nxt)
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            out_tokens[:, step] = nxt
            out_logp[:, step] = torch.where(done, torch.zeros_like(logp), logp)
            lengths += (~done).long()
            done = done | torch.isin(nxt, eos)
            seq = nxt.unsqueeze(1) if decoders is not None else torch.cat([seq, nxt.unsqueeze(1)], dim=1)
            if decoders is None:
                key_mask = torch.cat([key_mask, torch.ones_like(nxt).unsqueeze(1)], dim=1)
            width = step + 1
            if stop.all_done(done, step):
                width = stop.width
                break
    finally:
        for g, training in zip(gpts, was_training):
            if decoders is None and not g.pre_process:
                g.set_input_tensor(None)
            g.train(training)
    logprobs = pipe.from_last(out_logp[:, :width].contiguous())
    return assemble(tokens, prompt_mask, out_tokens[:, :width], lengths, logprobs)

