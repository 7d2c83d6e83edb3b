"""Vocab-parallel log-probs/entropy at TP=2 (gloo, two processes) equal the full-vocabulary results."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB, SHAPE = 50, (3, 5)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(*SHAPE, VOCAB, generator=gen) * 3
    # some targets in each half, including the boundary ids 24/25
    targets = torch.randint(0, VOCAB, SHAPE, generator=gen)
    targets[0, 0], targets[0, 1], targets[0, 2] = 24, 25, 49
    return logits, targets, torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)


def _worker(rank: int, world: int, port: int) -> None:
    from trinity.algorithms.logprob import vocab_parallel_entropy, vocab_parallel_log_probs_and_entropy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        logits, targets, up_logp, up_ent = _inputs()
        width = VOCAB // world
        shard = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
        group = dist.new_group(list(range(world)))
        logp, entropy = vocab_parallel_log_probs_and_entropy(shard, targets, group=group, chunk_size=4)
        (logp * up_logp + entropy * up_ent).sum().backward()

        full = logits.clone().requires_grad_(True)
        ref_all = torch.log_softmax(full, -1)
        ref_logp = ref_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ref_ent = -(ref_all.exp() * ref_all).sum(-1)
        (ref_logp * up_logp + ref_ent * up_ent).sum().backward()

        torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy, ref_ent, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(shard.grad, full.grad[..., rank * width : (rank + 1) * width], atol=1e-5, rtol=1e-5)
        # entropy alone, explicit vocab_start agrees with the default partition
        torch.testing.assert_close(vocab_parallel_entropy(shard.detach(), group=group), ref_ent.detach(), atol=1e-5, rtol=1e-5)
        explicit, _ = vocab_parallel_log_probs_and_entropy(shard.detach(), targets, group=group, vocab_start=rank * width)
        torch.testing.assert_close(explicit, ref_logp.detach(), atol=1e-5, rtol=1e-5)
        _agrees_with_megatron(logits, targets, up_logp, rank, width)
        for real_vocab in (40, 20):  # rank 1's shard partly / wholly vocabulary padding
            _padded_vocab(logits, targets, up_logp, up_ent, rank, width, group, real_vocab)
    finally:
        dist.destroy_process_group()


def _padded_vocab(logits, targets, up_logp, up_ent, rank, width, group, real_vocab) -> None:
    from trinity.algorithms.logprob import vocab_parallel_log_probs_and_entropy

    targets = targets % real_vocab
    shard = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_log_probs_and_entropy(shard, targets, group=group, vocab_size=real_vocab)
    (logp * up_logp + entropy * up_ent).sum().backward()
    real = logits[..., :real_vocab].clone().requires_grad_(True)
    ref_all = torch.log_softmax(real, -1)
    ref_logp = ref_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(ref_all.exp() * ref_all).sum(-1)
    (ref_logp * up_logp + ref_ent * up_ent).sum().backward()
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_ent, atol=1e-5, rtol=1e-5)
    expected_grad = torch.zeros_like(shard)
    lo, hi = rank * width, min((rank + 1) * width, real_vocab)
    if hi > lo:
        expected_grad[..., : hi - lo] = real.grad[..., lo:hi]
    torch.testing.assert_close(shard.grad, expected_grad, atol=1e-5, rtol=1e-5)


def _agrees_with_megatron(logits: torch.Tensor, targets: torch.Tensor, up: torch.Tensor, rank: int, width: int) -> None:
    """Same values and logits gradient as megatron-core's own vocab-parallel cross entropy, on its TP
    group and vocabulary partition (what the trainer passes)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    from trinity.algorithms.logprob import vocab_parallel_log_probs

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        ours_in = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_(True)
        ours = vocab_parallel_log_probs(ours_in, targets, group=group)
        (ours * up).sum().backward()
        theirs_in = ours_in.detach().clone().requires_grad_(True)
        theirs = -vocab_parallel_cross_entropy(theirs_in, targets)
        (theirs * up).sum().backward()
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours_in.grad, theirs_in.grad, atol=1e-5, rtol=1e-5)
    finally:
        parallel_state.destroy_model_parallel()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_tp2_matches_full_vocab():
    mp.spawn(_worker, args=(2, _free_port()), nprocs=2, join=True)
