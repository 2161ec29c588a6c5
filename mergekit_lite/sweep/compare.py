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
from mergekit_lite.io.report_page import Cell, Headline, Plot, Prose, Section, Table, markdown, render_html
from mergekit_lite.merge import methods as merge_methods
from mergekit_lite.sweep.power import DocsNeeded, docs_needed
from mergekit_lite.sweep.result import SweepResult, pick_fields
from mergekit_lite.sweep.scoring import PointResult, paired_bootstrap
from mergekit_lite.sweep.settings import SECOND_AXES, SweepSettings, settings_from_dict

COMPARISON_JSON, COMPARISON_MD, PARETO_PLOT = "comparison.json", "comparison.md", "pareto.png"
COMPARISON_HTML = "comparison.html"
SCORES = ("old", "new", "harmonic_mean")
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
    separation: DocsNeeded | None = None  # report docs that would separate it from the baseline's pick (sweep.power)


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
    if data.get("save_best_adapter"):
        raise InputError("--save-best-adapter writes one sweep's pick: run that method's sweep alone")
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
        separation = None
        if interval is not None and method != baseline:
            separation = docs_needed(result.best, reference.best, reference.splits, settings.aggregation)
        indistinguishable = None if interval is None else bool(interval[0] <= 0 <= interval[1])
        rows.append(MethodRow(method, result.best, interval, indistinguishable, separation))
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
                "docs_to_separate": row.separation.to_json() if row.separation else None,
                **pick_fields(comparison.sweeps[row.method]),
                "pareto": comparison.sweeps[row.method].pareto,
                "points": [
                    {"alpha": p.alpha, **({p.second[0]: p.second[1]} if p.second else {}), "old": p.old, "new": p.new}
                    for p in comparison.sweeps[row.method].points
                ],
                "report": f"{row.method}/report.md",
                **vector_json(comparison.sweeps[row.method]),
            }
            for row in comparison.rows
        ],
    }


def vector_json(result: SweepResult) -> dict:
    """With --groups/--modules, the method's vector beside its scalar pick (sweep.vector_search.judge): its
    coefficients, its report-split scores, the paired interval of vector - scalar, and whether it was chosen."""
    vector = result.vector
    if vector is None:
        return {}
    pick = vector["pick"]
    kept = ("coefficients", "old", "new", "harmonic_mean", "selection_harmonic_mean")
    return {
        "vector": {
            **{name: pick[name] for name in kept},
            "difference": vector["difference"],
            "intervals": vector["intervals"],
            "chosen": vector["chosen"],
            "beat_scalar": vector["beat_scalar"],
            "verdict": vector["verdict"],
            "trials": vector["search"]["trials"],
        }
    }


def vector_table(comparison: Comparison, data: dict) -> Table | None:
    """Each method's vector of coefficients beside its scalar pick, on the report split: the scalar pick's and the
    vector's harmonic means and the paired-bootstrap interval of their difference."""
    rows = []
    for row, entry in zip(comparison.rows, data["methods"], strict=True):
        vector = entry.get("vector")
        if vector is None:
            continue
        coefficients = ", ".join(f"{slot} {value:.2f}" for slot, value in vector["coefficients"].items())
        interval = vector["intervals"].get("harmonic_mean")
        difference = vector["difference"]["harmonic_mean"]
        shown = f"{difference:+.3f}" + (f" [{interval[0]:+.3f}, {interval[1]:+.3f}]" if interval else "")
        outcome = "beats the scalar pick" if vector["beat_scalar"] else "chosen" if vector["chosen"] else "not chosen"
        rows.append(
            [
                Cell(row.method, link=entry["report"]),
                Cell(f"{_chosen(row.pick, entry['coefficient'])}: {row.pick.harmonic_mean:.3f}", row.pick.alpha),
                Cell(coefficients),
                _cell(vector["harmonic_mean"], None),
                Cell(shown, difference),
                Cell(outcome),
            ]
        )
    if not rows:
        return None
    columns = ["method", "scalar pick: harmonic mean", "vector", "harmonic mean", "vector - scalar", ""]
    return Table(columns, rows, key="vectors", markdown_header="| " + " | ".join(columns[:-1]) + " | |")


def _chosen(pick: PointResult, coefficient: str) -> str:
    """A method's pick in words: `lambda 0.5`, with a 2-D grid's second coefficient after it."""
    return f"{coefficient} {pick.alpha!r}" + (f", {pick.second[0]} {pick.second[1]!r}" if pick.second else "")


def _cell(value: float, interval: list[float] | None) -> Cell:
    return Cell(f"{value:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""), value)


def verdict_of(row: MethodRow, baseline: str) -> str:
    """A method's pick against the baseline's: baseline, indistinguishable, better or worse ('' without intervals)."""
    if row.method == baseline:
        return "baseline"
    if row.indistinguishable is None:
        return ""
    if row.indistinguishable:
        return "indistinguishable"
    return "better" if row.diff_to_baseline[0] > 0 else "worse"


def comparison_sections(comparison: Comparison, data: dict) -> list[Section]:
    """The comparison as report sections (io.report_page): comparison.md and comparison.html render them."""
    settings = comparison.sweeps[comparison.baseline].settings
    rows = []
    for row, entry in zip(comparison.rows, data["methods"], strict=True):
        pick, low_high = row.pick, row.diff_to_baseline
        rows.append(
            [
                Cell(row.method, link=entry["report"]),
                Cell(_chosen(pick, entry["coefficient"]), pick.alpha),
                *(_cell(getattr(pick, name), pick.intervals.get(name)) for name in ("old", "new", "harmonic_mean")),
                Cell("", None) if low_high is None else Cell(f"[{low_high[0]:+.3f}, {low_high[1]:+.3f}]", low_high[0]),
                Cell(verdict_of(row, comparison.baseline)),
            ]
        )
    columns = ["method", "pick", "old", "new", "harmonic mean", f"vs {comparison.baseline}", ""]
    blocks = [
        Prose(
            [
                f"pre: old {comparison.pre.old:.3f}, new {comparison.pre.new:.3f}; "
                f"post: old {comparison.post.old:.3f}, new {comparison.post.new:.3f} (report split; evaluated once, "
                "shared)."
            ]
        ),
        Prose(
            [
                "Each method's coefficient is picked by the harmonic mean on the selection split; scores are on the "
                f"report split with {settings.confidence:.0%} paired-bootstrap intervals. "
                f'"vs {comparison.baseline}" is the interval of the pick\'s harmonic mean minus '
                f"{comparison.baseline}'s pick's, resampled on the same docs; "
                '"indistinguishable" when it holds 0.'
            ]
        ),
        Table(columns, rows, key="methods", markdown_header="| " + " | ".join(columns[:-1]) + " | |"),
        *([Prose(lines)] if (lines := separation_lines(comparison, "- {method}: {text}.")) else []),
        *vector_blocks(comparison, data),
        Prose(pick_lines(comparison, "- {method}: {text}.", "- **{method}: {text}**")),
        Prose([f"{comparison.evaluations} models evaluated by this run (pre and post once for every method)."]),
        Plot(PARETO_PLOT, "old against new"),
    ]
    return [Section("comparison", "Method comparison", blocks, level=1)]


def vector_blocks(comparison: Comparison, data: dict) -> list:
    table = vector_table(comparison, data)
    if table is None:
        return []
    settings = comparison.sweeps[comparison.baseline].settings
    return [
        Prose(
            [
                "Per-layer-group vectors (--groups/--modules): each method's vector, searched on the selection split "
                "from its scalar pick, against that pick on the report split; the interval is the paired bootstrap "
                f"({settings.confidence:.0%}) of the vector's harmonic mean minus the scalar pick's."
            ]
        ),
        table,
    ]


def comparison_markdown(comparison: Comparison, data: dict) -> str:
    return markdown(comparison_sections(comparison, data))


def comparison_headline(comparison: Comparison) -> Headline:
    """The top of the page: the method to use (the best that beats the baseline by an interval above 0, else the
    baseline), its pick's scores, and the verdict in a sentence."""
    better = [row for row in comparison.rows if verdict_of(row, comparison.baseline) == "better"]
    chosen = max(better, key=lambda row: row.pick.harmonic_mean) if better else None
    row = chosen or next(row for row in comparison.rows if row.method == comparison.baseline)
    coefficient = comparison.sweeps[row.method].settings.coefficient
    if chosen:
        verdict = (
            f"{chosen.method} beats {comparison.baseline}'s pick with an interval above 0 "
            f"[{chosen.diff_to_baseline[0]:+.3f}, {chosen.diff_to_baseline[1]:+.3f}] on the report docs."
        )
    else:
        verdict = (
            f"No method beats {comparison.baseline}'s pick by an interval that excludes 0 on the report docs: "
            f"{comparison.baseline} it is."
        )
    scores = [(name.replace("_", " "), getattr(row.pick, name), row.pick.intervals.get(name)) for name in SCORES]
    facts = [("methods", ", ".join(row.method for row in comparison.rows)), ("baseline", comparison.baseline)]
    settings = comparison.sweeps[comparison.baseline].settings
    facts += [("pre", settings.pre), ("post", settings.post)]
    return Headline("Method comparison", f"{row.method} ({_chosen(row.pick, coefficient)})", scores, verdict, [], facts)


def pick_lines(comparison: Comparison, outcome: str, warning: str) -> list[str]:
    """Each method's pick in words (forgetting recovered and new skill kept, or that it is pre or post itself), and
    a warning where another of its alphas beat it on the report split, or where it rests on tasks scored at chance
    (sweep.chance)."""
    lines = []
    for method, result in comparison.sweeps.items():
        lines.append(outcome.format(method=method, text=result.outcome_text()))
        lines += [warning.format(method=method, text=result.warning_text())] if result.better else []
        lines += [warning.format(method=method, text=result.chance_text())] if result.unsupported else []
    return lines


def separation_lines(comparison: Comparison, line: str) -> list[str]:
    """For each method indistinguishable from the baseline: the report docs that would separate its pick from the
    baseline's at their observed difference (sweep.power)."""
    return [
        line.format(method=row.method, text=row.separation.text(f"{comparison.baseline}'s pick"))
        for row in comparison.rows
        if row.indistinguishable and row.separation
    ]


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
    page = render_html(comparison_headline(comparison), comparison_sections(comparison, data), folder)
    write_atomic(folder / COMPARISON_HTML, page)


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
        if row.indistinguishable and row.separation:
            baseline_pick = f"{comparison.baseline}'s pick"
            verdict += f" ({row.separation.text(baseline_pick)})"
        lines.append(
            f"best {row.method:<16} ({_chosen(pick, comparison.sweeps[row.method].settings.coefficient)})  "
            f"old {pick.old:.3f}  new {pick.new:.3f}  harmonic mean {pick.harmonic_mean:.3f}{verdict}"
        )
    lines += pick_lines(comparison, "      {method}: {text}", "      {method} {text}")
    lines.append(f"evaluated {comparison.evaluations} models; comparison: {comparison.out / COMPARISON_MD}")
    return "\n".join(lines)
