"""Checks of the reference generator (`trinity.rollout.reference`) shared by the CPU and GPU tests."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from trinity.rollout.reference import reference_generate
from trinity.rollout.types import Rollout, SamplingParams


def check_stops_at_eos(gpt: Any, prompts: Sequence[Sequence[int]], vocab_size: int, **kwargs: Any) -> int:
    """Greedy rows with EOS ids taken from a run without EOS: every row must end at its first EOS,
    the response width must be the longest row (on CUDA the stop is read one step late, and that
    step must not show), and the kept tokens must be the run's prefix. Returns the width."""
    free = reference_generate(gpt, prompts, SamplingParams(temperature=0.0, max_new_tokens=8), vocab_size=vocab_size, pad_id=0, **kwargs)
    responses = free.responses
    eos = {int(responses[row, 1 + row % 2]) for row in range(responses.shape[0])}  # each row stops by step 2
    stopped = reference_generate(gpt, prompts, SamplingParams(temperature=0.0, max_new_tokens=8, eos_token_ids=tuple(eos)),
                       vocab_size=vocab_size, pad_id=0, **kwargs)
    is_eos = torch.isin(responses, torch.tensor(sorted(eos), device=responses.device))
    lengths = is_eos.long().argmax(dim=1) + 1  # first EOS, inclusive
    width = int(lengths.max())
    assert stopped.response_len == width < 8, (stopped.response_len, width)
    assert torch.equal(stopped.response_mask.sum(1), lengths)
    keep = stopped.response_mask.bool()
    assert torch.equal(stopped.responses[keep], responses[:, :width][keep])
    assert bool((stopped.responses[~keep] == 0).all())  # padding after EOS
    torch.testing.assert_close(stopped.logprobs[keep], free.logprobs[:, :width][keep])
    return width


def check_greedy_equals_hf(rollout: Rollout, hf: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                           decode: Any) -> list[str]:
    """Each greedy row of `rollout` equals HF `generate` (do_sample off) on its prompt; returns the decoded
    answers (`decode`: the tokenizer's). The failure names the prompt and both answers."""
    answers = []
    for i, p in enumerate(prompts):
        ours = rollout.responses[i, : int(rollout.response_mask[i].sum())].tolist()
        with torch.no_grad():
            want = hf.generate(torch.tensor([list(p)]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(p):].tolist()
        assert ours == want, (decode(p), decode(ours), decode(want))
        answers.append(decode(ours))
    return answers


__all__ = ["check_greedy_equals_hf", "check_stops_at_eos"]
