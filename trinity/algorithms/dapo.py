"""DAPO's reward shaping and dynamic-sampling filter (Yu et al. 2025; verl's DAPO recipe).

- `overlong_penalty`: the soft overlong punishment of verl's `dapo` reward manager
  (`reward_model.overlong_buffer`): 0 up to `max_len - buffer_len` tokens, then falling linearly to
  `-penalty_factor` at `max_len`.
- `varied_groups`: which prompt groups dynamic sampling keeps (`algorithm.filter_groups`): those whose
  metric is not the same for every response (a group of equal rewards has zero group-relative advantage
  and only dilutes the batch).
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float) -> torch.Tensor:
    """min(-(length - (max_len - buffer_len)) / buffer_len * penalty_factor, 0) per response (fp32),
    verl's formula: a response of max_len tokens gets -penalty_factor."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"buffer_len must be in [1, max_len={max_len}], got {buffer_len}")
    exceed = lengths.float() - (max_len - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def varied_groups(values: torch.Tensor, n: int) -> torch.Tensor:
    """[num_groups] bool: True for groups (n consecutive entries of `values`) whose values are not all
    equal. verl compares with the standard deviation (std > 0, or a group of one); so does this."""
    if values.numel() % n:
        raise ValueError(f"{values.numel()} values do not split into groups of {n}")
    groups = values.double().reshape(-1, n)
    if n == 1:
        return torch.ones(groups.shape[0], dtype=torch.bool, device=values.device)
    return groups.std(dim=1) > 0
