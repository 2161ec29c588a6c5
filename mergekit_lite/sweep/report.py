"""A finished sweep, written into its run folder: results.json (everything, for tools), report.md (the
tables, the pick, the forgetting maps and what the pick did to the docs post forgot, for people), report.html
(the same on one self-contained page, with every sample to browse), sweep.png (the curves with their bootstrap
intervals), forgetting_map.png (F_true and BT_true per task and model) and samples.jsonl (each doc's outcome for
pre, post and the pick: sweep.samples).

The three reports are renderings of one report model (sweep.report_model), so they cannot disagree.
"""

from __future__ import annotations

from pathlib import Path

from mergekit_lite.io.model_card import selection_section
from mergekit_lite.io.outputs import write_atomic
from mergekit_lite.merge import methods
from mergekit_lite.sweep.grid import plot_heatmap
from mergekit_lite.sweep.report_model import (  # noqa: F401 (the names callers import from here)
    DEFINITIONS,
    HTML_FILE,
    LAYERS_PLOT_FILE,
    MAP_FILE,
    PLOT_FILE,
    REPORT_FILE,
    RESULTS_FILE,
    SweepReport,
    build_report,
    layer_labels,
    limit_text,
    model_text,
    pick_coefficients,
    results_json,
)
from mergekit_lite.sweep.result import SweepResult
from mergekit_lite.sweep.samples import write_samples


def report_markdown(result: SweepResult, results: dict | None = None) -> str:
    """report.md of a finished sweep (its report model rendered as Markdown)."""
    return build_report(result).markdown()


def card_section(result: SweepResult) -> tuple[str, str]:
    """The model card section of `--save-best`: the pick, and every model's report-split scores with intervals."""
    shown = ("old", "new", "harmonic_mean")
    scores = [
        {
            "label": point.label,
            **{name: getattr(point, name) for name in shown},
            "intervals": {name: point.intervals[name] for name in shown if name in point.intervals},
        }
        for point in (result.pre, result.post, *result.points)
    ]
    separation = result.separation.text() if result.separation else None
    tied = None if result.settings.second else result.indistinguishable
    return selection_section(result.best.alpha, scores, tied, separation)


def _new_figure(size):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=size)
    FigureCanvasAgg(figure)
    return figure


def plot(result: SweepResult, path: Path) -> None:
    """alpha vs old, new and harmonic mean on the report split with their bootstrap intervals (bands), the
    selection-split harmonic mean dotted, pre (--) and post (-.) levels, the pick marked."""
    figure = _new_figure((7.5, 4.8))
    axes = figure.add_subplot()
    alphas = [point.alpha for point in result.points]
    for name, color, marker in (
        ("old", "tab:blue", "o-"),
        ("new", "tab:orange", "o-"),
        ("harmonic_mean", "tab:green", "s-"),
    ):
        values = [getattr(point, name) for point in result.points]
        axes.plot(alphas, values, marker, color=color, label=name.replace("_", " ") + " (report)")
        if all(name in point.intervals for point in result.points):
            axes.fill_between(
                alphas,
                [point.intervals[name][0] for point in result.points],
                [point.intervals[name][1] for point in result.points],
                color=color,
                alpha=0.15,
            )
        if name != "harmonic_mean":
            axes.axhline(getattr(result.pre, name), color=color, linestyle="--", linewidth=1, label=f"pre {name}")
            axes.axhline(getattr(result.post, name), color=color, linestyle="-.", linewidth=1, label=f"post {name}")
    axes.plot(
        alphas,
        [point.selection.harmonic_mean for point in result.points],
        ":",
        color="tab:green",
        label="harmonic mean (selection)",
    )
    best = result.best
    axes.plot(
        [best.alpha], [best.harmonic_mean], "*", color="black", markersize=16, label=f"pick (alpha={best.alpha!r})"
    )
    axes.set_xlabel(f"alpha ({result.settings.coefficient} of {result.settings.method})")
    axes.set_ylabel("score")
    axes.set_ylim(-0.02, 1.02)
    axes.legend(fontsize=7, loc="best")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_layers(result: SweepResult, coefficients: list[float], path: Path) -> None:
    """RECALL methods: post's coefficient per layer at the pick, against linear's one number at the same alpha."""
    method, alpha = result.settings.method, result.best.alpha
    interpolates = methods.method(method).interpolates
    labels = layer_labels(coefficients)
    figure = _new_figure((7, 3.5))
    axes = figure.add_subplot()
    axes.plot(range(len(coefficients)), coefficients, "o-", color="tab:purple", label=f"{method} at alpha={alpha!r}")
    if interpolates:
        axes.axhline(alpha, color="gray", linestyle="--", linewidth=1, label="linear at the same alpha")
    axes.set_xticks(range(len(coefficients)), labels)
    axes.set_xlabel("layer (the head follows the last layer)")
    axes.set_ylabel("weight of post (0 = pre)")
    axes.set_ylim(-0.02, 1.02)
    axes.legend(fontsize=8, loc="best")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_forgetting_map(result: SweepResult, path: Path) -> None:
    """Heatmaps of F_true and BT_true (report split), tasks by model (post and every alpha), each cell labelled."""
    models = [("post", result.post)] + [
        (f"{point.alpha:g}" + (f"/{point.second[1]:g}" if point.second else ""), point) for point in result.points
    ]
    tasks = [row.task for row in result.post.forgetting]
    group_of = {run.task: run.group for run in result.post.tasks}
    figure = _new_figure((2.2 + 0.75 * len(models) * 2, 1.4 + 0.45 * len(tasks)))
    for position, metric in enumerate(("F_true", "BT_true")):
        axes = figure.add_subplot(1, 2, position + 1)
        values = [
            [getattr({row.task: row for row in model.forgetting}[task], metric) for _, model in models]
            for task in tasks
        ]
        image = axes.imshow(values, vmin=0, vmax=1, cmap="Reds" if metric == "F_true" else "Greens", aspect="auto")
        for row, line in enumerate(values):
            for column, value in enumerate(line):
                axes.text(
                    column,
                    row,
                    f"{value:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if value > 0.6 else "black",
                )
        axes.set_xticks(range(len(models)), [name for name, _ in models], fontsize=7, rotation=45)
        axes.set_yticks(range(len(tasks)), [f"{task} ({group_of[task]})" for task in tasks], fontsize=7)
        axes.set_xlabel("model (alpha)")
        axes.set_title(f"{metric} vs pre (report split)", fontsize=9)
        figure.colorbar(image, ax=axes, shrink=0.8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def write_report(result: SweepResult) -> SweepReport:
    """The plots, then samples.jsonl, results.json, report.md and report.html in the run folder, each replaced
    atomically, all rendered from one report model: a report that is written links no plot that failed to be."""
    folder = Path(result.out)
    curves = plot if result.settings.second is None else lambda result, path: plot_heatmap(result, path, _new_figure)
    for draw, name in ((curves, PLOT_FILE), (plot_forgetting_map, MAP_FILE)):
        write_atomic(folder / name, lambda temp, draw=draw: draw(result, temp))
    report = build_report(result, folder)
    coefficients = pick_coefficients(result, folder)
    if coefficients is not None:
        write_atomic(folder / LAYERS_PLOT_FILE, lambda temp: plot_layers(result, coefficients, temp))
    write_samples(result, report.rows)
    write_atomic(folder / RESULTS_FILE, report.json())
    write_atomic(folder / REPORT_FILE, report.markdown())
    write_atomic(folder / HTML_FILE, report.html(folder))
    return report
