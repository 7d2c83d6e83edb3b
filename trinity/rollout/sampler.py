"""The next token of every row and its log-prob, in one pass over the logits (a Triton kernel on CUDA), and
the torch ops it replaces.

Why: a decode step sampled with ~10 torch ops over the [rows, vocab] logits: an fp32 copy, the
temperature division, softmax, torch.multinomial's exponential draws, division and argmax, then a
log-softmax and a gather for the log-prob. At 512 rows and a 152k vocabulary each op moves 0.16-0.6 GB:
~4 GB a step, ~1.4 ms on an H100, as long as the 0.5B model's layers themselves. The kernel reads the
logits once (in their own dtype) and computes, per row:
- the token: argmax(x) at temperature 0 (the first index on ties, as torch.argmax); otherwise the
  Gumbel-max draw argmax(x / T + G), G = -log(-log U), which is a sample of softmax(x / T) (the
  distribution torch.multinomial draws from);
- its log-prob x[token] - logsumexp(x) under the temperature-1 distribution over the real vocabulary
  (`Rollout.logprobs`' definition), from the same pass (online max and sum of exponentials).

The uniforms U come from Philox keyed by `seed + key[row]` at counter = column // 4 (one call gives four
uniforms; column c takes the (c % 4)-th, a fixed map): the engines pass
key = output row x max_new_tokens + the token's index in the response, so a row's draws depend on the
seed, its place in the rollout and its logits only, not on the slot, the batch or the wave it ran in,
nor on the device. The seed is drawn from the caller's torch.Generator once per `generate` call.

Rows are split over `splits` programs (a rollout's tail has few rows; one program per row would leave
most of the GPU idle); a second kernel merges the splits. Both launches have fixed shapes for a given
(rows, splits), so the continuous engine captures them in its decode step's CUDA graph.

Top-k / top-p need a sort or a selection: `Sampler` uses the torch ops (`sample`)
for them, as it does where Triton does not run (CPU), after a failed first-use check, or where the
caller asks for them (`Sampler(fused=False)`).
"""

from __future__ import annotations

import torch

from trinity.rollout.first_use import checked_once, triton_runs, verdict
from trinity.rollout.parallel import tp_broadcast
from trinity.rollout.types import SamplingParams

try:  # triton ships with CUDA builds of torch; CPU runs use the torch ops
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

BLOCK = 2048  # columns per inner iteration
_TARGET_PROGRAMS = 264  # rows x splits to aim for: two programs per SM of an H100 (132)
_MAX_SPLITS = 64


def splits_for(rows: int, vocab: int, programs: int = _TARGET_PROGRAMS, block: int = BLOCK) -> int:
    """Programs per row: enough rows x splits to fill the GPU, each split at least a block of columns."""
    return max(1, min(_MAX_SPLITS, -(-programs // max(rows, 1)), -(-vocab // block)))


def available(device: torch.device, params: SamplingParams) -> bool:
    """Whether `Sampler` takes the kernel: Triton runs on `device` (CUDA, or its interpreter), no top-k /
    top-p truncation, and the first-use check on this device passed."""
    if not triton_runs(device):
        return False
    if params.temperature > 0 and ((0 < params.top_k) or params.top_p < 1.0):
        return False
    return checked_once(_CHECKED, (str(device),), lambda: _self_check(device))


_CHECKED: dict[tuple, bool] = {}


def _self_check(device: torch.device) -> bool:
    """The kernel against the torch ops on random logits: greedy tokens equal, log-probs of greedy and
    sampled tokens equal to log_softmax's, sampled tokens in the vocabulary; False (and a warning) on any
    error or difference."""
    def check() -> str | None:
        g = torch.Generator(device="cpu").manual_seed(0)
        # a few rows split over several programs (greedy and sampled), and enough rows for one program each
        for dtype, rows, vocab, temps in ((torch.bfloat16, 3, 5000, (0.0, 1.0)), (torch.float32, _TARGET_PROGRAMS, 700, (0.0,))):
            logits = (torch.randn(rows, vocab + 64, generator=g) * 3).to(device, dtype)
            keys = torch.arange(rows, device=device) * 7
            seed = torch.tensor([12345], device=device)
            ref = torch.log_softmax(logits[:, :vocab].float(), -1)
            picked = [fused_sample(logits, vocab, t, seed, keys) for t in temps]
            if not torch.equal(picked[0][0], ref.argmax(-1)):
                return "greedy tokens differ from argmax"
            if any(int(tok.min()) < 0 or int(tok.max()) >= vocab for tok, _ in picked):
                return "a sampled token outside the vocabulary"
            for tok, logp in picked:
                err = float((logp - ref.gather(-1, tok[:, None])[:, 0]).abs().max())
                if err > 1e-4:
                    return f"log-prob differs from log_softmax by {err:.2e}"
        return None

    return verdict(check, "fused sampler disabled ({reason}); the rollout samples with the torch ops")


if triton is not None:

    @triton.jit
    def _partial_kernel(X, SEED, KEYS, MX, SUM, BEST, IDX, sx, vocab, chunk, n_blocks, inv_t,
                        GREEDY: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        """Row `i`, columns [s * chunk, (s + 1) * chunk) of the real vocabulary: the running max and sum of
        exp(x - max) (online softmax), and the best score (x, or x / T + Gumbel noise) and its column."""
        i = tl.program_id(0)
        s = tl.program_id(1)
        start = s * chunk
        end = tl.minimum(start + chunk, vocab)
        m = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)
        best = tl.full([], float("-inf"), tl.float32)
        best_i = tl.zeros([], tl.int32)
        seed = tl.load(SEED).to(tl.int64) + tl.load(KEYS + i).to(tl.int64)
        row = X + i.to(tl.int64) * sx
        for k in range(n_blocks):
            cols = start + k * BLOCK + tl.arange(0, BLOCK)
            ok = cols < end
            x = tl.load(row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing yet: no NaN from -inf - -inf
            total = total * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), 0)
            m = m_new
            if GREEDY:
                score = x
            else:
                # one Philox call gives 4 uniforms: column group (c // 4) draws them, column c takes the
                # (c % 4)-th in the join's order (a fixed map, so a column's uniform ignores the split)
                groups = (start + k * BLOCK) // 4 + tl.arange(0, BLOCK // 4)
                u0, u1, u2, u3 = tl.rand4x(seed, groups)
                u = tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), [BLOCK])
                score = x * inv_t - tl.log(-tl.log(u))
            score = tl.where(ok, score, float("-inf"))
            top = tl.max(score, 0)
            at = tl.argmax(score, 0)  # the first on ties
            take = top > best  # strictly: an earlier block keeps a tie
            best_i = tl.where(take, start + k * BLOCK + at, best_i)
            best = tl.where(take, top, best)
        out = i * SPLITS + s
        tl.store(MX + out, m)
        tl.store(SUM + out, total)
        tl.store(BEST + out, best)
        tl.store(IDX + out, best_i)

    @triton.jit
    def _merge_kernel(X, MX, SUM, BEST, IDX, TOK, LOGP, sx,
                      SPLITS: tl.constexpr, S_PAD: tl.constexpr):
        """Row `i`: the splits' best column (the first split on ties) and log p of it."""
        i = tl.program_id(0)
        sp = tl.arange(0, S_PAD)
        ok = sp < SPLITS
        m = tl.load(MX + i * SPLITS + sp, mask=ok, other=float("-inf"))
        total = tl.load(SUM + i * SPLITS + sp, mask=ok, other=0.0)
        best = tl.load(BEST + i * SPLITS + sp, mask=ok, other=float("-inf"))
        idx = tl.load(IDX + i * SPLITS + sp, mask=ok, other=0)
        top = tl.max(m, 0)
        lse = top + tl.log(tl.sum(tl.where(m == float("-inf"), 0.0, total * tl.exp(m - top)), 0))
        k = tl.argmax(best, 0)
        tok = tl.sum(tl.where(sp == k, idx, 0), 0)
        x = tl.load(X + i.to(tl.int64) * sx + tok).to(tl.float32)
        tl.store(TOK + i, tok.to(tl.int64))
        tl.store(LOGP + i, x - lse)


def fused_sample(logits: torch.Tensor, vocab_size: int, temperature: float, seed: torch.Tensor,
                 keys: torch.Tensor, tune: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [b] int64, log p [b] fp32) from logits [b, >= vocab_size] (any float dtype, unit column
    stride); seed [1] and keys [b] integer tensors on the logits' device (module doc). `tune`
    (benchmarks/decode_kernels.py): block, num_warps, programs (the rows x splits to aim for)."""
    tune = tune or {}
    block = tune.get("block", BLOCK)
    b = logits.shape[0]
    assert logits.stride(1) == 1 and logits.shape[1] >= vocab_size
    splits = splits_for(b, vocab_size, tune.get("programs", _TARGET_PROGRAMS), block)
    chunk = -(-(-(-vocab_size // splits)) // block) * block  # columns per split, whole blocks
    splits = -(-vocab_size // chunk)  # every split holds a column
    dev = logits.device
    mx = torch.empty(b, splits, dtype=torch.float32, device=dev)
    total, best = torch.empty_like(mx), torch.empty_like(mx)
    idx = torch.empty(b, splits, dtype=torch.int32, device=dev)
    greedy = temperature <= 0
    launch = {"num_warps": tune["num_warps"]} if "num_warps" in tune else {}
    _partial_kernel[(b, splits)](logits, seed, keys, mx, total, best, idx, logits.stride(0), vocab_size, chunk,
                                 chunk // block, 0.0 if greedy else 1.0 / temperature,
                                 GREEDY=greedy, SPLITS=splits, BLOCK=block, **launch)
    tokens = torch.empty(b, dtype=torch.long, device=dev)
    logp = torch.empty(b, dtype=torch.float32, device=dev)
    _merge_kernel[(b,)](logits, mx, total, best, idx, tokens, logp, logits.stride(0),
                        SPLITS=splits, S_PAD=triton.next_power_of_2(splits))
    return tokens, logp


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


def keyed_sample(logits: torch.Tensor, params: SamplingParams, seed: int, keys: torch.Tensor) -> torch.Tensor:
    """`sample` with row i drawn from a CPU generator seeded with seed + keys[i] (`Sampler(keyed=True)`)."""
    filtered = _filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = filtered.softmax(-1).cpu()
    out = torch.empty(probs.shape[0], dtype=torch.long)
    for i, key in enumerate(keys.tolist()):
        g = torch.Generator().manual_seed((seed + int(key)) % 2**63)
        out[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    return out.to(logits.device)


def draw_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One seed [1] int64 on `device` from `generator` (torch's default one if None), drawn on the
    generator's device: a CUDA generator draws without a host sync."""
    where = generator.device if generator is not None else device
    return torch.randint(0, 2**62, (1,), generator=generator, device=where).to(device)


class Sampler:
    """How one generation call picks tokens: the kernel (`fused`) where `available` and wanted, else the torch ops
    with the caller's generator. `keys` name each row's draw (module doc); the torch ops ignore them.

    Tensor parallelism: every TP rank holds the same gathered logits; TP rank 0's tokens are broadcast to
    its group and the log-probs are taken of those tokens, so every rank books the same tokens and
    log-probs (the kernel's seed is TP rank 0's too)."""

    def __init__(self, params: SamplingParams, generator: torch.Generator | None, device: torch.device,
                 vocab_size: int, *, fused: bool = True, keyed: bool = False, seed: int | None = None) -> None:
        self.params, self.generator, self.vocab_size = params, generator, vocab_size
        self.fused = fused and available(device, params)
        greedy = params.temperature <= 0
        # keyed: the torch ops on CPU draw each row from its own generator seeded by (seed, key), so that
        # a row's draws ignore the batch it runs in, as the kernel's do (partial rollouts: an answer
        # continued in a later rollout draws what one uninterrupted decode draws)
        self.keyed = keyed and not self.fused and not greedy and device.type == "cpu"
        wants_seed = (self.fused or self.keyed) and not greedy
        # `seed`: the kernel's (and keyed draws') seed, instead of one drawn from `generator` (partial rollouts
        # keep one for every rollout while the torch ops' generator changes per rollout)
        if not wants_seed:
            first = torch.zeros(1, dtype=torch.long, device=device)
        elif seed is not None:
            first = torch.tensor([seed % 2**62], dtype=torch.long, device=device)
        else:
            first = draw_seed(generator, device)
        self.seed = tp_broadcast(first)

    def __call__(self, logits: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [b], log p [b] fp32) from logits [b, >= vocab] (vocabulary padding ignored)."""
        if self.fused:
            nxt, logp = fused_sample(logits, self.vocab_size, self.params.temperature, self.seed, keys)
            return tp_broadcast(nxt), logp
        last = logits[:, : self.vocab_size].float()
        picked = keyed_sample(last, self.params, int(self.seed), keys) if self.keyed else sample(last, self.params, self.generator)
        nxt = tp_broadcast(picked.contiguous())
        return nxt, torch.log_softmax(last, -1).gather(-1, nxt.unsqueeze(-1)).squeeze(-1)

    @property
    def label(self) -> str:
        return "fused" if self.fused else "torch"
