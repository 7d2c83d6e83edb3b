"""The one training loop: any recipe, with resume, the step profiler, checkpoints every save_interval,
one metrics logger, and at the end the HF export, curves.png and the run's summary."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trinity.trainer.checkpoint import CheckpointManager
from trinity.trainer.context import WorkerContext
from trinity.trainer.evaluation import Evaluator
from trinity.trainer.metrics import MetricsLogger
from trinity.trainer.recipes import Recipe
from trinity.trainer.samples import SampleLog
from trinity.trainer.trackers import build_trackers

if TYPE_CHECKING:
    import torch


def run(ctx: WorkerContext, recipe_cls: type[Recipe]) -> None:
    from trinity.trainer.profiling import StepProfiler
    from trinity.trainer.resume import check_resume_config

    cfg = ctx.config
    recipe = recipe_cls(ctx)
    recipe.build()
    ctx.log(recipe.describe())
    ckpt = CheckpointManager(
        ctx.output_dir / "checkpoints", keep_last=cfg.trainer.keep_last, is_rank0=ctx.is_rank0,
        engines=recipe.engines, data=recipe.data, hf_dir=cfg.model.path, flat=recipe.flat_checkpoint,
        config=cfg.model_dump(mode="json"),
    )
    start = 0
    resume_from = ckpt.resume_path(cfg.trainer.resume)
    if resume_from is not None:
        for line in check_resume_config(resume_from, cfg):
            ctx.log(line)
        start = ckpt.load(resume_from)
        ctx.log(f"resumed from {resume_from} at step {start}")
    guard = ctx.nonfinite
    guard.saved_at(start)
    trackers = cfg.trainer.trackers()
    metrics = MetricsLogger(
        ctx.output_dir, enabled=ctx.is_rank0, total_steps=recipe.total_steps, start_step=start,
        log_interval=cfg.trainer.log_interval, tensorboard="tensorboard" in trackers, line=recipe.line,
        trackers=build_trackers(trackers, ctx.output_dir, cfg.model_dump(mode="json"), ctx.is_rank0),
    )
    evaluator = Evaluator.build(recipe)
    samples = SampleLog(ctx.output_dir, cfg.trainer.samples_per_step(cfg.is_rl), ctx.is_rank0)

    def evaluate(step: int) -> None:
        assert evaluator is not None
        result = evaluator.run(step)
        metrics.log_val(result.metrics)
        samples.write(step, result.samples, metrics, name="val_step")

    save_every = cfg.trainer.save_interval
    profiler = StepProfiler.from_config(cfg, ctx.output_dir, ctx.rank, ctx.device)
    try:
        if evaluator is not None and cfg.trainer.val_before_train:
            evaluate(start)
        for step in range(start + 1, recipe.total_steps + 1):
            guard.start(step)
            with profiler.step(step, recipe.profile_lines) as profiled:
                recipe.profiling(profiled)
                out = recipe.step(step)
                row = {**out.metrics, **guard.metrics()}
            profiler.log(metrics, row)
            samples.write(step, out.samples, metrics, show=metrics.line_due(step, cfg.trainer.samples_interval()))
            if evaluator is not None and evaluator.due(step):
                evaluate(step)
            if (save_every and step % save_every == 0) or (step == recipe.total_steps and cfg.trainer.save_last):
                recipe.all_resident()
                guard.check_weights(recipe.engines, "save", ctx.device)
                metrics.print(f"saved checkpoint {ckpt.save(step)}")
                guard.saved_at(step)
        trackers = metrics.where()
    finally:
        metrics.close()
    exports = []
    if cfg.trainer.export_hf:
        from trinity.trainer.export import export_hf

        recipe.all_resident()
        guard.check_weights(recipe.engines, "export", ctx.device)
        exports = export_folders(ctx, export_hf(ctx, recipe.actor.modules), recipe.actor.modules)
        ctx.log(f"exported HF model to {exports[0]}")
    if ctx.is_rank0:
        from trinity.trainer.finished import write_done
        from trinity.launch.run_folder import complete_checkpoints

        last = dict(complete_checkpoints(ckpt.root)).get(recipe.total_steps)
        write_done(ctx.output_dir, config=cfg.model_dump(mode="json"), step=recipe.total_steps,
                   checkpoint=last, exports=exports)
        close_run(ctx, trackers)


def export_folders(ctx: WorkerContext, hf: Path, chunks: list[torch.nn.Module]) -> list[Path]:
    """The folders the export wrote: the HF model, and a LoRA job's adapters."""
    from trinity.models.lora import has_lora
    from trinity.trainer.export import ADAPTER_DIR

    return [hf, ctx.output_dir / ADAPTER_DIR] if has_lora(chunks) else [hf]


def close_run(ctx: WorkerContext, trackers: list[tuple[str, str]]) -> None:
    """Rank 0, once everything is written: curves.png (trainer.curves) and the summary
    of where the run's files are and how its main metrics moved."""
    from trinity.trainer.curves import run_curves
    from trinity.trainer.summary import read_metrics, summary_lines

    out = ctx.output_dir
    if ctx.config.trainer.curves is not False:
        run_curves(out)
    rows = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else []
    ctx.log("\n".join(summary_lines(out, rows, trackers)))

