"""The two built-in workflows on the tiny assets, as docs/workflows.md shows them:
`python -m trinity.workflows.demo [folder]` (the assets are made there, default ./tiny-assets; CPU, seconds).

The guess-number game with a scripted player (the bookkeeping without a model), then the calculator
workflow on the random tiny Qwen2 through the continuous-batching engine.
"""

from __future__ import annotations

import sys

import torch

from trinity.config.schema.workflow import Limits
from trinity.rollout.types import SamplingParams
from trinity.testing.chat_templates import QWEN2_5
from trinity.workflows.backends import RolloutBackend, ScriptedBackend
from trinity.workflows.calculator import calculator_workflow
from trinity.workflows.guess_number import guess_number_workflow
from trinity.workflows.runner import run_workflow
from trinity.workflows.types import ChatTokenizer


def guess_number_lines(tokenizer: ChatTokenizer) -> list[str]:
    (ep,) = run_workflow(guess_number_workflow, [{"secret": 37}], ScriptedBackend(tokenizer, ["50", "25", "37"]),
                         tokenizer)
    seq = ep.sequences[0]
    return [f"guess_number: {ep.end}, reward {ep.reward}, turn rewards {[round(r, 3) for r in ep.turn_rewards]}",
            f"  conversation after the task: {[m['content'] for m in ep.messages[1:]]}",
            f"  one sequence of {len(seq.tokens)} tokens, {sum(seq.loss_mask)} of them trained"]


def calculator_lines(model: torch.nn.Module, tokenizer: ChatTokenizer) -> list[str]:
    backend = RolloutBackend(model, vocab_size=len(tokenizer), pad_id=tokenizer.pad_token_id,
                             generator=torch.Generator().manual_seed(0))
    tasks = [{"prompt": "12+7=", "answer": "19"}, {"prompt": "3-8=", "answer": "-5"}]
    episodes = run_workflow(calculator_workflow, tasks, backend, tokenizer, n=2, limits=Limits(max_turns=3),
                            sampling=SamplingParams(temperature=1.0, max_new_tokens=16))
    lines = [f"calculator: {len(episodes)} episodes, their turns in {backend.calls} running batch"]
    for ep in episodes:
        trained = sum(sum(s.loss_mask) for s in ep.sequences)
        lines.append(f"  {ep.task['prompt']} {ep.end}, reward {ep.reward}, {len(ep.turns)} turns, sequences of "
                     f"{[len(s.tokens) for s in ep.sequences]} tokens ({trained} trained)")
    return lines


def main(folder: str = "tiny-assets") -> None:
    from transformers import AutoTokenizer

    from trinity.config.megatron import MegatronConfig
    from trinity.convert.builtin import load_hf_weights
    from trinity.distributed.layout import ParallelLayout
    from trinity.distributed.parallel import destroy, init_parallel
    from trinity.models.build import build_model
    from trinity.models.facts import ModelFacts
    from trinity.testing.tiny_assets import make_quickstart_assets

    path = make_quickstart_assets(folder)["model"]
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    tokenizer.chat_template = QWEN2_5  # the tiny tokenizer's own template has no tools
    print("\n".join(guess_number_lines(tokenizer)))
    facts = ModelFacts.from_hf_dir(path)
    init_parallel(device="cpu", layout=ParallelLayout(), seed=0)
    try:
        chunks = build_model(facts, MegatronConfig(), device="cpu", dtype=torch.float32)
        load_hf_weights(chunks, path, facts)
        print("\n".join(calculator_lines(chunks[0], tokenizer)))
    finally:
        destroy()


if __name__ == "__main__":
    main(*sys.argv[1:2])
