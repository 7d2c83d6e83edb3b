"""Evaluation on held-out data during training (data.val_files): before the first step
(trainer.val_before_train), every trainer.val_interval steps and after the last step.

The algorithm's spec (trinity.algorithms.registry) says which evaluation it has:

- `loss` (SFT): `val/loss`, the training loss's formula (token-sum cross-entropy over the trained tokens
  of all val samples, divided by their number) over every val sample, forward only. Samples are tokenised and
  packed (or padded) as the training data is, so a val file equal to the training file gives the loss
  that a training step over the same rows computes.
- `reward` (every RL algorithm): one greedy response per val prompt (temperature 0,
  rollout.response_length), scored by the job's reward: `val/reward_mean` (pass@1 for a 0/1 reward), `val/reward_std`,
  `val/response_length/mean`. With `actor_rollout_ref.rollout.val_kwargs.do_sample` (verl's val_kwargs): `n`
  sampled responses per prompt at its temperature / top_p / top_k, the metrics over all of them; the draws come
  from trainer.seed afresh at every evaluation, so evaluations differ only by the weights. With trainer.log_samples > 0 the responses go to
  <output_dir>/samples/val_step_N.jsonl.

Each data-parallel rank takes every dp-th sample; the numbers are reduced over all ranks.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np
import torch

from trinity.distributed import collectives
from trinity.errors import UserError
from trinity.trainer.recipes import Metrics, Recipe, StepOutput
from trinity.trainer.samples import Sample

if TYPE_CHECKING:
    from trinity.trainer.recipes.rl import RLRecipe
    from trinity.trainer.recipes.sft import SFTLoss, TokenRows


class Evaluator:
    """Runs the job's evaluation; `due(step)` says whether step `step` ends with one."""

    def __init__(self, recipe: Recipe):
        self.recipe, self.cfg, self.ctx = recipe, recipe.cfg, recipe.ctx
        self.interval = self.cfg.trainer.val_interval
        # the algorithm's evaluation (AlgorithmSpec.evaluation; validate refuses val_files without one)
        self.kind = self.cfg.spec.evaluation
        prepare = {"loss": self._prepare_sft, "reward": self._prepare_rl}[self.kind]
        prepare()

    @classmethod
    def build(cls, recipe: Recipe) -> "Evaluator | None":
        """None when the job has no data.val_files."""
        return cls(recipe) if recipe.cfg.data.val_files else None

    def due(self, step: int) -> bool:
        return bool(self.interval and step % self.interval == 0) or step == self.recipe.total_steps

    def run(self, step: int) -> StepOutput:
        """The val metrics after `step` steps (0: before training), as a metrics row, on every rank, and
        this rank's val samples (the `reward` evaluation)."""
        if self.kind == "reward":
            metrics, samples = self._rl(step)
            return StepOutput({"step": step, **metrics}, samples)
        return StepOutput({"step": step, **self._sft()})

    # ---------------------------------------------------------------- SFT

    def _prepare_sft(self) -> None:
        from trinity.data.loader import load_tokenizer, pad_token_id
        from trinity.data.packing import pack, pad
        from trinity.data.readers import read_records
        from trinity.data.sft import SFTKeys, tokenize_sft

        cfg = self.cfg
        tok = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
        keys = SFTKeys(prompt_key=cfg.data.prompt_key, response_key=cfg.data.response_key,
                       messages_key=cfg.data.messages_key)
        samples, stats = tokenize_sft(read_records(cfg.data.val_files), tok, max_seq_len=cfg.data.seq_length, keys=keys)
        if not samples:
            raise UserError(f"data.val_files: no usable validation samples ({stats.summary()})")
        self.rows = (pack if cfg.data.packing else pad)(samples, cfg.data.seq_length, pad_id=pad_token_id(tok))

    def _sft(self) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        from trinity.trainer.recipes.sft import SFTLoss, TokenRows

        ctx, rows = self.ctx, self.rows
        micro = self.cfg.trainer.micro_batch_size
        mine = np.arange(rows.num_rows)[ps.get_data_parallel_rank()::ps.get_data_parallel_world_size()]
        full = len(mine) // micro * micro
        # Micro batches of one shape per schedule call (pipeline buffers have one shape): the full ones,
        # then the rest one row at a time.
        groups = [[mine[i:i + micro] for i in range(0, full, micro)], [mine[i:i + 1] for i in range(full, len(mine))]]
        loss_fn = SFTLoss(ctx.facts.vocab_size)
        local = torch.zeros(1, dtype=torch.float64, device=ctx.device)
        for group in groups:
            if not group:
                continue
            batches = [TokenRows.from_arrays({k: torch.from_numpy(a) for k, a in rows.rows(idx).items()}, ctx.device)
                       for idx in group]
            outputs = _forward_only(self.recipe.actor.model, batches, loss_fn)
            if ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0:
                local += sum(float(o["loss_sum"]) for o in outputs)
        local = collectives.all_reduce(local)
        return {"val/loss": float(local.item()) / max(int(rows.row_loss_tokens.sum()), 1)}

    # ---------------------------------------------------------------- RL

    def _prepare_rl(self) -> None:
        from megatron.core import parallel_state as ps

        from trinity.data.prompts import PromptKeys, tokenize_prompts
        from trinity.data.readers import read_records

        cfg, recipe = self.cfg, self.rl_recipe
        keys = PromptKeys(prompt_key=cfg.data.prompt_key, messages_key=cfg.data.messages_key, answer_key=cfg.data.answer_key)
        prompts, _ = tokenize_prompts(read_records(cfg.data.val_files), recipe.tokenizer,
                                      max_prompt_length=cfg.data.max_prompt_length, keys=keys)
        if not prompts:
            raise UserError(f"data.val_files: no validation prompts in {', '.join(cfg.data.val_files)}")
        dp, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        vk = cfg.actor_rollout_ref.rollout.val_kwargs
        # val_kwargs.n responses per prompt (1 unless do_sample), each prompt's copies side by side
        n = vk.n if vk.do_sample else 1
        self.prompts = [p for p in prompts[dp::dp_size] for _ in range(n)]
        self.sampling = (dataclasses.replace(recipe.sampling, temperature=vk.temperature, top_p=vk.top_p, top_k=vk.top_k)
                         if vk.do_sample else dataclasses.replace(recipe.sampling, temperature=0.0))
        # as many sequences per generate call as a training step's rollout on this rank
        self.batch = max(1, cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n // dp_size)

    @property
    def rl_recipe(self) -> RLRecipe:
        """The recipe of an algorithm that generates (its spec's evaluation is `reward`)."""
        from trinity.trainer.recipes.rl import RLRecipe

        assert isinstance(self.recipe, RLRecipe), "the reward evaluation runs an RL recipe's rollout"
        return self.recipe

    def _rl(self, step: int) -> tuple[Metrics, list[Sample]]:
        from trinity.trainer.recipes.lora_ref import rollout_weights
        from trinity.trainer.recipes.rl import _dp_stats

        recipe = self.rl_recipe
        for role, engine in recipe.engines.items():
            engine.need(params=role == "actor")
        gen = torch.Generator(device=self.ctx.device).manual_seed(self.cfg.trainer.seed)
        scores: list[float] = []
        lengths: list[int] = []
        samples: list[Sample] = []
        errors: list[str] = []  # samples scored 0 (reward.on_error: zero)
        for start in range(0, len(self.prompts), self.batch):
            part = self.prompts[start:start + self.batch]
            # LoRA: the decoders read W + alpha/rank * B A, or compute the adapters beside W (`adapters`)
            with rollout_weights(recipe.actor, keep=self.cfg.actor_rollout_ref.actor.lora.rollout_weights):
                ro = recipe.rollout_engine.generate([p.prompt_ids for p in part], self.sampling, gen)
            n = ro.response_mask.sum(-1).tolist()
            texts = [recipe.tokenizer.decode(row[: int(k)].tolist(), skip_special_tokens=True) for row, k in zip(ro.responses, n)]
            result = recipe.reward_fn.score([p.text for p in part], texts, [p.answer for p in part])
            s = result.scores
            errors += result.errors
            scores += s
            lengths += [int(k) for k in n]
            samples += [{"step": step, "prompt": p.text, "response": t, "reward": r, "answer": p.answer, "source": p.source}
                        for p, t, r in zip(part, texts, s)]
        if errors:
            from trinity.rewards.process import errors_warning

            print(errors_warning(self.cfg.reward.function, errors, len(scores), "in validation"),
                  file=sys.stderr, flush=True)
        device = self.ctx.device
        mean, std = _dp_stats(torch.tensor(scores, dtype=torch.float64, device=device))
        len_mean, _ = _dp_stats(torch.tensor(lengths, dtype=torch.float64, device=device))
        return {"val/reward_mean": mean, "val/reward_std": std, "val/response_length/mean": len_mean}, samples


@torch.no_grad()
def _forward_only(chunks: Sequence[torch.nn.Module], batches: list[TokenRows],
                  loss_fn: SFTLoss) -> list[dict[str, torch.Tensor]]:
    """`loss_fn` (unscaled) over micro batches of one shape through megatron's schedule, forward only
    (every pipeline and virtual stage); the last stage's per-micro-batch metric dicts."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, s = batches[0].tokens.shape

    def forward_step(data_iterator: Iterator[TokenRows],
                     chunk: torch.nn.Module) -> tuple[torch.Tensor, Callable[[torch.Tensor], object]]:
        micro = next(data_iterator)
        return micro.forward(chunk), lambda output: loss_fn(micro, output, denom=1.0, scale=1.0)

    iterators = [iter(batches) for _ in chunks]
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(batches), seq_length=s,
        micro_batch_size=b, forward_only=True,
    )
    return list(outputs)
