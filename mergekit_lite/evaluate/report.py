"""A finished sweep, written three ways into its run folder: results.json (everything, for tools),
report.md (the table, the pick and the forgetting maps, for people) and sweep.png (the curves).

report.md is rendered from the same dict that results.json stores, so the two cannot disagree.
"""

from __future__ import annotations

import json
from pathlib import Path

from mergekit_lite.evaluate.forgetting import format_table
from mergekit_lite.evaluate.sweep import PointResult, SweepResult, write_atomic

RESULTS_FILE, REPORT_FILE, PLOT_FILE = "results.json", "report.md", "sweep.png"
LAYERS_PLOT_FILE = "layers.png"
ALPHA_MEANING = {
    "linear": "weight of post (0 = pre, 1 = post)",
    "slerp": "t, spherical interpolation from pre (0) to post (1)",
    "task_arithmetic": "lambda, the scale of post's task vector (post - pre) added to pre",
    "ties": "lambda, the scale of post's TIES-trimmed task vector added to pre",
    "dare_linear": "lambda, the scale of post's DARE-dropped task vector added to pre",
    "dare_ties": "lambda, the scale of post's DARE-dropped, sign-elected task vector added to pre",
    "recall": "softmax temperature of RECALL's per-layer weights (low = each layer follows the closer model)",
    "recall_lerp": "global weight of post; layer l takes alpha ** (its drift / mean drift), flat drift = linear",
}
DEFINITIONS = {
    "old": "mean accuracy over the old tasks (what pre could do)",
    "new": "mean accuracy over the new tasks (what post-training taught)",
    "harmonic_mean": "2*old*new/(old+new), 0 when both are 0; the pick maximises it",
    "F_true(old)": "chance-corrected share of the old-task samples (pooled over the old group) that pre got right "
                   "and this model gets wrong",
    "BT_true(new)": "chance-corrected share of the new-task samples (pooled over the new group) that pre got wrong "
                    "and this model gets right",
    "recovered": "(old_best - old_post) / (old_pre - old_post): share of post's old-task loss the pick wins back; "
                 "null when post lost nothing",
    "ties": "alphas whose harmonic mean is within 1e-9 of the best; the smallest is picked",
    "pareto": "alphas that no other alpha beats on both old and new",
}


def point_json(point: PointResult) -> dict:
    return {
        "label": point.label,
        "alpha": point.alpha,
        "old": point.old,
        "new": point.new,
        "harmonic_mean": point.harmonic_mean,
        "tasks": {run.task: {"group": run.group, "acc": run.acc} for run in point.tasks},
        "forgetting": {
            "tasks": [row.to_dict() for row in point.forgetting],
            "groups": {group: row.to_dict() for group, row in point.groups.items()},
        },
    }


def results_json(result: SweepResult) -> dict:
    best = result.best
    return {
        "settings": result.settings.to_dict(),
        "coefficient": result.settings.coefficient,
        "alpha_means": ALPHA_MEANING[result.settings.method],
        "definitions": DEFINITIONS,
        "pre": point_json(result.pre),
        "post": point_json(result.post),
        "points": [point_json(point) for point in result.points],
        "pick": {"alpha": best.alpha, "old": best.old, "new": best.new, "harmonic_mean": best.harmonic_mean,
                 "ties": result.ties},
        "pareto": result.pareto,
        "recovered": result.recovered,
    }


def _row(data: dict, name: str, notes: list[str]) -> str:
    groups = data["forgetting"]["groups"]
    cells = [name] + [f"{value:.4f}" for value in (data["old"], data["new"], data["harmonic_mean"],
                                                   groups["old"]["F_true"], groups["new"]["BT_true"])]
    return "| " + " | ".join(cells + [", ".join(notes)]) + " |"


def score_table(results: dict) -> str:
    """alpha | old | new | HM | F_true(old) | BT_true(new) | note, with pre and post as reference rows."""
    pick, pareto = results["pick"], set(results["pareto"])
    lines = ["| alpha | old | new | harmonic mean | F_true(old) | BT_true(new) | note |",
             "|---|---:|---:|---:|---:|---:|---|",
             _row(results["pre"], "pre", ["reference"])]
    for point in results["points"]:
        alpha = point["alpha"]
        notes = (["pick"] if alpha == pick["alpha"] else []) + (["tie"] if alpha in pick["ties"] and
                                                                alpha != pick["alpha"] else [])
        notes += ["pareto"] if alpha in pareto else []
        lines.append(_row(point, repr(alpha), notes))
    lines.append(_row(results["post"], "post", ["reference"]))
    return "\n".join(lines)


def forgetting_section(title: str, point: PointResult) -> str:
    groups = [point.groups[group] for group in ("old", "new")]
    return f"## {title}\n\n{format_table(point.forgetting)}\n\n{format_table(groups, name_header='group')}\n"


def report_markdown(result: SweepResult, results: dict) -> str:
    settings, pick = result.settings, results["pick"]
    recovered = results["recovered"]
    ties = ", ".join(map(repr, pick["ties"])) if len(pick["ties"]) > 1 else "none"
    lines = [
        f"# Sweep: {settings.method} between pre and post",
        "",
        f"- pre: `{settings.pre}`",
        f"- post: `{settings.post}`",
        f"- alpha = {results['alpha_means']}",
        f"- old tasks: {', '.join(settings.old_tasks)}; new tasks: {', '.join(settings.new_tasks)}; "
        f"samples per task: {settings.limit or 'all'}",
        "",
        *[f"- **{name}**: {text}" for name, text in DEFINITIONS.items()],
        "",
        score_table(results),
        "",
        f"**Pick: alpha = {pick['alpha']!r}** (old {pick['old']:.4f}, new {pick['new']:.4f}, "
        f"harmonic mean {pick['harmonic_mean']:.4f}); ties: {ties}.",
        "",
        f"Pareto front: {', '.join(map(repr, results['pareto']))}.",
        "",
        "Forgetting recovered: " + (f"{recovered:.1%}" if recovered is not None else
                                    "N/A (post did not lose old-task accuracy)"),
        "",
        f"![sweep]({PLOT_FILE})",
        "",
        forgetting_section("Forgetting map: pre -> post", result.post),
        forgetting_section(f"Forgetting map: pre -> merge at alpha = {pick['alpha']!r}", result.best),
    ]
    return "\n".join(lines)


def plot(result: SweepResult, path: Path) -> None:
    """alpha vs old, new and harmonic mean; pre (--) and post (-.) levels dashed; the pick marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    alphas = [point.alpha for point in result.points]
    for name, color in (("old", "tab:blue"), ("new", "tab:orange")):
        axes.plot(alphas, [getattr(point, name) for point in result.points], "o-", color=color, label=name)
        axes.axhline(getattr(result.pre, name), color=color, linestyle="--", linewidth=1, label=f"pre {name}")
        axes.axhline(getattr(result.post, name), color=color, linestyle="-.", linewidth=1, label=f"post {name}")
    axes.plot(alphas, [point.harmonic_mean for point in result.points], "s-", color="tab:green",
              label="harmonic mean")
    best = result.best
    axes.plot([best.alpha], [best.harmonic_mean], "*", color="black", markersize=16,
              label=f"pick (alpha={best.alpha!r})")
    axes.set_xlabel(f"alpha ({result.settings.coefficient} of {result.settings.method})")
    axes.set_ylabel("accuracy")
    axes.set_ylim(-0.02, 1.02)
    axes.legend(fontsize=8, loc="best")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def layer_profile(result: SweepResult, folder: Path) -> str:
    """RECALL methods only: post's coefficient per layer at the pick, plotted into layers.png, and the
    report section that shows it (empty for the other methods, whose coefficient is one number)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from mergekit_lite.evaluate.sweep import RECALL_DIR, SIMILARITY_FILE
    from mergekit_lite.merge.recall import RecallWeights, post_coefficients

    similarity_file = folder / RECALL_DIR / SIMILARITY_FILE
    if not similarity_file.is_file():
        return ""
    method, alpha = result.settings.method, result.best.alpha
    coefficients = post_coefficients(RecallWeights.from_json(json.loads(similarity_file.read_text())), method, alpha)
    labels = ["embed"] + [str(layer) for layer in range(len(coefficients) - 1)]
    figure = Figure(figsize=(7, 3.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(range(len(coefficients)), coefficients, "o-", color="tab:purple", label=f"{method} at alpha={alpha!r}")
    if method == "recall_lerp":
        axes.axhline(alpha, color="gray", linestyle="--", linewidth=1, label="linear at the same alpha")
    axes.set_xticks(range(len(coefficients)), labels)
    axes.set_xlabel("layer (the head follows the last layer)")
    axes.set_ylabel("weight of post (0 = pre)")
    axes.set_ylim(-0.02, 1.02)
    axes.legend(fontsize=8, loc="best")
    figure.tight_layout()
    temp = folder / f".{LAYERS_PLOT_FILE}.tmp.png"
    figure.savefig(temp, dpi=120)
    temp.replace(folder / LAYERS_PLOT_FILE)
    values = ", ".join(f"{label}: {value:.3f}" for label, value in zip(labels, coefficients))
    return (f"\n## Per-layer coefficients of the pick\n\nWeight of post per layer at alpha = {alpha!r} "
            f"({values}).\n\n![layers]({LAYERS_PLOT_FILE})\n")


def write_report(result: SweepResult) -> None:
    """results.json, report.md and sweep.png in the run folder, each replaced atomically."""
    folder = Path(result.out)
    results = results_json(result)
    write_atomic(folder / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    write_atomic(folder / REPORT_FILE, report_markdown(result, results) + layer_profile(result, folder))
    temp = folder / f".{PLOT_FILE}.tmp.png"
    plot(result, temp)
    temp.replace(folder / PLOT_FILE)
