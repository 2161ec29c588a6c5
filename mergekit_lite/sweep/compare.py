"""Several merge methods swept on one pair in one run folder, and compared against a baseline method. [ours]

`run.run_comparison` evaluates pre and post once, into the run folder's own `points/`, and writes their point
files into each method's sweep folder (`OUT/<method>/`) under that sweep's identity, so every method's sweep
resumes them instead of evaluating them again; each method's sweep is then an ordinary sweep (grid, golden
search, probe mode, Ray, resume, its own report). Every method's pick is made on the selection split, as in a
single sweep.

The comparison (`comparison.json`, `comparison.md`, `pareto.png`) reports each pick on the report split with
its intervals, and the paired-bootstrap interval of its harmonic mean minus the baseline method's pick's
(every model answered the same report docs, resampled together per task): a method whose interval holds 0 is
indistinguishable from the baseline on these docs. Honest answer to "which method": the one that beats the
baseline by an interval that excludes 0, else none of them (arXiv 2511.21437 found only task arithmetic
reliably helped on LLMs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mergekit_lite.errors import InputError
from mergekit_lite.io.outputs import write_atomic
from mergekit_lite.merge import methods as merge_methods
from mergekit_lite.sweep.result import SweepResult, pick_fields
from mergekit_lite.sweep.scoring import PointResult, paired_bootstrap
from mergekit_lite.sweep.settings import SECOND_AXES, SweepSettings, settings_from_dict

COMPARISON_JSON, COMPARISON_MD, PARETO_PLOT = "comparison.json", "comparison.md", "pareto.png"
# what pre and post do not depend on ("grid": a 2-D method's second coefficient)
METHOD_FIELDS = ("method", "density", "drop", "recall_texts", "recall_samples", "beta", "grid")
# what each entry of `methods:` may set for its own sweep (a 2-D grid and its budget included)
PER_METHOD = ("alphas", "density", "drop", "beta", "betas", "densities", "drops", "budget")
# shared settings that only some methods take (setting -> merge parameter): given for all, each method that takes it
METHOD_OPTIONS = {"density": "density", "drop": "drop", "beta": "beta", **SECOND_AXES}


@dataclass
class MethodRow:
    """One method's pick against the baseline's, on the report split."""

    method: str
    pick: PointResult
    diff_to_baseline: list[float] | None  # [low, high] of HM(pick) - HM(baseline pick); None without bootstrap
    indistinguishable: bool | None


@dataclass
class Comparison:
    """Every method's sweep, its pick's row against the baseline's, and what this run evaluated."""

    baseline: str
    pre: PointResult
    post: PointResult
    sweeps: dict[str, SweepResult]
    rows: list[MethodRow]
    evaluations: int  # models evaluated by this call: pre and post at most once, plus each method's new points
    out: Path


def method_settings(data: dict, methods: list) -> list[SweepSettings]:
    """One SweepSettings per method: the shared settings in `data`, each entry of `methods` a name or a mapping
    {method: NAME, alphas: ..., density: ..., drop: ...}; each sweeps into OUT/NAME."""
    if data.get("save_best"):
        raise InputError("--save-best merges one sweep's pick: run that method's sweep alone")
    entries = [{"method": entry} if isinstance(entry, str) else dict(entry) for entry in methods]
    settings = []
    for entry in entries:
        name = entry.pop("method", None)
        unknown = set(entry) - set(PER_METHOD)
        if not isinstance(name, str) or unknown:
            raise InputError(
                f"methods: each entry is a method name or {{method: NAME, "
                f"{', '.join(PER_METHOD)}}}, got {entry if name else 'no method'}"
            )
        shared = {
            key: value
            for key, value in data.items()  # --density 0.5 beside linear,ties is ties' density
            if key not in METHOD_OPTIONS or METHOD_OPTIONS[key] in merge_methods.parameters_of(name)
        }
        own = {**shared, **entry, "method": name}
        settings.append(settings_from_dict({**own, "out": str(Path(own["out"]) / name) if own.get("out") else None}))
    names = [s.method for s in settings]
    for key in (key for key in METHOD_OPTIONS if data.get(key) is not None):
        if not any(METHOD_OPTIONS[key] in merge_methods.parameters_of(name) for name in names):
            raise InputError(f"{key}: none of the methods ({', '.join(names)}) takes {METHOD_OPTIONS[key]}")
    if len(set(names)) != len(names):
        raise InputError(f"methods: {', '.join(sorted({n for n in names if names.count(n) > 1}))} given twice")
    return settings


def compare(sweeps: dict[str, SweepResult], baseline: str, folder: Path, evaluations: int) -> Comparison:
    """Each method's pick against the baseline's: the paired bootstrap of the harmonic-mean difference on the
    report split, with the sweeps' own seed, draws and confidence."""
    import numpy as np

    reference = sweeps[baseline]
    settings = reference.settings
    picks = [result.best for result in sweeps.values()]
    rows = []
    if settings.bootstrap:
        draws = paired_bootstrap(picks, reference.splits, settings.aggregation, settings.bootstrap, settings.seed)
        tail = (1 - settings.confidence) / 2 * 100
        base_index = list(sweeps).index(baseline)
    for index, (method, result) in enumerate(sweeps.items()):
        interval = None
        if settings.bootstrap:
            interval = np.percentile(draws[:, index, 2] - draws[:, base_index, 2], [tail, 100 - tail]).tolist()
        rows.append(
            MethodRow(
                method, result.best, interval, None if interval is None else bool(interval[0] <= 0 <= interval[1])
            )
        )
    return Comparison(baseline, reference.pre, reference.post, sweeps, rows, evaluations, folder)


def comparison_json(comparison: Comparison) -> dict:
    def scores(point: PointResult) -> dict:
        return {
            "old": point.old,
            "new": point.new,
            "harmonic_mean": point.harmonic_mean,
            "selection_harmonic_mean": point.selection.harmonic_mean,
            "intervals": point.intervals,
        }

    settings = comparison.sweeps[comparison.baseline].settings
    return {
        "baseline": comparison.baseline,
        "evaluations": comparison.evaluations,
        "confidence": settings.confidence,
        "selection": settings.selection,
        "pre": scores(comparison.pre),
        "post": scores(comparison.post),
        "methods": [
            {
                "method": row.method,
                "coefficient": comparison.sweeps[row.method].settings.coefficient,
                "pick": row.pick.alpha,
                **({row.pick.second[0]: row.pick.second[1]} if row.pick.second else {}),
                **scores(row.pick),
                "diff_to_baseline": row.diff_to_baseline,
                "indistinguishable_from_baseline": row.indistinguishable,
                **pick_fields(comparison.sweeps[row.method]),
                "pareto": comparison.sweeps[row.method].pareto,
                "points": [
                    {"alpha": p.alpha, **({p.second[0]: p.second[1]} if p.second else {}), "old": p.old, "new": p.new}
                    for p in comparison.sweeps[row.method].points
                ],
                "report": f"{row.method}/report.md",
            }
            for row in comparison.rows
        ],
    }


def _chosen(pick: PointResult, coefficient: str) -> str:
    """A method's pick in words: `lambda 0.5`, with a 2-D grid's second coefficient after it."""
    return f"{coefficient} {pick.alpha!r}" + (f", {pick.second[0]} {pick.second[1]!r}" if pick.second else "")


def _cell(value: float, interval: list[float] | None) -> str:
    return f"{value:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")


def comparison_markdown(comparison: Comparison, data: dict) -> str:
    settings = comparison.sweeps[comparison.baseline].settings
    lines = [
        "# Method comparison",
        "",
        f"pre: old {comparison.pre.old:.3f}, new {comparison.pre.new:.3f}; "
        f"post: old {comparison.post.old:.3f}, new {comparison.post.new:.3f} (report split; evaluated once, shared).",
        "",
        "Each method's coefficient is picked by the harmonic mean on the selection split; scores are on the report "
        f'split with {settings.confidence:.0%} paired-bootstrap intervals. "vs {comparison.baseline}" is the '
        f"interval of the pick's harmonic mean minus {comparison.baseline}'s pick's, resampled on the same docs; "
        '"indistinguishable" when it holds 0.',
        "",
        f"| method | pick | old | new | harmonic mean | vs {comparison.baseline} | |",
        "|---|---|---|---|---|---|---|",
    ]
    for row, entry in zip(comparison.rows, data["methods"]):
        pick = row.pick
        verdict = (
            "baseline"
            if row.method == comparison.baseline
            else ""
            if row.indistinguishable is None
            else "indistinguishable"
            if row.indistinguishable
            else "better"
            if row.diff_to_baseline[0] > 0
            else "worse"
        )
        low_high = row.diff_to_baseline
        diff = "" if low_high is None else f"[{low_high[0]:+.3f}, {low_high[1]:+.3f}]"
        lines.append(
            f"| [{row.method}]({entry['report']}) | {_chosen(pick, entry['coefficient'])} | "
            f"{_cell(pick.old, pick.intervals.get('old'))} | {_cell(pick.new, pick.intervals.get('new'))} | "
            f"{_cell(pick.harmonic_mean, pick.intervals.get('harmonic_mean'))} | {diff} | {verdict} |"
        )
    lines += ["", *pick_lines(comparison, "- {method}: {text}.", "- **{method}: {text}**")]
    lines += [
        "",
        f"{comparison.evaluations} models evaluated by this run (pre and post once for every method).",
        "",
        f"![old against new]({PARETO_PLOT})",
        "",
    ]
    return "\n".join(lines)


def pick_lines(comparison: Comparison, outcome: str, warning: str) -> list[str]:
    """Each method's pick in words (forgetting recovered and new skill kept, or that it is pre or post itself), and
    a warning where another of its alphas beat it on the report split."""
    lines = []
    for method, result in comparison.sweeps.items():
        lines.append(outcome.format(method=method, text=result.outcome_text()))
        lines += [warning.format(method=method, text=result.warning_text())] if result.better else []
    return lines


def plot_pareto(comparison: Comparison, path: Path) -> None:
    """old against new (report split) for every point of every method; each method's front (selection split)
    as a line, its pick as a star; pre and post as black markers."""
    from mergekit_lite.sweep.report import _new_figure

    figure = _new_figure((6.4, 5.6))
    axes = figure.add_subplot()
    for index, (method, result) in enumerate(comparison.sweeps.items()):
        color = f"C{index % 10}"
        axes.scatter([p.old for p in result.points], [p.new for p in result.points], s=14, color=color, alpha=0.5)
        front = sorted((p for p in result.points if p.key in result.pareto), key=lambda p: p.old)
        axes.plot([p.old for p in front], [p.new for p in front], "-", color=color, linewidth=1, label=method)
        axes.plot([result.best.old], [result.best.new], "*", color=color, markersize=14, markeredgecolor="black")
    axes.plot([comparison.pre.old], [comparison.pre.new], "s", color="black", label="pre")
    axes.plot([comparison.post.old], [comparison.post.new], "D", color="black", label="post")
    axes.set_xlabel("old (report split)")
    axes.set_ylabel("new (report split)")
    axes.legend(fontsize=7, loc="best", title="front (selection), * = pick", title_fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def write_comparison(comparison: Comparison) -> None:
    folder = comparison.out
    write_atomic(folder / PARETO_PLOT, lambda temp: plot_pareto(comparison, temp))
    data = comparison_json(comparison)
    write_atomic(folder / COMPARISON_JSON, json.dumps(data, indent=2, allow_nan=False) + "\n")
    write_atomic(folder / COMPARISON_MD, comparison_markdown(comparison, data))


def comparison_summary(comparison: Comparison) -> str:
    """A few lines for stdout: pre, post, each method's pick and its verdict against the baseline."""
    lines = [
        f"pre   old {comparison.pre.old:.3f}  new {comparison.pre.new:.3f}",
        f"post  old {comparison.post.old:.3f}  new {comparison.post.new:.3f}",
    ]
    for row in comparison.rows:
        pick = row.pick
        verdict = (
            ""
            if row.method == comparison.baseline or row.diff_to_baseline is None
            else f"  vs {comparison.baseline} [{row.diff_to_baseline[0]:+.3f}, {row.diff_to_baseline[1]:+.3f}]"
            + (" indistinguishable" if row.indistinguishable else "")
        )
        lines.append(
            f"best {row.method:<16} ({_chosen(pick, comparison.sweeps[row.method].settings.coefficient)})  "
            f"old {pick.old:.3f}  new {pick.new:.3f}  harmonic mean {pick.harmonic_mean:.3f}{verdict}"
        )
    lines += pick_lines(comparison, "      {method}: {text}", "      {method} {text}")
    lines.append(f"evaluated {comparison.evaluations} models; comparison: {comparison.out / COMPARISON_MD}")
    return "\n".join(lines)
