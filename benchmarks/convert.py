"""Conversion benchmark: a random Qwen2-shaped HF checkpoint, HF -> MCore -> HF, next to the disk floors.

    python benchmarks/convert.py --shape small --device cpu   # CPU check (well under a minute)
    python benchmarks/convert.py                               # Qwen2.5-7B shape, ~15 GB bf16, GPU if present

Each conversion runs in its own process so that its peak resident memory is its own (sampled RSS of
that process; ru_maxrss is inherited across fork/exec). The floors are measured in the same run on
the same bytes, each with 1, 2, 4 and 8 concurrent streams (disks and the page cache deliver several
times more with a few requests in flight): the read floor reads every HF shard, the write floor
writes as many bytes again with fsync. Each direction is compared with its own floor (as issue 4
defines them), taking the fastest stream count of each:
    hf-to-mcore  vs  read + write  (it reads the HF shards and writes the dist checkpoint)
    mcore-to-hf  vs  write         (it writes the HF shards)
A line after the table gives the ratios to the single-stream floors too. The HF shards were just
written, so the reads (floor and conversion alike) may come from the page cache; both see the same
cache state. Each conversion row lists its phases (build, load, save or write).

The default (`--shape 7b`, `--device auto`) took about 2 min 30 s on an H100 machine (16 cores) and
needs 2x the model (30 GB) of free disk in the work folder: the random checkpoint is tiled from one
random pool (no per-element RNG), the HF source is deleted once converted, and nothing is verified
(run `trinity convert ... --verify` for that).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
    "medium": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=8, num_attention_heads=12,
                   num_key_value_heads=2, vocab_size=151936),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=32000),
}
POOL = 1 << 24  # random bf16 values every tensor is cut from (32 MiB)


def make_checkpoint(out: Path, shape: dict) -> int:
    """Random bf16 Qwen2 checkpoint written tensor by tensor (never the whole model in memory).

    Values are slices of one random pool at varying offsets: random enough for a conversion (whose
    speed does not depend on the values), and fast (no RNG per element for 7.6 B elements)."""
    import torch

    from trinity.convert.hf_io import write_shards

    h, f, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv, V = shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"]
    hd = h // heads
    g = torch.Generator().manual_seed(0)
    pool = (torch.randn(2 * POOL, generator=g) * 0.02).to(torch.bfloat16)
    offset = 0

    def r(*s: int) -> torch.Tensor:
        nonlocal offset
        n = 1
        for d in s:
            n *= d
        out = torch.empty(n, dtype=torch.bfloat16)
        done = 0
        while done < n:
            start = (offset + 7919 * done) % POOL
            k = min(n - done, POOL)
            out[done:done + k] = pool[start:start + k]
            done += k
        offset += 104729
        return out.view(*s)

    def tensors():
        yield "model.embed_tokens.weight", r(V, h)
        for i in range(L):
            p = f"model.layers.{i}"
            yield f"{p}.input_layernorm.weight", r(h)
            yield f"{p}.post_attention_layernorm.weight", r(h)
            for n, rows in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
                yield f"{p}.self_attn.{n}_proj.weight", r(rows, h)
                yield f"{p}.self_attn.{n}_proj.bias", r(rows)
            yield f"{p}.self_attn.o_proj.weight", r(h, heads * hd)
            yield f"{p}.mlp.gate_proj.weight", r(f, h)
            yield f"{p}.mlp.up_proj.weight", r(f, h)
            yield f"{p}.mlp.down_proj.weight", r(h, f)
        yield "model.norm.weight", r(h)
        yield "lm_head.weight", r(V, h)

    out.mkdir(parents=True)
    written, _ = write_shards(tensors(), out, dtype=None)
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "bfloat16",
           "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "tie_word_embeddings": False, "hidden_act": "silu", **shape}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return written


STREAMS = (1, 2, 4, 8)  # the floors are the fastest of these numbers of concurrent streams


def read_floor(src: Path, streams: int) -> tuple[float, int]:
    """Seconds to read every shard of `src` once with `streams` threads, each preading 64 MiB pieces
    of its share of the bytes, and the bytes read."""
    pieces = []
    for f in sorted(src.glob("*.safetensors")):
        size = f.stat().st_size
        pieces += [(f, off, min(64 << 20, size - off)) for off in range(0, size, 64 << 20)]

    def read(share: list) -> int:
        buf = bytearray(max((length for _, _, length in share), default=0))
        n = 0
        for f, off, length in share:
            fd = os.open(f, os.O_RDONLY)
            try:
                n += os.preadv(fd, [memoryview(buf)[:length]], off)
            finally:
                os.close(fd)
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        total = sum(pool.map(read, [pieces[i::streams] for i in range(streams)]))
    return time.perf_counter() - t0, total


def write_floor(scratch: Path, total: int, streams: int) -> float:
    """Seconds to write `total` bytes as `streams` new files at once, each fsynced (removed after)."""
    buf = bytearray(os.urandom(1 << 20)) * 64

    def write(i: int) -> None:
        with open(f"{scratch}.{i}", "wb", buffering=0) as fh:
            left = total // streams + (total % streams if i == 0 else 0)
            while left:
                left -= fh.write(memoryview(buf)[: min(left, len(buf))])
            os.fsync(fh.fileno())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(write, range(streams)))
    seconds = time.perf_counter() - t0
    for i in range(streams):
        Path(f"{scratch}.{i}").unlink()
    return seconds


def floors(src: Path, scratch: Path) -> tuple[dict[int, float], dict[int, float], int]:
    """Read and write seconds for every number of streams in STREAMS, and the HF bytes."""
    reads, writes = {}, {}
    total = 0
    for n in STREAMS:
        reads[n], total = read_floor(src, n)
        writes[n] = write_floor(scratch, total, n)
    return reads, writes, total


def _child(step: str, src: str, dst: str, dtype: str, device: str) -> None:
    import megatron.core  # noqa: F401  imports before the baseline: they are not the conversion's memory
    import transformers  # noqa: F401

    import trinity.convert.jobs  # noqa: F401
    from trinity.convert.api import hf_to_mcore, mcore_to_hf

    import threading

    import psutil
    import torch

    if device == "cuda":
        torch.cuda.init()
    me = psutil.Process()
    base = me.memory_info().rss
    peak = base
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.005):
            peak = max(peak, me.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    if step == "hf-to-mcore":
        report = hf_to_mcore(src, dst, dtype=dtype, device=device)
    else:
        report = mcore_to_hf(src, dst, device=device)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    gpu = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    print("RESULT " + json.dumps({"seconds": seconds, "bytes": report.bytes_written, "peak_rss": peak,
                                  "base_rss": base, "peak_gpu": gpu, "phases": report.phases}))


def _run_step(step: str, src: Path, dst: Path, dtype: str, device: str) -> dict:
    cmd = [sys.executable, __file__, "--child", step, str(src), str(dst), dtype, device]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{step} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def table(gb: float, reads: dict[int, float], writes: dict[int, float], to_mcore: dict, to_hf: dict, device: str) -> str:
    """The final markdown table: each direction against its own floor (the fastest stream count)."""
    read_s, write_s = min(reads.values()), min(writes.values())
    rw = read_s + write_s
    rows = [
        "| step | seconds | GB | GB/s | floor | × floor | phases (s) | peak host RSS GB (above imports) | peak GPU GB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for what, seconds in (("read", reads), ("write + fsync", writes)):
        for n, sec in seconds.items():
            rows.append(f"| {what}, {n} stream{'s' if n > 1 else ''} | {sec:.2f} | {gb:.2f} | {gb / sec:.2f} | | | | | |")
    rows.append(f"| read + write floor (fastest of each) | {rw:.2f} | {gb:.2f} | {gb / rw:.2f} | | | | | |")
    for name, r, floor_name, floor in (("hf-to-mcore", to_mcore, "read + write", rw), ("mcore-to-hf", to_hf, "write", write_s)):
        gpu = f"{r['peak_gpu'] / 1e9:.2f}" if device == "cuda" else "-"
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r.get("phases", {}).items())
        rows.append(
            f"| {name} ({device}) | {r['seconds']:.2f} | {r['bytes'] / 1e9:.2f} | {gb / r['seconds']:.2f} | {floor_name} "
            f"| {r['seconds'] / floor:.2f} | {phases} | {r['peak_rss'] / 1e9:.2f} ({(r['peak_rss'] - r['base_rss']) / 1e9:.2f}) | {gpu} |"
        )
    rows.append(
        f"\nAgainst the single-stream floors (read {reads[1]:.2f} s, write {writes[1]:.2f} s): hf-to-mcore "
        f"{to_mcore['seconds'] / (reads[1] + writes[1]):.2f}x, mcore-to-hf {to_hf['seconds'] / writes[1]:.2f}x."
    )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where the conversions build the model (auto: cuda when available)")
    ap.add_argument("--workdir", default=None, help="where to write (default: a temp folder, removed after)")
    args = ap.parse_args()
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(args.workdir or tempfile.mkdtemp(prefix="trinity-bench-"))
    try:
        src = work / "hf"
        t0 = time.perf_counter()
        hf_bytes = make_checkpoint(src, SHAPES[args.shape])
        print(f"random {args.shape} checkpoint: {hf_bytes / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
        reads, writes, total = floors(src, work / "floor.bin")
        print(f"read floor {min(reads.values()):.2f} s, write floor {min(writes.values()):.2f} s", flush=True)
        to_mcore = _run_step("hf-to-mcore", src, work / "mcore", args.dtype, device)
        print(f"hf-to-mcore {to_mcore['seconds']:.2f} s", flush=True)
        shutil.rmtree(src)  # mcore-to-hf needs only the dist checkpoint: 2x the model on disk at most, not 3x
        to_hf = _run_step("mcore-to-hf", work / "mcore", work / "back", args.dtype, device)
        print(f"mcore-to-hf {to_hf['seconds']:.2f} s", flush=True)
        gb = hf_bytes / 1e9
        print()
        print(table(gb, reads, writes, to_mcore, to_hf, device))
        print(f"\n{args.shape} shape, {gb:.2f} GB in bf16; the conversions hold the model in {args.dtype} in host memory.")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(*sys.argv[2:7])
    else:
        main()
