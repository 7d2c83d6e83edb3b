"""The `trinity` command line: thin Typer wrappers around plain functions in trinity.cli.commands.

Nothing heavy is imported here (no torch, megatron, mbridge, transformers): `trinity --help` and
`trinity validate` must start instantly. Each command body imports what it needs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional

import click
import typer
from typer.core import TyperCommand, TyperGroup

from trinity import __version__, compat


def _flags_take_no_value(command: click.Command, ctx: click.Context) -> None:
    """typer's rich help labels every boolean flag `<bool>`, as if it took a value (`--dry-run <bool>`);
    an empty metavar drops the label."""
    for param in command.get_params(ctx):
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""


def root_help() -> str:
    """The top-level help, with the algorithms as the config defines them (read when help is shown: the
    config schema is not imported for anything else here)."""
    import typing

    from trinity.algorithms.registry import ALGORITHMS
    from trinity.config.schema import PolicyLossConfig

    names = ", ".join(ALGORITHMS)
    losses = [m for m in typing.get_args(PolicyLossConfig.model_fields["loss_mode"].annotation) if m != "vanilla"]
    return (f"Fine-tune LLMs on megatron-core from one YAML file.\n\nAlgorithms (algorithm.name): {names}; "
            f"policy losses of any RL algorithm (actor_rollout_ref.actor.policy_loss.loss_mode): {', '.join(losses)}.")


class _Command(TyperCommand):
    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _flags_take_no_value(self, ctx)
        super().format_help(ctx, formatter)


class _Group(TyperGroup):
    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        _flags_take_no_value(self, ctx)
        if ctx.parent is None:
            self.help = root_help()
        super().format_help(ctx, formatter)


app = typer.Typer(
    name="trinity",
    cls=_Group,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
convert_app = typer.Typer(cls=_Group, help="Move checkpoints between Hugging Face and megatron-core.", no_args_is_help=True)
app.add_typer(convert_app, name="convert")

ConfigOpt = typer.Option(..., "--config", "-c", help="Job YAML file.", show_default=False)
OverridesArg = typer.Argument(None, help="dotted.key=value overrides, e.g. trainer.total_steps=10", show_default=False)
DebugOpt = typer.Option(False, "--debug", help="Show tracebacks of internal errors, and the third-party warnings and "
                                                "progress bars hidden otherwise (trinity/compat/quiet.py).")


def _guard(fn: Callable[[], int | None], debug: bool) -> None:
    """Run a command body: user errors print one clean block (exit 2); bugs a traceback with --debug."""
    from trinity.cli.report import run_guarded

    raise typer.Exit(run_guarded(fn, debug))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"trinity-mcore {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """trinity-mcore: validate, convert and train on megatron-core."""


@app.command(cls=_Command)
def validate(
    config: Path = ConfigOpt,
    overrides: Optional[list[str]] = OverridesArg,
    json_out: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    debug: bool = DebugOpt,
) -> None:
    """Check a job config and print the resolved plan: layout per role and GPU memory per device."""
    from trinity.cli import commands

    _guard(lambda: commands.validate(config, overrides or [], json_out=json_out), debug)


# The docstring is rich markup (typer's help): `\[` is a literal bracket.
@app.command(cls=_Command)
def run(
    config: Path = ConfigOpt,
    overrides: Optional[list[str]] = OverridesArg,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and the launch command, start nothing."),
    force: bool = typer.Option(False, "--force", help="Write into a trainer.output_dir that holds files no trinity run wrote."),
    no_cache: bool = typer.Option(
        False, "--no-cache",
        help="Convert the HF model into <output_dir>/mcore_cache instead of the shared cache (~/.cache/trinity/mcore)."),
    debug: bool = DebugOpt,
) -> None:
    r"""Validate, convert weights if needed, and launch the job.

    A job of one process (cluster.nnodes 1, cluster.nproc_per_node 1, cluster.max_restarts 0, no
    cluster.rdzv_endpoint) runs as one child process, without torchrun; any other job starts its
    processes on this node with torchrun. Either way the console shows rank 0's output, prefixed
    \[default0]:, and every rank's log is kept under <output_dir>/logs."""
    from trinity.cli import commands

    _guard(lambda: commands.run(config, overrides or [], dry_run=dry_run, debug=debug, force=force,
                                no_cache=no_cache), debug)


@app.command(cls=_Command)
def schema() -> None:
    """Print the JSON Schema of the job config (for editor completion)."""
    from trinity.cli import commands

    typer.echo(commands.schema())


@app.command("tiny-assets", cls=_Command)
def tiny_assets(
    output: Path = typer.Argument(Path("quickstart_assets"), help="Folder for the tiny model, tokenizer and data."),
    family: str = typer.Option("qwen2", "--family", help="Model family of the tiny model (llama, mistral, phi3, "
                               "qwen2, qwen2_moe, qwen3, qwen3_moe, mixtral, ...)."),
    debug: bool = DebugOpt,
) -> None:
    """Create the quickstart's tiny model (Qwen2, or --family's), tokenizer and arithmetic data locally (no network)."""
    from trinity.cli import commands

    _guard(lambda: commands.tiny_assets(output, family=family, debug=debug), debug)


@app.command(cls=_Command)
def generate(
    model: Path = typer.Option(..., "--model", "-m", help="HF folder, dist checkpoint, checkpoints/step_N or a run's output_dir.", show_default=False),
    prompt: list[str] = typer.Option(..., "--prompt", "-p", help="Prompt text; repeat for a batch.", show_default=False),
    chat: bool = typer.Option(False, "--chat", help="Render each prompt as a user turn with the tokenizer's chat template."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Most tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampling generator."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    json_out: bool = typer.Option(False, "--json", help="One JSON line {prompt, answer} per prompt."),
    truncate_prompt: Optional[str] = typer.Option(
        None, "--truncate-prompt", show_default=False,
        help="left (keep the end) or right (keep the start): cut a prompt too long for the model's context "
             "with --max-new-tokens, instead of refusing it."),
    debug: bool = DebugOpt,
) -> None:
    """Answer prompts with a model (before or after training), with the rollout's generation engine."""
    from trinity.cli import generate as gen

    _guard(lambda: gen.run(model, prompt, chat=chat, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_p=top_p, seed=seed, device=device, json_out=json_out, debug=debug,
                           truncate_prompt=truncate_prompt), debug)


@app.command(cls=_Command)
def plot(
    run_dirs: list[Path] = typer.Argument(..., help="Run folders (trainer.output_dir), each with a metrics.jsonl.", show_default=False),
    out: Optional[Path] = typer.Option(
        None, "--out", "-o", show_default=False,
        help="PNG to write (default: RUN_DIR/curves.png for one run, ./curves.png for several)."),
    debug: bool = DebugOpt,
) -> None:
    """Plot runs' curves (loss, reward, val, lr, throughput) from metrics.jsonl into a PNG, runs overlaid."""
    from trinity.cli import commands

    _guard(lambda: commands.plot(run_dirs, out), debug)


@convert_app.command("hf-to-mcore", cls=_Command)
def hf_to_mcore(
    hf_path: Path = typer.Option(..., "--hf-path", help="Hugging Face model folder.", show_default=False),
    output: Path = typer.Option(..., "--output", "-o", help="Dist checkpoint folder to write.", show_default=False),
    tp: int = typer.Option(1, "--tp", min=1, help="Tensor-parallel size of the writing job."),
    pp: int = typer.Option(1, "--pp", min=1, help="Pipeline-parallel size of the writing job."),
    vpp: Optional[int] = typer.Option(None, "--vpp", min=1, help="Virtual pipeline stages per PP rank."),
    ep: int = typer.Option(1, "--ep", min=1, help="Expert-parallel size of the writing job."),
    backend: str = typer.Option("builtin", "--backend", help="builtin or mbridge."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16 or fp32."),
    verify: bool = typer.Option(False, "--verify", help="Compare logits of the HF and converted models."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output folder."),
    debug: bool = DebugOpt,
) -> None:
    """Convert a Hugging Face checkpoint to a megatron-core dist checkpoint."""
    from trinity.cli import commands

    _guard(lambda: commands.convert_hf_to_mcore(hf_path, output, tp=tp, pp=pp, vpp=vpp, ep=ep, backend=backend,
                                                dtype=dtype, verify=verify, force=force, debug=debug), debug)


@convert_app.command("mcore-to-hf", cls=_Command)
def mcore_to_hf(
    mcore_path: Path = typer.Option(..., "--mcore-path", help="Dist checkpoint folder (convert or run output).", show_default=False),
    output: Path = typer.Option(..., "--output", "-o", help="Hugging Face folder to write.", show_default=False),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bf16, fp16 or fp32 (default: the checkpoint's)."),
    verify: bool = typer.Option(False, "--verify", help="Compare every exported tensor with the source."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output folder."),
    debug: bool = DebugOpt,
) -> None:
    """Convert a megatron-core dist checkpoint to a Hugging Face folder."""
    from trinity.cli import commands

    _guard(lambda: commands.convert_mcore_to_hf(mcore_path, output, dtype=dtype, verify=verify, force=force,
                                                debug=debug), debug)


def main() -> None:
    compat.install_all()  # before any command imports megatron-core
    try:
        app()
    except SystemExit as exc:
        if "torch" not in sys.modules:  # nothing heavy loaded: the normal exit is instant
            raise
        # A command that loaded torch (and megatron-core, transformers) skips the interpreter's teardown
        # of them, ~1.3 s (trinity.launch.child.end_process).
        from trinity.launch.child import end_process

        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        end_process(exc.code if isinstance(exc.code, int) else int(exc.code is not None))


if __name__ == "__main__":
    main()
