"""KV-cached decoding over a static cache, replayed as one CUDA graph per step where it can be.

megatron-core's `StaticInferenceContext` grows the keys it attends to by one slot per step and slices
the cache with Python integers, so every decode step has new shapes: it cannot be captured, and at
batch 64 a 0.5B model spent ~40 ms of CPU per step launching ~850 kernels for ~3 ms of GPU work
(benchmarks/NOTES.md). Here the cache has its final length from the start (rounded up to a multiple
of 64, the extra slots masked) and the current slot is a tensor: each step writes its key/value at
`slot` (`index_copy_`) and attends over the whole cache with a mask (`key <= slot` and the key is a
real token), so every step has the same shapes and the same tensors, and one CUDA graph captured at
the first decode step replays all the others.

Two ways through a layer, same weights:
- the lean path (dense MLPs, our spec's torch norms: the common rollout case, at any TP) reads the
  parameters of megatron's submodules and runs each layer as ~17 kernels: RoPE on the query and key
  heads of a group at once, residual adds folded into the output GEMMs (`addmm`), and grouped-query
  attention as plain attention over the query group's heads stacked along the query axis (a decode
  step's query heads of one group share its keys: no repeated K/V, no GQA fallback kernel). At TP>1 a
  rank holds its column-parallel shards (its query groups, its half of the MLP) and the row-parallel
  output GEMMs give partial sums, all-reduced over the TP group before the residual add, as megatron's
  RowParallelLinear does (`_row_parallel_add`); the rollout runs with sequence parallel off;
- the module path (MoE layers, TransformerEngine's fused-norm layers) calls the submodules
  themselves (`get_query_key_value_tensors` with its QK-norms, `linear_proj`, the MLP or MoE layer);
  DeepSeek's multi-latent attention takes it too, its per-head keys and values expanded from the latent
  (`trinity.rollout.decode_mla`), without CUDA graphs.
Gemma's layer options take the module path: a layer's own RoPE table (`rope_table`, Gemma 3's sliding
layers), its core attention's sliding window (a band in the mask) and score cap (`softcapped_attention`
instead of SDPA), its post-norms (sandwich layers); the embedding scale and the final-logit cap are
hooks on megatron's modules (trinity.models.build), which the decoders call.
Both compute megatron's attention block: RMSNorm, QKV, QK-norm, RoPE by cache slot (megatron's table
and formula), softmax attention, output projection, SwiGLU MLP. Masking follows `generate`'s
left-padding rules: a padding key is masked, except for the padding query at the same slot (a row with
every key masked would give NaN).

Pipeline parallelism: each stage's decoder holds the KV cache of its own layers only. The first stage
embeds the tokens, the others take the previous stage's hidden states [s, b, h] (`hidden=`); the last
stage returns logits, the others their hidden states, which `generate` sends on. The step's inputs
(token, slot, incoming hidden state) are static buffers, so a stage's compute is captured the same way.

CUDA graphs are used on CUDA with dense MLPs, at TP>1 too: NCCL's collectives are captured with the
layers (NCCL >= 2.9), and every TP rank captures and replays the same graphs, since all ranks make the same
scheduling decisions. Elsewhere (CPU, MoE routing that syncs with the host) the same static-shape step
runs eagerly. A graph
is captured per `generate` call: offload between RL phases re-allocates parameter storages, and a
graph replays the addresses it was captured with.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from trinity.distributed import collectives
from trinity.models import lora  # the lean path's linears: base weight + active LoRA adapter
from trinity.models.rope import rotate_half
from trinity.models.spec import post_norm
from trinity.rollout import decode_mla

_CACHE_MULTIPLE = 64  # cache length granularity: aligned rows for the attention kernels' mask reads


def _lean_supported(gpt: Any) -> bool:
    """Whether every layer of this chunk is one the lean path computes exactly: torch RMSNorms (our
    spec), a dense gated-SiLU MLP, non-interleaved RoPE over the whole cache, no sequence parallel (the
    RL rollout switches it off: `trinity.trainer.recipes.rl.SequenceParallelOff`)."""
    config = gpt.config
    if config.rotary_interleaved or config.sequence_parallel:
        return False
    if not (config.gated_linear_unit and config.activation_func is F.silu and config.normalization == "RMSNorm"):
        return False
    norms = [gpt.decoder.final_layernorm] if gpt.post_process else []
    for layer in gpt.decoder.layers:
        attn, mlp = layer.self_attention, layer.mlp
        if _layer_options(layer)[1:] != (None, False, False):  # windows: the lean path's masks
            return False
        if hasattr(mlp, "router") or not hasattr(mlp, "linear_fc1"):
            return False
        if post_norm(attn) is not None or post_norm(mlp) is not None:  # GLM-4's block-output norms
            return False
        norms += [layer.input_layernorm, layer.pre_mlp_layernorm]
        if config.qk_layernorm:
            norms += [attn.q_layernorm, attn.k_layernorm]
        if getattr(mlp.linear_fc1, "bias", None) is not None or getattr(mlp.linear_fc2, "bias", None) is not None:
            return False
    return all(type(n) is torch.nn.RMSNorm for n in norms)


def _layer_options(layer: Any) -> tuple[int | None, float | None, bool, bool]:
    """(sliding window: keys before the query, score cap, sandwich norms, own RoPE table) of a layer
    (trinity.models.attention, trinity.models.layer)."""
    core = layer.self_attention.core_attention
    return (getattr(core, "window", None), getattr(core, "softcap", None), bool(getattr(layer, "sandwich", False)),
            getattr(layer, "rotary", None) is not None)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float,
           softcap: float | None) -> torch.Tensor:
    """The module path's attention: q [b, heads, s, d], k/v [b, groups, keys, d], `allowed` boolean (True =
    attend) or an additive mask; SDPA, or the capped scores of `softcapped_attention` (Gemma 2)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    from trinity.models.attention import softcapped_attention

    assert allowed is None or allowed.dtype == torch.bool
    return softcapped_attention(q, k, v, allowed, scale, softcap)


def _rms(x: torch.Tensor, norm: torch.nn.RMSNorm) -> torch.Tensor:
    return F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron's `_apply_rotary_pos_emb_bshd` (same ops, same order, same dtype) with the cos/sin of
    its table already taken; cos/sin broadcast over every dimension but the last."""
    rot = cos.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    out = x * cos + rotate_half(x) * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


_capture_streams: dict[int, "torch.cuda.Stream"] = {}


def capture_graph(fn: Callable[[], Any], *, pool: Any = None, warm: Callable[[], Any] | None = None,
                  ) -> tuple["torch.cuda.CUDAGraph", Any]:
    """fn() captured as a CUDA graph (returns the graph and fn's output, whose buffers the replays
    rewrite), on one capture stream per device; `warm` runs first on that stream (lazy initialisations,
    cuBLAS workspaces, Triton compiles: what must not happen during a capture).

    Why not `torch.cuda.graph`: it synchronizes the device and empties the caching allocator before
    every capture. A rollout at real lengths captures one graph per batch bucket it reaches (~10 for
    lognormal lengths, mid-rollout): each capture waited for the queued steps, and each `empty_cache`
    handed every cached block back to the driver, so the next allocations (the rest of the rollout, the
    next training phase) paid cudaMalloc again. Ordering needs neither: the capture stream waits for the
    current stream, and the current stream waits for the capture."""
    device = torch.cuda.current_device()
    stream = _capture_streams.get(device)
    if stream is None:  # one stream for every capture: its cuBLAS workspace is created once, at a warm-up
        stream = _capture_streams[device] = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if warm is not None:
            warm()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool)
        try:
            out = fn()
        except BaseException:
            # the error above invalidated the capture; ending it raises "a previous error during
            # capture", which would hide the error that says what went wrong
            try:
                graph.capture_end()
            except Exception:
                pass
            raise
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out


def block_output(attn: Any, out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The attention block's output from its output projection's (the module path calls `linear_proj`
    itself): bias added, then the block's post norm where the spec has one (GLM-4)."""
    out = out if bias is None else out + bias
    norm = post_norm(attn)
    return out if norm is None else norm(out)


class StageDecoder:
    """What every KV-cached decoder of one pipeline stage of a megatron GPTModel shares
    (`StaticDecoder` here, `trinity.rollout.slots.SlotDecoder`): this TP rank's attention geometry, a
    [rows, groups, cache_len, head_dim] key and value cache per layer, megatron's RoPE table with its
    cos/sin, the way through a layer (`lean`), whether decode steps are captured as CUDA graphs, and the
    layers themselves: the embedding, the lean and module layer loops and the logits head. A decoder
    supplies only its attention (`_lean_attention`, `_module_attend`: where keys and values go, what a
    query reads). One place, so that both decoders compute a layer the same way."""

    def __init__(self, gpt: Any, rows: int, cache_len: int, *, cuda_graphs: bool) -> None:
        from megatron.core import parallel_state as ps

        self.gpt, self.config = gpt, gpt.config
        self.layers = list(gpt.decoder.layers)
        first = self.layers[0].self_attention
        self.heads = first.num_attention_heads_per_partition
        # MLA (trinity.rollout.decode_mla): per-head keys and values from the latent, one head per group,
        # values narrower than keys; its layers hold the RoPE table, YaRN's cos/sin factor `mscale`
        self.mla = decode_mla.is_mla(gpt)
        if self.mla:
            self.groups = self.heads
            self.head_dim, self.v_dim = decode_mla.head_dims(first)
        else:
            self.groups, self.head_dim = first.num_query_groups_per_partition, first.hidden_size_per_attention_head
            self.v_dim = self.head_dim
        param = next(gpt.parameters())
        self.device, self.dtype = param.device, param.dtype
        shape = (rows, self.groups, cache_len, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        vshape = (rows, self.groups, cache_len, self.v_dim)
        self.values = [torch.zeros(vshape, dtype=self.dtype, device=self.device) for _ in self.layers]
        # [cache_len, 1, 1, rot_dim]: megatron's rotary table (rope scaling included), indexed by position
        self.freqs, self.mscale = decode_mla.rotary(gpt, cache_len) if self.mla else (gpt.rotary_pos_emb(cache_len), 1.0)
        rot = self.freqs.shape[-1]
        # megatron casts cos/sin of its table to the activations' dtype before rotating
        self.cos = torch.cos(self.freqs).to(self.dtype).view(cache_len, rot)
        self.sin = torch.sin(self.freqs).to(self.dtype).view(cache_len, rot)
        self.scale = first.softmax_scale if self.mla else (self.config.softmax_scale or self.head_dim**-0.5)
        # per layer (Gemma's options, `_layer_options`): its RoPE table, sliding window, score cap and
        # the norms after attention and after the MLP (identities without sandwich norms)
        self.layer_freqs = [layer.rope_table(self.freqs) if hasattr(layer, "rope_table") else self.freqs
                            for layer in self.layers]
        options = [_layer_options(layer) for layer in self.layers]
        self.windows = [o[0] for o in options]
        self.softcaps = [o[1] for o in options]
        self.post_norms = [(layer.post_self_attn_layernorm, layer.post_mlp_layernorm) if o[2] else (_identity, _identity)
                           for layer, o in zip(self.layers, options)]
        self.lean = not self.mla and _lean_supported(gpt)
        # the lean path's all-reduce after each row-parallel GEMM (None at TP=1)
        self.tp_group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
        # no graphs with MoE routing (it syncs with the host); TP>1's all-reduces are captured with the layers
        dense = all(not hasattr(layer.mlp, "router") for layer in self.layers)
        self.use_graph = cuda_graphs and self.device.type == "cuda" and dense and not self.mla
        self.first, self.last = gpt.pre_process, gpt.post_process

    def _module_qkv(self, attn: Any, hidden: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v [s, b, heads|groups, d] of the module path, RoPE applied (MLA: per-head K/V expanded from
        the latent, `decode_mla`)."""
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        if self.mla:
            return decode_mla.qkv(attn, hidden, freqs, self.mscale)
        q, k, v = attn.get_query_key_value_tensors(hidden, None)
        return apply_rotary_pos_emb(q, freqs, config=self.config), apply_rotary_pos_emb(k, freqs, config=self.config), v

    def _residual_stream(self, x: torch.Tensor) -> torch.Tensor:
        """x [s, b, h] as the [s*b, h] residual stream the lean layers overwrite (`_row_parallel_add` adds in
        place). The first stage's is its embedding's fresh output; a later stage's input is the received
        hidden state, on CUDA a graph's static input buffer, which a step must not change: a graph's
        warm-up runs the step before the capture, and the first replay reads that buffer again."""
        x = x.reshape(-1, x.shape[-1])
        return x if self.first else x.clone()

    def _row_parallel_add(self, residual: torch.Tensor, x: torch.Tensor, module: Any) -> torch.Tensor:
        """residual + x W^T (+ the active adapter) of a row-parallel linear (`linear_proj`, `linear_fc2`),
        its bias left to the caller. At TP=1 the add is folded into the GEMM, in place (`residual`, from
        `_residual_stream`, is overwritten); at TP>1 this rank's product
        (its input columns, its adapter A shard) is a partial sum, all-reduced over the TP group first."""
        if self.tp_group is None:
            return lora.addmm(residual, x, module)
        y = lora.linear(x, module)
        collectives.all_reduce_(y, group=self.tp_group)
        return residual + y


    # ---- the layer path both decoders run -----------------------------------------------------------
    # A decoder supplies its attention (where it stores keys and values, what it attends over): the lean
    # path's `_lean_attention` and the module path's `_module_attend`, both reading `ctx`, the decoder's
    # own description of the forward (its cache positions, masks).
    def _embed(self, tokens: torch.Tensor, position_ids: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        """The stage's input [s, b, h]: the embedded tokens [b, s] on the first stage, else `hidden`."""
        if self.first:
            return self.gpt.embedding(input_ids=tokens, position_ids=position_ids)
        assert hidden is not None, "a non-first pipeline stage needs the previous stage's hidden states"
        return hidden

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, ctx: dict) -> torch.Tensor:
        """x [s, b, h] through this stage's layers; positions [s, b] (per row) or [s, 1] (every row at the
        same positions): where RoPE rotates each query and key."""
        s, b, h = x.shape
        if self.lean:
            cos = sin = None  # the fused kernels read the table at each row's position
            if not self._rope_in_kernel(ctx):
                idx, shape = positions.reshape(-1), (*positions.shape, 1, 1, -1)
                cos, sin = self.cos.index_select(0, idx).view(shape), self.sin.index_select(0, idx).view(shape)
            x = self._residual_stream(x)
            for i, layer in enumerate(self.layers):
                x = self._lean_layer(i, layer, x, s, b, cos, sin, ctx)
            return x.view(s, b, h)
        tables: dict[int, torch.Tensor] = {}  # a layer's RoPE rows at `positions`, one gather per distinct table
        for i, layer in enumerate(self.layers):
            table = self.layer_freqs[i]
            if id(table) not in tables:
                tables[id(table)] = table.index_select(0, positions.reshape(-1)).view(*positions.shape, 1, -1)
            post_attention, post_mlp = self.post_norms[i]
            x = x + post_attention(self._module_attention(i, layer, layer.input_layernorm(x), tables[id(table)], ctx))
            out, bias = layer.mlp(layer.pre_mlp_layernorm(x))
            x = x + post_mlp(out if bias is None else out + bias)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, b, h] -> logits [b, vocab (gathered over TP, padded)]."""
        x = self.gpt.decoder.final_layernorm(x)
        weight = self.gpt.shared_embedding_or_output_weight() if self.gpt.share_embeddings_and_output_weights else None
        logits, _ = self.gpt.output_layer(x, weight=weight, runtime_gather_output=True)
        return logits[0]

    def _rope_in_kernel(self, ctx: dict) -> bool:
        """Whether this forward's lean attention applies RoPE itself (a fused decode kernel)."""
        return False

    def _lean_layer(self, i: int, layer: Any, x: torch.Tensor, s: int, b: int, cos: torch.Tensor | None,
                    sin: torch.Tensor | None, ctx: dict) -> torch.Tensor:
        """One layer on the residual stream x [s*b, h] (row = position-major, as megatron's [s, b, h])."""
        attn = layer.self_attention
        qkv = lora.linear(_rms(x, layer.input_layernorm), attn.linear_qkv, attn.linear_qkv.bias)
        # megatron's layout: per group, its query heads, key, value
        qkv = qkv.view(s, b, self.groups, self.heads // self.groups + 2, self.head_dim)
        return self._lean_rest(layer, x, self._lean_attention(i, attn, qkv, cos, sin, ctx))

    def _lean_qkv(self, attn: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [s, b, g, per, d], k [s, b, g, 1, d], v [s, b, g, d] of the QKV projection [s, b, g, per + 2, d]:
        QK-norms, then RoPE."""
        per = self.heads // self.groups
        if self.config.qk_layernorm:
            q = _rope(_rms(qkv[:, :, :, :per], attn.q_layernorm), cos, sin)
            k = _rope(_rms(qkv[:, :, :, per:per + 1], attn.k_layernorm), cos, sin)
        else:  # a group's query heads and its key head are adjacent: rotate them together
            qk = _rope(qkv[:, :, :, :per + 1], cos, sin)
            q, k = qk[:, :, :, :per], qk[:, :, :, per:]
        return q, k, qkv[:, :, :, per + 1]

    def _lean_attention(self, i: int, attn: Any, qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                        ctx: dict) -> torch.Tensor:
        """Layer i's attention output [s*b, heads*d] from its QKV projection [s, b, g, per + 2, d] (the
        decoder's: its cache, its masks)."""
        raise NotImplementedError

    def _lean_rest(self, layer: Any, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A lean layer after its attention: output projection + residual, then the SwiGLU MLP + residual."""
        attn, mlp = layer.self_attention, layer.mlp
        x = self._row_parallel_add(x, out, attn.linear_proj)
        if attn.linear_proj.bias is not None:
            x = x + attn.linear_proj.bias
        up = lora.linear(_rms(x, layer.pre_mlp_layernorm), mlp.linear_fc1)
        return self._row_parallel_add(x, self._swiglu(up), mlp.linear_fc2)

    def _swiglu(self, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * value of up = [gate | value] (SlotDecoder: a fused kernel where it runs)."""
        gate, value = torch.chunk(up, 2, dim=-1)
        return F.silu(gate) * value

    def _module_attention(self, i: int, layer: Any, hidden: torch.Tensor, freqs: torch.Tensor, ctx: dict) -> torch.Tensor:
        """The module path's attention block of layer i on hidden [s, b, h] (RoPE rows `freqs`)."""
        attn = layer.self_attention
        q, k, v = self._module_qkv(attn, hidden, freqs)
        out = self._module_attend(i, q, k, v, ctx)  # [b, heads, s, v_dim]
        s, b = hidden.shape[:2]
        out, bias = attn.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.v_dim))
        return block_output(attn, out, bias)

    def _module_attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: dict) -> torch.Tensor:
        """Layer i's keys and values k/v [s, b, groups, d] into the cache, and the attention of q [s, b,
        heads, d] over the cache: [b, heads, s, v_dim] (the decoder's)."""
        raise NotImplementedError


class StaticDecoder(StageDecoder):
    """Prefill and single-token steps of one pipeline stage of a megatron GPTModel (the whole model at
    PP=1) over a [batch, max_len] KV cache of its own layers."""

    def __init__(self, gpt: Any, batch: int, max_len: int, *, cuda_graphs: bool = True, compile: bool = False) -> None:
        cache_len = -(-max_len // _CACHE_MULTIPLE) * _CACHE_MULTIPLE
        super().__init__(gpt, batch, cache_len, cuda_graphs=cuda_graphs)
        self.valid = torch.zeros(batch, cache_len, dtype=torch.bool, device=self.device)
        self.positions = torch.arange(cache_len, device=self.device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._token = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self._slot = torch.zeros(1, dtype=torch.long, device=self.device)
        # the previous stage's hidden state of the decode step (non-first pipeline stages)
        self._hidden = None if self.first else torch.zeros(1, batch, self.config.hidden_size, dtype=self.dtype, device=self.device)
        self._graph_out: torch.Tensor | None = None  # the captured step's output buffer
        # torch.compile fuses the pointwise work between the GEMMs (norms, RoPE, cache writes, SwiGLU);
        # shapes only change with (batch, max_len), so a process compiles once or twice.
        self._run_step = torch.compile(self._step) if compile else self._step

    # ---- its attention over the [batch, cache_len] cache: every row's new keys at the same slots -------
    def _lean_attention(self, i: int, attn: Any, qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                        ctx: dict) -> torch.Tensor:
        s, b, g, _, d = qkv.shape
        per = self.heads // g
        q, k, v = self._lean_qkv(attn, qkv, cos, sin)
        self.keys[i].index_copy_(2, ctx["slots"], k.squeeze(3).permute(1, 2, 0, 3))
        self.values[i].index_copy_(2, ctx["slots"], v.permute(1, 2, 0, 3))
        # the group's query heads along the query axis: [b, g, per*s, d] against its own keys
        q = q.permute(1, 2, 3, 0, 4).reshape(b, g, per * s, d)
        out = F.scaled_dot_product_attention(q, self.keys[i], self.values[i], attn_mask=ctx["biases"][i], scale=self.scale)
        return out.view(b, g, per, s, d).permute(3, 0, 1, 2, 4).reshape(s * b, g * per * d)

    def _module_attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: dict) -> torch.Tensor:
        self.keys[i].index_copy_(2, ctx["slots"], k.permute(1, 2, 0, 3))
        self.values[i].index_copy_(2, ctx["slots"], v.permute(1, 2, 0, 3))
        return attend(q.permute(1, 2, 0, 3), self.keys[i], self.values[i], ctx["masks"][i], self.scale, self.softcaps[i])

    def _forward(self, tokens: torch.Tensor, slots: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        """Logits [b, vocab (gathered over TP, padded)] of the last position on the last pipeline stage,
        hidden states [s, b, h] elsewhere; tokens [b, s] sit at `slots` [s]; `hidden` is the previous
        stage's output (non-first stages)."""
        # attend to keys at or before the query's slot that are real tokens (or the query itself)
        k_pos = self.positions.view(1, 1, 1, -1)
        q_pos = slots.view(1, 1, -1, 1)
        mask = (k_pos <= q_pos) & (self.valid.view(self.valid.shape[0], 1, 1, -1) | (k_pos == q_pos))
        # a window layer's keys: the query's own slot and the `window` before it (left padding only
        # precedes a row's tokens, so slot distance is token distance)
        windowed = {w: mask & (k_pos >= q_pos - w) for w in set(self.windows) if w is not None}
        masks = [mask if w is None else windowed[w] for w in self.windows]
        ctx: dict = {"slots": slots, "masks": masks}
        if self.lean:
            # the lean path's additive masks, once per call for every layer with that mask: [b, 1, per*s,
            # keys], rows in (head, query) order
            b, s = tokens.shape
            per = self.heads // self.groups
            biases: dict[int, torch.Tensor] = {}
            for m in masks:
                if id(m) not in biases:
                    bias = torch.zeros(m.shape, dtype=self.dtype, device=self.device).masked_fill_(~m, float("-inf"))
                    biases[id(m)] = bias.unsqueeze(2).expand(b, 1, per, s, m.shape[-1]).reshape(b, 1, per * s, m.shape[-1])
            ctx["biases"] = [biases[id(m)] for m in masks]
        x = self._embed(tokens, slots.unsqueeze(0).expand_as(tokens), hidden)
        x = self._layers(x, slots.view(-1, 1), ctx)
        return self._logits(x[-1:]) if self.last else x

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, key_mask: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run the left-padded prompts [b, P] (key_mask 1 on real tokens) into slots 0..P-1; `hidden`
        [P, b, h]: the previous pipeline stage's output (non-first stages)."""
        self.valid[:, : tokens.shape[1]] = key_mask.bool()
        return self._forward(tokens, self.positions[: tokens.shape[1]], hidden)

    @torch.no_grad()
    def step(self, token: torch.Tensor, slot: int, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one new token per row [b] at `slot` (`hidden` [1, b, h] from the previous pipeline stage
        on non-first stages); returns the next logits [b, vocab] (hidden states [1, b, h] on non-last
        stages; a graph's output buffer, valid until the next step)."""
        self._token.copy_(token.view(-1, 1))
        self._slot.fill_(slot)
        if self._hidden is not None:
            assert hidden is not None, "a non-first pipeline stage needs the previous stage's hidden state"
            self._hidden.copy_(hidden)
        if not self.use_graph:
            return self._run_step()
        if self._graph is None:
            self._capture()
        self._graph.replay()
        return self._graph_out

    def _step(self) -> torch.Tensor:
        self.valid.index_fill_(1, self._slot, True)
        return self._forward(self._token, self._slot, self._hidden)

    def _capture(self) -> None:
        # Warm-up before capture (lazy inits, cuBLAS workspaces, a compiled step's first runs), as torch
        # advises. It writes this step's key/value at this step's slot, as the replay below does again.
        def warm() -> None:
            for _ in range(2):
                self._run_step()

        self._graph, self._graph_out = capture_graph(self._run_step, warm=warm)
