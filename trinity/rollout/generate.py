"""Static-batch generation with the actor's own megatron-core GPTModel: the reference implementation.

The engine the RL recipes, `trinity generate` and evaluation use is the continuous-batching one in
`trinity.rollout.continuous` (a slot pool under a KV-cache budget); this module decodes all rows as one
batch until the longest ends, and the tests check the continuous engine against it. Its helpers
(`sample`, `left_pad`, `_Pipeline`, `_tp_broadcast`) are shared by both, and both pick tokens through
`trinity.rollout.sampler.Sampler`.

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
(`_Pipeline`), each chunk with its own decoder (its own layers' KV cache).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from trinity.distributed import collectives
from trinity.errors import UserError
from trinity.rollout.types import Rollout, RolloutEngine, SamplingParams  # noqa: F401  (re-exported)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, P], mask [B, P]) with each prompt right-aligned."""
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            tokens[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p) :] = 1
    return tokens.to(device), mask.to(device)


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


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids [B] from fp32 logits [B, V]."""
    if params.temperature == 0:
        return logits.argmax(-1)
    filtered = _filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = filtered.softmax(-1)
    # multinomial draws on the generator's device (a CPU generator gives the same draws on any device)
    where = generator.device if generator is not None else probs.device
    picked = torch.multinomial(probs.to(where), 1, generator=generator).squeeze(-1)
    return picked.to(logits.device)


def _tp_broadcast(tokens: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        collectives.broadcast_(tokens, src=ps.get_tensor_model_parallel_src_rank(), group=ps.get_tensor_model_parallel_group())
    return tokens


class _Pipeline:
    """Hand-over between pipeline stages during generation (a no-op at PP=1): hidden states go from each
    stage to the next, the last stage's samples go back to every stage (see module doc).

    With virtual pipeline stages (VPP) every rank holds `chunks` model chunks and a token visits
    stage0.chunk0 -> ... -> stage(p-1).chunk0 -> stage0.chunk1 -> ... -> stage(p-1).chunk(V-1): megatron's
    previous / next pipeline ranks wrap around, so the hand-over of chunk v's output from the last stage
    to stage 0's chunk v+1 is the same send/recv. Only stage 0's chunk 0 embeds (receives nothing) and
    only the last stage's chunk V-1 computes logits (sends nothing)."""

    def __init__(self, gpt: Any, device: torch.device, dtype: torch.dtype) -> None:
        from megatron.core import parallel_state as ps

        gpts = list(gpt) if isinstance(gpt, (list, tuple)) else [gpt]
        self.chunks = len(gpts)
        self.size = ps.get_pipeline_model_parallel_world_size()
        self.first, self.last = (True, True) if self.size == 1 else (gpts[0].pre_process, gpts[-1].post_process)
        self.device, self.dtype, self.hidden_size = device, dtype, gpts[0].config.hidden_size
        if self.size > 1:
            self.group = ps.get_pipeline_model_parallel_group()
            self.src = ps.get_pipeline_model_parallel_last_rank()
            self.prev = ps.get_pipeline_model_parallel_prev_rank()
            self.next = ps.get_pipeline_model_parallel_next_rank()

    def recv(self, seq: int, batch: int, chunk: int = 0) -> torch.Tensor | None:
        """Model chunk `chunk`'s input [seq, batch, h] from the previous rank of the ring (None on the
        first stage's chunk 0, which embeds)."""
        if self.size == 1 or (self.first and chunk == 0):
            return None
        buf = torch.empty(seq, batch, self.hidden_size, dtype=self.dtype, device=self.device)
        return collectives.recv(buf, src=self.prev, group=self.group)

    def send(self, hidden: torch.Tensor, chunk: int | None = None) -> None:
        """Model chunk `chunk`'s output (default: the last chunk) to the next rank of the ring (nothing on
        the last stage's last chunk, which samples)."""
        chunk = self.chunks - 1 if chunk is None else chunk
        if self.size == 1 or (self.last and chunk == self.chunks - 1):
            return
        collectives.send(hidden.to(self.dtype), dst=self.next, group=self.group)

    def from_last(self, t: torch.Tensor) -> torch.Tensor:
        """`t` as the last stage holds it, on every stage."""
        return collectives.broadcast_(t, src=self.src, group=self.group) if self.size > 1 else t


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
def generate(
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
) -> Rollout:
    """Sample responses for `prompts` (token id lists) with a megatron GPTModel (or its DDP wrapper);
    at PP>1 every rank of the pipeline calls it with its own stage and gets the same `Rollout`; with
    virtual pipeline stages `model` is the rank's list of model chunks (in order).

    use_cache=False re-runs the whole sequence every step (the reference the KV-cache path is tested
    against); cuda_graphs=False runs the cached decode steps eagerly, compile=True compiles them with
    torch.compile (see `trinity.rollout.decode`).
    Returns a `Rollout` whose response width is the longest response generated.
    """
    from trinity.models.build import unwrap
    from trinity.rollout.decode import StaticDecoder
    from trinity.rollout.sampler import Sampler

    gpts = [unwrap(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
    param = next(gpts[0].parameters())
    device = param.device
    pipe = _Pipeline(gpts, device, param.dtype)
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
    sampler = Sampler(params, generator, device, vocab_size)
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
    responses = out_tokens[:, :width]
    response_mask = (torch.arange(width, device=device).unsqueeze(0) < lengths.unsqueeze(1)).long()
    logprobs = pipe.from_last(out_logp[:, :width].contiguous())
    return Rollout(
        tokens=torch.cat([tokens, responses], dim=1),
        prompt_mask=prompt_mask,
        response_mask=response_mask,
        logprobs=logprobs * response_mask,
    )

