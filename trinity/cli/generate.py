"""`trinity generate`: answers from a model with the rollout engine (`trinity.rollout.continuous`), for a
quick look at a model before or after training.

`--model` takes any of:
- a Hugging Face folder (config.json + safetensors + tokenizer), e.g. a run's `<output_dir>/hf` export;
- a trinity dist checkpoint: the output of `trinity convert hf-to-mcore`, an SFT training checkpoint
  `<output_dir>/checkpoints/step_N`, or an RL one's `step_N/actor`;
- an RL checkpoint `step_N` (its `actor/` is used) or a run's output folder (its newest complete
  checkpoint; without checkpoints, its `hf/` export).
A LoRA job's checkpoint holds the adapters only: the base model its job started from (named in the
checkpoint's resolved_config.yaml) is loaded, then the adapters, merged into the weights for decoding.

The model runs in one process (TP = PP = 1) in fp32 on CPU and bf16 on CUDA, the same GPTModel and the
same decode loop as the RL rollout, so what it answers is what the rollout would sample.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TextIO

from trinity import compat
from trinity.compat.quiet import quietly
from trinity.errors import UserError

META = "trinity_meta.json"  # the file trinity.convert.dist_ckpt writes into every dist checkpoint


@dataclass(frozen=True)
class ModelSource:
    """Where the weights and the HF config/tokenizer of `--model` are."""

    kind: str  # "hf" or "dist"
    weights: Path  # the HF folder or the dist checkpoint folder
    hf_dir: Path  # config.json, tokenizer and generation_config.json


def _is_hf(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _newest_checkpoint(root: Path) -> Path | None:
    from trinity.launch.run_folder import complete_checkpoints

    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def resolve_model(path: Path) -> ModelSource:
    """The weights `--model` names (see the module doc); UserError naming the folder otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"--model: {path} does not exist or is not a folder")
    if (path / META).is_file():
        hf = path / "hf"
        if not (hf / "config.json").is_file():
            raise UserError(f"--model: {path} is a dist checkpoint without hf/config.json; it was not written by trinity")
        return ModelSource("dist", path, hf)
    if _is_hf(path):
        return ModelSource("hf", path, path)
    if (path / "actor" / META).is_file():  # an RL checkpoint step_N/
        return resolve_model(path / "actor")
    newest = _newest_checkpoint(path / "checkpoints")
    if newest is not None:
        return resolve_model(newest)
    if _is_hf(path / "hf"):
        return ModelSource("hf", path / "hf", path / "hf")
    raise UserError(
        f"--model: {path} is neither a Hugging Face folder (config.json + *.safetensors), a trinity dist "
        "checkpoint (trinity_meta.json), nor a run folder with checkpoints/step_N or hf/"
    )


def eos_ids(tokenizer: Any, hf_dir: Path) -> tuple[int, ...]:
    """The tokenizer's EOS plus generation_config.json's eos_token_id(s): where the rollout stops too."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    gen = hf_dir / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(int(v) for v in (value if isinstance(value, list) else [value]) if v is not None)
    return tuple(sorted(ids))


def _device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device: {device!r} is not one of auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device: 'cuda' but no CUDA device is visible; use --device cpu")
    return device


TRUNCATE_SIDES = ("left", "right")  # left drops the prompt's start (keeps its end), right its end


def fit_prompts(
    ids: Sequence[list[int]], *, context: int, max_new_tokens: int, truncate: str | None, source: str
) -> list[list[int]]:
    """The prompts' token ids, each leaving room for `max_new_tokens` in the model's `context`
    (max_position_embeddings, from `source`): past it the positions were never trained, so the model
    decodes noise, slowly. A longer prompt is refused, or cut from the `truncate` side."""
    room = context - max_new_tokens
    if room < 1:
        raise UserError(
            f"--max-new-tokens: {max_new_tokens} new tokens leave no room for a prompt in the model's context of "
            f"{context} tokens (max_position_embeddings in {source}); lower it below {context}"
        )
    fitted = []
    for n, p in enumerate(ids, start=1):
        if len(p) <= room:
            fitted.append(list(p))
        elif truncate is None:
            raise UserError(
                f"--prompt: prompt {n} is {len(p)} tokens, but the model's context is {context} tokens "
                f"(max_position_embeddings in {source}) and --max-new-tokens {max_new_tokens} leaves {room} for the "
                "prompt; shorten it, lower --max-new-tokens, or pass --truncate-prompt left (keep its end) or right "
                "(keep its start)"
            )
        else:
            fitted.append(list(p[-room:] if truncate == "left" else p[:room]))
    return fitted


@quietly  # a Python API too (docs/real-model.md): as quiet as `trinity generate`
def generate_answers(
    model: Path,
    prompts: Sequence[str],
    *,
    chat: bool = False,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    device: str = "auto",
    truncate_prompt: str | None = None,
) -> list[str]:
    """One answer per prompt (the decoded response without its EOS). `chat=True` renders each prompt as
    one user turn with the tokenizer's chat template (as the RL data does); otherwise the text is the
    prompt as is. temperature 0 is greedy. A prompt that does not fit the model's context with
    `max_new_tokens` is refused, or cut from the `truncate_prompt` side (`fit_prompts`)."""
    if not prompts:
        raise UserError("--prompt: give at least one prompt")
    if truncate_prompt is not None and truncate_prompt not in TRUNCATE_SIDES:
        raise UserError(f"--truncate-prompt: {truncate_prompt!r} is not one of {', '.join(TRUNCATE_SIDES)}")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens: must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise UserError(f"--temperature: must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p: must be in (0, 1], got {top_p}")
    source = resolve_model(Path(model))
    # Heavy imports after the cheap checks: a mistyped option fails at once.
    compat.install_all()  # a Python API too: a user's script reaches megatron-core here first
    import torch

    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.convert.dist_ckpt import load_model_checkpoint
    from trinity.data.loader import load_tokenizer, pad_token_id
    from trinity.data.sft import has_chat_template, render_prompt, tokenize_texts, with_bos
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.rollout.continuous import generate_continuous
    from trinity.rollout.types import SamplingParams

    dev = _device(device)
    tokenizer = load_tokenizer(source.hf_dir)
    if chat and not has_chat_template(tokenizer):
        raise UserError(f"--chat: the tokenizer in {source.hf_dir} has no chat template; drop --chat to send raw text")
    # raw text gets the tokenizer's own BOS, as SFT and RL render raw prompts (trinity.data.sft)
    texts = [render_prompt(tokenizer, p) if chat else with_bos(tokenizer, p) for p in prompts]
    ids = tokenize_texts(tokenizer, texts)
    if any(not p for p in ids):
        raise UserError("--prompt: a prompt encodes to no tokens; give some text")
    facts = ModelFacts.from_hf_dir(source.hf_dir)
    ids = fit_prompts(ids, context=facts.max_position_embeddings, max_new_tokens=max_new_tokens,
                      truncate=truncate_prompt, source=facts.source)
    # megatron-core computes in fp32 on CPU; bf16 is what the GPU rollout runs in.
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    megatron = MegatronConfig()
    init_parallel(device=dev, layout=megatron.layout(), seed=seed)
    try:
        chunks = build_model(facts, megatron, device=dev, dtype=dtype)
        lora = None
        if source.kind == "hf":
            load_hf_weights(chunks, source.weights, facts)
        else:
            from trinity.convert.dist_ckpt import read_meta
            from trinity.convert.load import load_lora_checkpoint, lora_of

            lora = lora_of(read_meta(source.weights))
            if lora is None:
                load_model_checkpoint(chunks, source.weights)
            else:  # a LoRA job's checkpoint: its base model + the adapters
                load_lora_checkpoint(chunks, source.weights, facts, lora)
        params = SamplingParams(
            temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
            eos_token_ids=eos_ids(tokenizer, source.hf_dir),
        )
        generator = torch.Generator().manual_seed(seed)
        from trinity.trainer.recipes.lora_ref import rollout_weights

        # LoRA: the decoder reads W + alpha/rank * B A, as the job's rollout does
        with torch.no_grad(), rollout_weights(chunks):
            ro = generate_continuous(chunks[0], ids, params, vocab_size=facts.vocab_size,
                                     pad_id=pad_token_id(tokenizer), generator=generator)
    finally:
        destroy()
    eos = set(params.eos_token_ids)
    answers = []
    for row, mask in zip(ro.responses.tolist(), ro.response_mask.tolist()):
        toks = [t for t, m in zip(row, mask) if m]
        if toks and toks[-1] in eos:
            toks = toks[:-1]
        answers.append(tokenizer.decode(toks, skip_special_tokens=False))
    return answers


def run(
    model: Path,
    prompts: Sequence[str],
    *,
    chat: bool,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    device: str,
    json_out: bool = False,
    debug: bool = False,
    out: TextIO | None = None,
    truncate_prompt: str | None = None,
) -> int:
    """The command: prints each prompt's answer (or one JSON line per prompt with --json)."""
    from trinity.compat import quiet

    quiet.install(debug)  # before megatron-core is imported: its known harmless warnings stay hidden
    stream = out or sys.stdout
    answers = generate_answers(model, prompts, chat=chat, max_new_tokens=max_new_tokens, temperature=temperature,
                               top_p=top_p, seed=seed, device=device, truncate_prompt=truncate_prompt)
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        if json_out:
            print(json.dumps({"prompt": prompt, "answer": answer}), file=stream)
        else:
            if len(prompts) > 1:
                print(f"--- prompt {i + 1}: {prompt}", file=stream)
            print(answer, file=stream)
    return 0
