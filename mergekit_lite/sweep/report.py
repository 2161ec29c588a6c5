"""A finished sweep, written into its run folder: results.json (everything, for tools), report.md (the
tables, the pick, the forgetting maps and what the pick did to the docs post forgot, for people), sweep.png
(the curves with their bootstrap intervals), forgetting_map.png (F_true and BT_true per task and model) and
samples.jsonl (each report doc's outcome for pre, post and the pick: sweep.samples).

report.md is rendered from the same dict that results.json stores, so the two cannot disagree.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from mergekit_lite.evaluate.forgetting import format_table
from mergekit_lite.io.hub import hub_id_of
from mergekit_lite.io.model_card import selection_section
from mergekit_lite.io.outputs import write_atomic
from mergekit_lite.merge import methods
from mergekit_lite.sweep.budget import budget_lines
from mergekit_lite.sweep.grid import cell_key, cell_text, grid_json, grid_lines, plot_heatmap
from mergekit_lite.sweep.realign import realign_lines
from mergekit_lite.sweep.result import SweepResult, pick_fields
from mergekit_lite.sweep.samples import realign_json_of, samples_json, samples_lines, write_samples
from mergekit_lite.sweep.scoring import PointResult, task_accuracy
from mergekit_lite.sweep.store import RECALL_DIR, SIMILARITY_FILE
from mergekit_lite.sweep.vector import vector_lines

RESULTS_FILE, REPORT_FILE, PLOT_FILE, MAP_FILE = "results.json", "report.md", "sweep.png", "forgetting_map.png"
LAYERS_PLOT_FILE = "layers.png"
DEFINITIONS = {
    "old": "score over the old tasks (what pre could do): per task the mean of its 0/1 metric, then the "
    "unweighted mean over tasks (aggregation paper) or the share of all samples (pooled)",
    "new": "the same over the new tasks (what post-training taught)",
    "harmonic_mean": "2*old*new/(old+new), 0 when both are 0; the pick maximises it on the selection split",
    "selection / report split": "each task's docs are split by a seeded hash of their doc_hash: alpha is picked "
    "on the selection docs and every number in the table is measured on the "
    "disjoint report docs",
    "interval": "paired bootstrap over the report docs (same resample for every model, per task), percentile "
    "interval at the stated confidence",
    "HM - pick": "interval of this model's harmonic mean minus the pick's; an alpha whose interval holds 0 "
    "cannot be told apart from the pick",
    "F_true(old)": "chance-corrected forgetting against pre over the old tasks (paper §2), grouped like old",
    "BT_true(new)": "chance-corrected backward transfer against pre over the new tasks (paper §2), grouped like new",
    "recovered": "(old_best - old_post) / (old_pre - old_post) on the report split: share of post's old-task loss "
    "the pick wins back; null when post lost nothing or the pick is pre or post itself",
    "kept": "(new_best - new_pre) / (new_post - new_pre) on the report split: share of post's new-task gain the "
    "pick keeps; null when post gained nothing or the pick is pre or post itself",
    "better": "alphas whose HM - pick interval lies above 0: they beat the pick on the report split",
    "ties": "alphas whose selection harmonic mean is within 1e-9 of the best; the smallest is picked",
    "pareto": "alphas that no other alpha beats on both old and new (selection split)",
}


def point_json(point: PointResult, splits: dict[str, tuple[list[str], list[str]]]) -> dict:
    return {
        "label": point.label,
        "alpha": point.alpha,
        **({point.second[0]: point.second[1]} if point.second else {}),  # a 2-D grid's second coefficient
        "old": point.old,
        "new": point.new,
        "harmonic_mean": point.harmonic_mean,
        "selection": {
            "old": point.selection.old,
            "new": point.selection.new,
            "harmonic_mean": point.selection.harmonic_mean,
        },
        "intervals": point.intervals,
        "nonfinite_logits": point.nonfinite,  # its scores are noise; never the pick
        "tasks": {
            run.task: {
                "group": run.group,
                "acc_report": task_accuracy(run.outcomes, splits[run.task][1]),
                "acc_selection": task_accuracy(run.outcomes, splits[run.task][0]),
                "metric": run.outcomes.metric,
                "filter": run.outcomes.filter,
                "k": None if math.isinf(run.outcomes.n_choices) else run.outcomes.n_choices,
            }
            for run in point.tasks
            if run.outcomes is not None
        },
        "forgetting": {
            "tasks": [row.to_dict() for row in point.forgetting],
            "groups": {group: row.to_dict() for group, row in point.groups.items()},
        },
    }


def results_json(result: SweepResult) -> dict:
    best, settings = result.best, result.settings
    return {
        "settings": settings.to_dict(),
        "coefficient": settings.coefficient,
        "alpha_means": methods.method(settings.method).alpha_meaning,
        "definitions": DEFINITIONS,
        "selection": {
            "method": settings.selection,
            "fraction": settings.selection_fraction,
            "seed": settings.seed,
            "docs": {task: {"selection": len(keys[0]), "report": len(keys[1])} for task, keys in result.splits.items()},
            "bootstrap": settings.bootstrap,
            "confidence": settings.confidence,
        },
        "skipped": result.skipped,
        "pre": point_json(result.pre, result.splits),
        "post": point_json(result.post, result.splits),
        "points": [point_json(point, result.splits) for point in result.points],
        "pick": {
            "alpha": best.alpha,
            **({best.second[0]: best.second[1]} if best.second else {}),
            "old": best.old,
            "new": best.new,
            "harmonic_mean": best.harmonic_mean,
            "selection_harmonic_mean": best.selection.harmonic_mean,
            "ties": result.ties,
            "indistinguishable": result.indistinguishable,
        },
        "pareto": result.pareto,
        **pick_fields(result),
        "lm_eval": settings.lm_eval.describe(),
        "search": {
            "method": settings.search,
            "evaluated": (
                [settings.alphas[index] for index in result.search.evaluated]
                if result.search
                else [point.key for point in result.points]
            ),
            "grid": settings.alphas,
            "stopped": result.search.reason if result.search else None,
        },
        "probe": probe_json(result),
        "samples": samples_json(result),
        **({"realign": realign_json_of(result)} if result.realigned is not None else {}),
        **({"drift": drift_json(result.drift)} if result.drift is not None else {}),
        **{name: value for name, value in (("grid", grid_json(result)), ("budget", result.budget)) if value},
        **({"vector": result.vector} if result.vector else {}),
    }


def probe_json(result: SweepResult) -> dict | None:
    """Probe mode's estimates (selection split) and sample counts; None when every point was scored in full."""
    probe = result.probe
    if probe is None:
        return None
    return {
        "rate": probe.rate,
        "pick": probe.pick,
        "indistinguishable": probe.indistinguishable,
        "samples_per_probe": probe.samples_probed,
        "samples_per_full_point": probe.samples_all,
        "sample_evaluations": len(probe.estimates) * probe.samples_probed + probe.samples_all,
        "grid_sample_evaluations": len(result.settings.alphas) * probe.samples_all,
        "estimates": [{"alpha": alpha, **asdict(estimate)} for alpha, estimate in probe.estimates.items()],
    }


def probe_lines(results: dict) -> list[str]:
    """The probe table: each probed alpha's estimated selection-split scores with +- one standard error."""
    probe = results["probe"]
    if probe is None:
        return []
    lines = [
        f"## Probe estimates (selection split, {probe['rate']:.0%} of the samples pre and post agree on, "
        "plus every one they disagree on)",
        "",
        f"{len(probe['estimates'])} alphas scored on {probe['samples_per_probe']} docs each, then the pick on all "
        f"{probe['samples_per_full_point']}: {probe['sample_evaluations']} doc evaluations against "
        f"{probe['grid_sample_evaluations']} for the full grid. Indistinguishable from the pick by the estimates: "
        f"{', '.join(map(repr, probe['indistinguishable'])) or 'none'}.",
        "",
        "| alpha | old (est.) | new (est.) | harmonic mean (est.) | note |",
        "|---|---:|---:|---:|---|",
    ]
    for row in probe["estimates"]:
        note = "pick" if row["alpha"] == probe["pick"] else ""
        lines.append(
            f"| {row['alpha']!r} | {row['old']:.4f} ± {row['old_se']:.4f} | {row['new']:.4f} ± "
            f"{row['new_se']:.4f} | {row['harmonic_mean']:.4f} ± {row['harmonic_mean_se']:.4f} | {note} |"
        )
    return [*lines, ""]


def _with_interval(value: float, interval) -> str:
    return f"{value:.4f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")


def _row(data: dict, name: str, notes: list[str]) -> str:
    groups, intervals = data["forgetting"]["groups"], data["intervals"]
    difference = intervals.get("diff_to_pick")
    cells = [
        name,
        f"{data['selection']['harmonic_mean']:.4f}",
        *[_with_interval(data[key], intervals.get(key)) for key in ("old", "new", "harmonic_mean")],
        f"[{difference[0]:+.3f}, {difference[1]:+.3f}]" if difference else "-",
        f"{groups['old']['F_true']:.4f}",
        f"{groups['new']['BT_true']:.4f}",
    ]
    return "| " + " | ".join(cells + [", ".join(notes)]) + " |"


def score_table(results: dict) -> str:
    """One row per model: selection HM, then report-split old/new/HM with intervals, HM - pick, forgetting."""
    pick, pareto = results["pick"], set(results["pareto"])
    lines = [
        "| alpha | HM (selection) | old (report) | new (report) | harmonic mean (report) | HM - pick | "
        "F_true(old) | BT_true(new) | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        _row(results["pre"], "pre", ["reference"]),
    ]
    for point in results["points"]:
        alpha = cell_key(point)
        notes = ["pick"] if alpha == cell_key(pick) else []
        notes += ["tie"] if alpha in pick["ties"] and alpha != cell_key(pick) else []
        notes += ["indistinguishable"] if alpha in pick["indistinguishable"] else []
        notes += ["**beats the pick**"] if point["label"] in results["better"] else []
        notes += ["pareto"] if alpha in pareto else []
        notes += ["**non-finite logits: scores meaningless, never picked**"] if point.get("nonfinite_logits") else []
        lines.append(_row(point, cell_text(point), notes))
    lines.append(_row(results["post"], "post", ["reference"]))
    return "\n".join(lines)


def split_lines(results: dict) -> list[str]:
    """How the docs were split, in words and per task."""
    selection = results["selection"]
    if selection["method"] == "none":
        head = (
            "- **selection: none** - alpha was picked on the same docs it is reported on (optimistic: "
            "the reported scores of the pick are biased upward)"
        )
    else:
        head = (
            f"- **selection split**: doc_hash partition, seed {selection['seed']}, "
            f"{selection['fraction']:.0%} of each task's docs pick alpha; the rest (report split) give "
            "every number below"
        )
    per_task = ", ".join(f"{task} {docs['selection']}/{docs['report']}" for task, docs in selection["docs"].items())
    lines = [head, f"- docs per task (selection/report): {per_task}"]
    if selection["bootstrap"]:
        lines.append(
            f"- intervals: {selection['confidence']:.0%} paired bootstrap, "
            f"{selection['bootstrap']} resamples of the report docs"
        )
    search = results["search"]
    if results["probe"] is not None:
        lines.append(
            f"- probe mode: alphas scored on probe samples of the selection docs (table below); only the "
            f"pick, alpha = {results['probe']['pick']!r}, was scored on every doc and is in the table"
        )
    if search["method"] == "golden":
        lines.append(
            f"- search: golden section over the grid, {len(search['evaluated'])} of {len(search['grid'])} "
            f"alphas evaluated ({search['stopped']}); the others are not in the table"
        )
    if results["skipped"]:
        lines.append("- skipped tasks: " + "; ".join(f"{task} ({why})" for task, why in results["skipped"].items()))
    return lines


def model_text(path: str) -> str:
    """A model folder as the report names it: its path, after its hub id when it is a snapshot of the HF cache."""
    hub_id = hub_id_of(path)
    return f"{hub_id} (`{path}`)" if hub_id else f"`{path}`"


def limit_text(limit: int | float | None, splits: dict[str, tuple[list[str], list[str]]]) -> str:
    """--limit as the docs scored: a task with fewer docs than the limit is named with its count."""
    if limit is None:
        return "all"
    if limit < 1:
        return f"{limit:.0%} of each task's docs"
    counts = {task: len(set(selection) | set(report)) for task, (selection, report) in splits.items()}
    short = [f"{task} has {count}" for task, count in counts.items() if count < limit]
    return f"{limit}" + (f" (fewer docs: {', '.join(short)})" if short else "")


def forgetting_section(title: str, point: PointResult) -> str:
    groups = [point.groups[group] for group in ("old", "new")]
    return f"## {title}\n\n{format_table(point.forgetting)}\n\n{format_table(groups)}\n"


def nonfinite_lines(results: dict) -> list[str]:
    """The models that gave NaN or infinite logits, said in a sentence under the table."""
    broken = [cell_text(point) for point in results["points"] if point["nonfinite_logits"]]
    return (
        [
            f"Non-finite logits (NaN or infinite while scoring; their scores are noise, none can be the pick): "
            f"{', '.join(broken)}.",
            "",
        ]
        if broken
        else []
    )


def report_markdown(result: SweepResult, results: dict) -> str:
    settings, pick = result.settings, results["pick"]
    ties = ", ".join(map(repr, pick["ties"])) if len(pick["ties"]) > 1 else "none"
    chosen = cell_text(pick, settings.coefficient) if settings.second else f"alpha = {pick['alpha']!r}"
    same = ", ".join(map(repr, pick["indistinguishable"])) or "none"
    lines = [
        f"# Sweep: {settings.method} between pre and post",
        "",
        f"- pre: {model_text(settings.pre)}",
        f"- post: {model_text(settings.post)}",
        f"- alpha = {results['alpha_means']}",
        f"- old tasks: {', '.join(settings.old_tasks)}; new tasks: {', '.join(settings.new_tasks)}; "
        f"samples per task: {limit_text(settings.limit, result.splits)}; group scores: {settings.aggregation}",
        f"- lm-eval settings: {results['lm_eval']}",
        *split_lines(results),
        "",
        *[f"- **{name}**: {text}" for name, text in DEFINITIONS.items()],
        "",
        score_table(results),
        "",
        *nonfinite_lines(results),
        f"**Pick: {chosen}**, chosen on the selection split (harmonic mean "
        f"{pick['selection_harmonic_mean']:.4f}); on the report split: old {pick['old']:.4f}, new {pick['new']:.4f}, "
        f"harmonic mean {pick['harmonic_mean']:.4f}. Ties: {ties}.",
        "",
        f"Indistinguishable from the pick on the report split (HM - pick interval holds 0): {same}.",
        "",
        f"Pareto front (selection split): {', '.join(map(repr, results['pareto']))}.",
        "",
        *([f"**{result.warning_text()[0].upper()}{result.warning_text()[1:]}**", ""] if result.better else []),
        f"{result.outcome_text()[0].upper()}{result.outcome_text()[1:]}.",
        "",
        *probe_lines(results),
        *grid_lines(results),
        *budget_lines(results),
        *vector_lines(results),
        f"![sweep]({PLOT_FILE})",
        "",
        f"![forgetting map]({MAP_FILE})",
        "",
        forgetting_section("Forgetting map (report split): pre -> post", result.post),
        forgetting_section(f"Forgetting map (report split): pre -> merge at {chosen}", result.best),
        *samples_lines(results["samples"]),
        *(realign_lines(results["realign"]) if "realign" in results else []),
    ]
    return "\n".join(lines)


def drift_json(report) -> dict:
    """results.json's `drift`: post's relative Frobenius drift from pre, whole, per decoder layer and outside them."""
    data = report.to_json()
    return {name: data[name] for name in ("relative_drift", "layers", "outside_layers", "modules")}


def drift_lines(result: SweepResult, coefficients: list[float] | None) -> list[str]:
    """report.md: post's drift per layer (evaluate.drift), beside recall_lerp's weight of post at the pick when that
    is the method (`coefficients`: embeddings, each layer, the head following the last layer)."""
    report = result.drift

    def number(value):
        return "-" if value is None else f"{value:.4g}"

    rows = (
        [("embed", report.outside.get("embed"), 0)]
        + [(f"layer {row.layer}", row.relative_drift, row.layer + 1) for row in report.layers]
        + [("head", report.outside.get("head"), -1)]
    )
    rows = [row for row in rows if row[1] is not None or row[0] not in ("embed", "head")]
    shown = coefficients is not None and len(coefficients) == len(report.layers) + 1
    alpha = result.best.alpha
    header = [
        "weights",
        "relative drift",
        *([f"{result.settings.method} weight of post (alpha {alpha!r})"] if shown else []),
    ]
    lines = [
        "## Where post moved: relative drift per layer",
        "",
        "Post's relative drift `||post - pre|| / ||pre||` over each layer's weights (Frobenius; "
        f"`mergekit-lite drift` gives every tensor); whole model {number(report.total)}."
        + (
            " Beside it, the pick's weight of post per layer (recall_lerp sets it from its own per-layer drift "
            " measure, on --recall-texts): are the layers that moved most the ones the merge took least of?"
            if shown
            else ""
        ),
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
    ]
    for name, drift, index in rows:
        lines.append(f"| {name} | {number(drift)} |" + (f" {coefficients[index]:.3f} |" if shown else ""))
    return lines + [""]


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
    return selection_section(result.best.alpha, scores, None if result.settings.second else result.indistinguishable)


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


def pick_coefficients(result: SweepResult, folder: Path) -> list[float] | None:
    """RECALL methods: post's weight per depth row at the pick (embeddings, each layer; the head follows the last);
    None for the other methods."""
    from mergekit_lite.merge.recall import RecallWeights, post_coefficients

    similarity_file = folder / RECALL_DIR / SIMILARITY_FILE
    if not similarity_file.is_file():
        return None
    weights = RecallWeights.from_json(json.loads(similarity_file.read_text()))
    return post_coefficients(weights, methods.method(result.settings.method).interpolates, result.best.alpha)


def layer_profile(result: SweepResult, folder: Path) -> str:
    """RECALL methods only: post's coefficient per layer at the pick, plotted into layers.png, and the
    report section that shows it (empty for the other methods, whose coefficient is one number)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    coefficients = pick_coefficients(result, folder)
    if coefficients is None:
        return ""
    method, alpha = result.settings.method, result.best.alpha
    interpolates = methods.method(method).interpolates
    labels = ["embed"] + [str(layer) for layer in range(len(coefficients) - 1)]
    figure = Figure(figsize=(7, 3.5))
    FigureCanvasAgg(figure)
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
    write_atomic(folder / LAYERS_PLOT_FILE, lambda temp: figure.savefig(temp, dpi=120))
    values = ", ".join(f"{label}: {value:.3f}" for label, value in zip(labels, coefficients))
    return (
        f"\n## Per-layer coefficients of the pick\n\nWeight of post per layer at alpha = {alpha!r} "
        f"({values}).\n\n![layers]({LAYERS_PLOT_FILE})\n"
    )


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


def write_report(result: SweepResult) -> None:
    """sweep.png, forgetting_map.png, samples.jsonl, results.json and report.md in the run folder, each replaced
    atomically, the plots first: a report that is written links no plot that failed to be."""
    folder = Path(result.out)
    curves = plot if result.settings.second is None else lambda result, path: plot_heatmap(result, path, _new_figure)
    for draw, name in ((curves, PLOT_FILE), (plot_forgetting_map, MAP_FILE)):
        write_atomic(folder / name, lambda temp, draw=draw: draw(result, temp))
    write_samples(result)
    results = results_json(result)
    write_atomic(folder / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    drift = ""
    if result.drift is not None:
        method = methods.method(result.settings.method)
        interpolated = method.reads_recall_weights and method.interpolates  # recall_lerp's weights per layer
        drift = "\n" + "\n".join(drift_lines(result, pick_coefficients(result, folder) if interpolated else None))
    write_atomic(folder / REPORT_FILE, report_markdown(result, results) + layer_profile(result, folder) + drift)
