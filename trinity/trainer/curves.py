"""A PNG of runs' curves from their metrics.jsonl: `trinity plot RUN_DIR [RUN_DIR ...]`, and curves.png in
a run's folder at its end. matplotlib is optional (`pip install "trinity-mcore[plot]"`) and imported only
here, with the Agg backend (no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from trinity.errors import UserError
from trinity.trainer.summary import number, read_metrics

INSTALL = 'pip install "trinity-mcore[plot]" (or pip install -e ".[plot]" in a clone)'
CURVES = "curves.png"


def _keys(*names: str) -> Callable[[str], bool]:
    return lambda key: key in names


# One panel per kind of curve, shown when a run has one of its keys: (title, which keys).
PANELS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("loss", _keys("loss", "actor/pg_loss", "critic/vf_loss")),
    ("reward", _keys("reward/mean", "rewards/accuracies")),
    ("val", _keys("val/loss", "val/reward_mean")),
    ("learning rate", _keys("lr", "actor/lr")),
    ("throughput (tokens/s)", lambda key: key == "tokens_per_s" or key.startswith("tokens_per_s/")),
)


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the rows that have a finite value of it."""
    points = [(row["step"], v) for row in rows if (v := number(row.get(key))) is not None]
    return [s for s, _ in points], [v for _, v in points]


def panels(runs: dict[str, list[dict[str, Any]]]) -> list[tuple[str, list[str]]]:
    """(title, keys) of the panels these runs fill, keys in first-seen order."""
    seen: list[str] = []
    for rows in runs.values():
        for row in rows:
            seen += [k for k in row if k not in seen and number(row[k]) is not None]
    found = [(title, [k for k in seen if wanted(k)]) for title, wanted in PANELS]
    return [(title, keys) for title, keys in found if keys]


def run_names(run_dirs: list[Path]) -> list[str]:
    """How the plot names each run: its folder's name, or the path as given where two names are equal."""
    names = [Path(d).resolve().name for d in run_dirs]
    return [n if names.count(n) == 1 else str(d) for n, d in zip(names, run_dirs)]


def load_runs(run_dirs: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Each run's metrics rows, by its name (run_names); a UserError for a folder without any."""
    runs = {}
    for d, name in zip(run_dirs, run_names(run_dirs)):
        path = Path(d) / "metrics.jsonl"
        if not path.is_file():
            raise UserError(f"{d}: no metrics.jsonl in it; name a run's trainer.output_dir")
        rows = read_metrics(path)
        if not rows:
            raise UserError(f"{path}: no metrics yet (the run has not finished a step)")
        runs[name] = rows
    return runs


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or a UserError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise UserError(f"trinity plot needs matplotlib, which is not installed: {INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_runs(runs: dict[str, list[dict[str, Any]]], out: Path) -> Path:
    """Write the runs' curves, overlaid (a colour per run, a line style per key), to `out` (PNG)."""
    plt = pyplot()
    found = panels(runs)
    if not found:
        raise UserError(f"{', '.join(runs)}: metrics.jsonl has none of the plotted metrics (loss, reward, val, lr, tokens_per_s)")
    cols = 2 if len(found) > 1 else 1
    rows_n = (len(found) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.5 * cols, 3 * rows_n), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    for ax, (title, keys) in zip(axes.flat, found):
        for i, (name, rows) in enumerate(runs.items()):
            for j, key in enumerate(keys):
                steps, values = series(rows, key)
                if steps:
                    label = " ".join(filter(None, [name if len(runs) > 1 else "", key if len(keys) > 1 else ""]))
                    ax.plot(steps, values, styles[j % len(styles)], color=colours[i % len(colours)],
                            marker="." if len(steps) < 20 else None, label=label or None, linewidth=1.2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(found):]:
        ax.set_visible(False)
    if len(runs) == 1:
        fig.suptitle(next(iter(runs)), fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def default_out(run_dirs: list[Path]) -> Path:
    """One run: its folder's curves.png (where the run itself writes it); several: curves.png here."""
    return Path(run_dirs[0]) / CURVES if len(run_dirs) == 1 else Path(CURVES)


def run_curves(out_dir: Path) -> Path | None:
    """curves.png of a run that just ended, or None when matplotlib is not installed (the summary then
    lists no curves)."""
    try:
        return plot_runs(load_runs([out_dir]), out_dir / CURVES)
    except UserError:
        return None
