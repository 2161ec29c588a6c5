"""A finished sweep as one report model, built once: the results.json document, the samples.jsonl rows, the headline
(the pick, its scores, the verdict) and the report's sections as blocks (io/report_page). report.md, results.json
and report.html are three renderings of it, so they cannot disagree.

More sections: a builder is a function of the ReportContext returning a Section (or None where it has nothing to
say); SECTIONS lists them in the report's order, and a new one goes where it should be read. A new field of the
pick goes in `summary_section` (report.md's summary) and `headline` (the top of the page); a new field of
results.json in `results_json`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mergekit_lite.evaluate.pages import forgetting_table
from mergekit_lite.io.hub import hub_id_of
from mergekit_lite.io.report_page import Cell, Headline, Plot, Prose, SampleList, Section, Table, markdown, number
from mergekit_lite.merge import methods
from mergekit_lite.sweep.grid import cell_key, cell_text, grid_json, grid_section
from mergekit_lite.sweep.realign import realign_section
from mergekit_lite.sweep.result import SweepResult, pick_fields
from mergekit_lite.sweep.samples import (
    SAMPLES_FILE,
    realign_json_of,
    result_kinds,
    sample_rows,
    samples_json,
    samples_section,
)
from mergekit_lite.sweep.scoring import PointResult, task_accuracy
from mergekit_lite.sweep.store import RECALL_DIR, SIMILARITY_FILE
from mergekit_lite.sweep.vector import vector_section

RESULTS_FILE, REPORT_FILE, HTML_FILE = "results.json", "report.md", "report.html"
PLOT_FILE, MAP_FILE, LAYERS_PLOT_FILE = "sweep.png", "forgetting_map.png", "layers.png"
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
    "unsupported": "true when pre on an old task, post on a new task, or every merge on any task scores within "
    "chance (`chance`): the Wilson "
    "interval of its report-split accuracy covers 1/k for k choices per doc (0 for free-form generation); the "
    "pick then rests on scores that say nothing about the skill",
    "docs_to_separate": "report docs (every task together, in today's proportions) that would separate the pick "
    "from the runner-up (the best other selection harmonic mean) at their observed report-split difference: "
    "n = ((z_0.975 + z_0.8) * sd / diff)^2, level 0.05 and power 0.8, sd the per-doc standard deviation of the "
    "paired differences weighted as the harmonic mean weighs each task (delta method); null when diff is 0",
    "ties": "alphas whose selection harmonic mean is within 1e-9 of the best; the smallest is picked",
    "pareto": "alphas that no other alpha beats on both old and new (selection split)",
}


# --- results.json --------------------------------------------------------------------------------------------


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


def results_json(result: SweepResult, rows: list[dict] | None = None, kinds=None) -> dict:
    """results.json; `rows` (sample_rows) and `kinds` (result_kinds) when the caller has them already."""
    best, settings = result.best, result.settings
    if rows is None:
        kinds = result_kinds(result)
        rows = sample_rows(result, kinds)
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
            "docs_to_separate": result.separation.to_json() if result.separation else None,
            "unsupported": result.unsupported,
        },
        "pareto": result.pareto,
        **pick_fields(result),
        "chance": [level.to_json() for level in result.chance],
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
        "samples": samples_json(result, rows),
        **({"realign": realign_json_of(result, rows, kinds)} if result.realigned is not None else {}),
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
        "docs_to_separate": probe.separation.to_json() if probe.separation else None,
        "samples_per_probe": probe.samples_probed,
        "samples_per_full_point": probe.samples_all,
        "sample_evaluations": len(probe.estimates) * probe.samples_probed + probe.samples_all,
        "grid_sample_evaluations": len(result.settings.alphas) * probe.samples_all,
        "estimates": [{"alpha": alpha, **asdict(estimate)} for alpha, estimate in probe.estimates.items()],
    }


def drift_json(report) -> dict:
    """results.json's `drift`: post's relative Frobenius drift from pre, whole, per decoder layer and outside them."""
    data = report.to_json()
    return {name: data[name] for name in ("relative_drift", "layers", "outside_layers", "modules")}


def pick_coefficients(result: SweepResult, folder: Path) -> list[float] | None:
    """RECALL methods: post's weight per depth row at the pick (embeddings, each layer; the head follows the last);
    None for the other methods."""
    from mergekit_lite.merge.recall import RecallWeights, post_coefficients

    similarity_file = folder / RECALL_DIR / SIMILARITY_FILE
    if not similarity_file.is_file():
        return None
    weights = RecallWeights.from_json(json.loads(similarity_file.read_text()))
    return post_coefficients(weights, methods.method(result.settings.method).interpolates, result.best.alpha)


# --- the model -----------------------------------------------------------------------------------------------


@dataclass
class ReportContext:
    """What the section builders read: the result, its results.json document, its sample rows, and RECALL's
    per-layer weights of post at the pick (None for the other methods)."""

    result: SweepResult
    results: dict
    rows: list[dict]
    coefficients: list[float] | None = None


@dataclass
class SweepReport:
    """The report model: results.json's document, samples.jsonl's rows, the headline and the sections."""

    result: SweepResult
    results: dict
    rows: list[dict]
    headline: Headline
    sections: list[Section] = field(default_factory=list)

    def markdown(self) -> str:
        return markdown(self.sections)

    def json(self) -> str:
        return json.dumps(self.results, indent=2, allow_nan=False) + "\n"

    def html(self, folder: Path | None = None) -> str:
        from mergekit_lite.io.report_page import render_html

        return render_html(self.headline, self.sections, folder, self.sample_list())

    def sample_list(self) -> SampleList:
        """Every samples.jsonl row for the page's browser, each with its task's group."""
        group = {run.task: run.group for run in self.result.pre.tasks}
        rows = [{**row, "group": group.get(row["task"])} for row in self.rows]
        filters = ["class", "task", "group", "split"] + (
            ["forgetting_kind"] if self.result.realigned is not None else []
        )
        counts = self.results["samples"]["counts"]
        note = (
            f"Every doc of both splits ({len(rows)}); the counts above are on the report split "
            f"({sum(sum(by_class.values()) for by_class in counts.values())} docs). Click a row for its prompt, gold "
            "answer and each model's answer."
        )
        return SampleList(rows, ["pre", "post", self.result.best.label], filters, "class", SAMPLES_FILE, note)


def build_report(result: SweepResult, folder: Path | None = None) -> SweepReport:
    """The report model of a finished sweep: every section built once, from one results.json document."""
    kinds = result_kinds(result)
    rows = sample_rows(result, kinds)
    results = results_json(result, rows, kinds)
    folder = Path(result.out) if folder is None else folder
    context = ReportContext(result, results, rows, pick_coefficients(result, folder))
    sections = [section for builder in SECTIONS if (section := builder(context)) is not None]
    return SweepReport(result, results, rows, headline(context), sections)


# --- sections ------------------------------------------------------------------------------------------------


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


def _with_interval(value: float, interval) -> Cell:
    return Cell(f"{value:.4f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""), value)


def _score_row(data: dict, name: str, notes: list[tuple[str, bool]], sort) -> list[Cell]:
    groups, intervals = data["forgetting"]["groups"], data["intervals"]
    difference = intervals.get("diff_to_pick")
    return [
        Cell(name, sort),
        number(data["selection"]["harmonic_mean"]),
        *[_with_interval(data[key], intervals.get(key)) for key in ("old", "new", "harmonic_mean")],
        Cell(f"[{difference[0]:+.3f}, {difference[1]:+.3f}]", difference[0]) if difference else Cell("-"),
        number(groups["old"]["F_true"]),
        number(groups["new"]["BT_true"]),
        Cell("", notes=tuple(notes)),
    ]


def score_table(results: dict) -> Table:
    """One row per model: selection HM, then report-split old/new/HM with intervals, HM - pick, forgetting."""
    pick, pareto = results["pick"], set(results["pareto"])
    rows = [_score_row(results["pre"], "pre", [("reference", False)], -1)]
    for position, point in enumerate(results["points"]):
        alpha = cell_key(point)
        notes = [("pick", False)] if alpha == cell_key(pick) else []
        notes += [("tie", False)] if alpha in pick["ties"] and alpha != cell_key(pick) else []
        notes += [("indistinguishable", False)] if alpha in pick["indistinguishable"] else []
        notes += [("beats the pick", True)] if point["label"] in results["better"] else []
        notes += [("pareto", False)] if alpha in pareto else []
        if point.get("nonfinite_logits"):
            notes += [("non-finite logits: scores meaningless, never picked", True)]
        rows.append(_score_row(point, cell_text(point), notes, position))
    rows.append(_score_row(results["post"], "post", [("reference", False)], len(results["points"])))
    columns = [
        "alpha",
        "HM (selection)",
        "old (report)",
        "new (report)",
        "harmonic mean (report)",
        "HM - pick",
        "F_true(old)",
        "BT_true(new)",
        "note",
    ]
    return Table(columns, rows, "lrrrrrrrl", key="scores")


def nonfinite_lines(results: dict) -> list[str]:
    """The models that gave NaN or infinite logits, said in a sentence under the table."""
    broken = [cell_text(point) for point in results["points"] if point["nonfinite_logits"]]
    if not broken:
        return []
    return [
        f"Non-finite logits (NaN or infinite while scoring; their scores are noise, none can be the pick): "
        f"{', '.join(broken)}."
    ]


def _capital(text: str) -> str:
    return f"{text[0].upper()}{text[1:]}"


def chosen_text(context: ReportContext) -> str:
    settings, pick = context.result.settings, context.results["pick"]
    return cell_text(pick, settings.coefficient) if settings.second else f"alpha = {pick['alpha']!r}"


def separation_text(result: SweepResult) -> str:
    """The runner-up and the report docs that would separate the pick from it (sweep.power), in words."""
    return result.separation.text(f"the runner-up ({rival_text(result)})")


def rival_text(result: SweepResult) -> str:
    """The runner-up of the pick as the report names points: `alpha 0.3`, `lambda 0.5, density 0.3` in a 2-D grid."""
    rival = next(point for point in result.points if point.label == result.separation.rival)
    shown = f"{result.settings.coefficient} {rival.alpha!r}"
    return shown + (f", {rival.second[0]} {rival.second[1]!r}" if rival.second else "")


def summary_section(context: ReportContext) -> Section:
    """The title, the settings, the definitions, the score table and the pick in words."""
    result, results = context.result, context.results
    settings, pick = result.settings, results["pick"]
    ties = ", ".join(map(repr, pick["ties"])) if len(pick["ties"]) > 1 else "none"
    same = ", ".join(map(repr, pick["indistinguishable"])) or "none"
    facts = [
        f"- pre: {model_text(settings.pre)}",
        f"- post: {model_text(settings.post)}",
        f"- alpha = {results['alpha_means']}",
        f"- old tasks: {', '.join(settings.old_tasks)}; new tasks: {', '.join(settings.new_tasks)}; "
        f"samples per task: {limit_text(settings.limit, result.splits)}; group scores: {settings.aggregation}",
        f"- lm-eval settings: {results['lm_eval']}",
        *split_lines(results),
    ]
    blocks = [
        Prose(facts),
        Prose([f"- **{name}**: {text}" for name, text in DEFINITIONS.items()], fold="Definitions"),
        score_table(results),
    ]
    if broken := nonfinite_lines(results):
        blocks.append(Prose(broken))
    blocks += [
        Prose(
            [
                f"**Pick: {chosen_text(context)}**{' (unsupported: tasks at chance, below)' if result.unsupported else ''}, chosen on the selection split (harmonic mean "
                f"{pick['selection_harmonic_mean']:.4f}); on the report split: old {pick['old']:.4f}, new "
                f"{pick['new']:.4f}, harmonic mean {pick['harmonic_mean']:.4f}. Ties: {ties}."
            ]
        ),
        Prose(
            [
                f"Indistinguishable from the pick on the report split (HM - pick interval holds 0): {same}"
                + (f"; {separation_text(result)}." if result.separation else ".")
            ]
        ),
        Prose([f"Pareto front (selection split): {', '.join(map(repr, results['pareto']))}."]),
    ]
    if result.better:
        blocks.append(Prose([f"**{_capital(result.warning_text())}**"]))
    if result.unsupported:
        blocks.append(Prose([f"**{_capital(result.chance_text())}.**"]))
    blocks.append(Prose([f"{_capital(result.outcome_text())}."]))
    return Section("summary", f"Sweep: {settings.method} between pre and post", blocks, level=1)


def headline(context: ReportContext) -> Headline:
    """The top of the page: the pick, its report-split scores with their intervals, the verdict in a sentence."""
    result, pick = context.result, context.results["pick"]
    settings, intervals = result.settings, result.best.intervals
    scores = [(name.replace("_", " "), pick[name], intervals.get(name)) for name in ("old", "new", "harmonic_mean")]
    verdict = _capital(result.outcome_text()) + "."
    facts = [
        ("pre", settings.pre),
        ("post", settings.post),
        ("method", f"{settings.method} ({context.results['alpha_means']})"),
        ("old tasks", ", ".join(settings.old_tasks)),
        ("new tasks", ", ".join(settings.new_tasks)),
        ("lm-eval", context.results["lm_eval"]),
    ]
    warnings = [_capital(result.warning_text())] if result.better else []
    warnings += [_capital(result.chance_text())] if result.unsupported else []
    title = f"Sweep: {settings.method} between pre and post"
    return Headline(title, chosen_text(context), scores, verdict, warnings, facts)


def probe_section(context: ReportContext) -> Section | None:
    """The probe table: each probed alpha's estimated selection-split scores with +- one standard error."""
    probe = context.results["probe"]
    if probe is None:
        return None
    rows = []
    for row in probe["estimates"]:
        rows.append(
            [
                Cell(repr(row["alpha"]), row["alpha"]),
                Cell(f"{row['old']:.4f} ± {row['old_se']:.4f}", row["old"]),
                Cell(f"{row['new']:.4f} ± {row['new_se']:.4f}", row["new"]),
                Cell(f"{row['harmonic_mean']:.4f} ± {row['harmonic_mean_se']:.4f}", row["harmonic_mean"]),
                Cell("pick" if row["alpha"] == probe["pick"] else ""),
            ]
        )
    columns = ["alpha", "old (est.)", "new (est.)", "harmonic mean (est.)", "note"]
    return Section(
        "probe",
        f"Probe estimates (selection split, {probe['rate']:.0%} of the samples pre and post agree on, plus every one "
        "they disagree on)",
        [
            Prose(
                [
                    f"{len(probe['estimates'])} alphas scored on {probe['samples_per_probe']} docs each, then the "
                    f"pick on all {probe['samples_per_full_point']}: {probe['sample_evaluations']} doc evaluations "
                    f"against {probe['grid_sample_evaluations']} for the full grid. Indistinguishable from the pick "
                    f"by the estimates: {', '.join(map(repr, probe['indistinguishable'])) or 'none'}"
                    + (f"; {context.result.probe.separation.text()}." if context.result.probe.separation else ".")
                ]
            ),
            Table(columns, rows, "lrrrl", key="probe"),
        ],
    )


def budget_section(context: ReportContext) -> Section | None:
    """The account of a budgeted search: each round's points, docs and estimates, the survivors."""
    budget = context.results.get("budget")
    if budget is None:
        return None
    blocks: list = [
        Prose(
            [
                f"Cost {budget['cost']:.2f} full evaluations (pre and post 1 each, a merge on every doc 1, a probe its "
                f"share of the docs); {budget['evaluations']} models evaluated in all."
            ]
        )
    ]
    title = f"Budgeted search (--budget {budget['budget']})"
    if not budget["rounds"]:
        return Section("budget", title, [*blocks, Prose([budget["note"] + "."])])
    rows = [
        [
            Cell(str(index), index),
            Cell(f"{entry['probe']:g}", entry["probe"]),
            Cell(str(entry["docs_per_point"]), entry["docs_per_point"]),
            Cell(str(len(entry["estimates"])), len(entry["estimates"])),
            Cell(", ".join(entry["kept"])),
        ]
        for index, entry in enumerate(budget["rounds"])
    ]
    columns = ["round", "probe share", "docs per point", "points", "kept (best estimated harmonic mean)"]
    blocks += [
        Prose([f"Successive halving keeping 1/{budget['keep']} each round, on the selection split:"]),
        Table(columns, rows, "rrrrl", key="budget"),
        Prose(
            [
                f"Scored on every doc ({budget['docs_per_full_point']} docs each): "
                f"{', '.join(budget['full'])}; the pick is the best of them on the selection split."
            ]
        ),
    ]
    return Section("budget", title, blocks)


def plots_section(context: ReportContext) -> Section:
    return Section("plots", None, [Plot(PLOT_FILE, "sweep"), Plot(MAP_FILE, "forgetting map")])


def forgetting_section(key: str, title: str, point: PointResult) -> Section:
    groups = [point.groups[group] for group in ("old", "new")]
    return Section(key, title, [forgetting_table(point.forgetting, key), forgetting_table(groups, f"{key}-groups")])


def post_map_section(context: ReportContext) -> Section:
    return forgetting_section("map-post", "Forgetting map (report split): pre -> post", context.result.post)


def pick_map_section(context: ReportContext) -> Section:
    title = f"Forgetting map (report split): pre -> merge at {chosen_text(context)}"
    return forgetting_section("map-pick", title, context.result.best)


def layers_section(context: ReportContext) -> Section | None:
    """RECALL methods only: post's coefficient per layer at the pick (layers.png); None for the other methods."""
    coefficients = context.coefficients
    if coefficients is None:
        return None
    labels = layer_labels(coefficients)
    values = ", ".join(f"{label}: {value:.3f}" for label, value in zip(labels, coefficients, strict=True))
    return Section(
        "layers",
        "Per-layer coefficients of the pick",
        [
            Prose([f"Weight of post per layer at alpha = {context.result.best.alpha!r} ({values})."]),
            Plot(LAYERS_PLOT_FILE, "layers"),
        ],
    )


def layer_labels(coefficients: list[float]) -> list[str]:
    return ["embed"] + [str(layer) for layer in range(len(coefficients) - 1)]


def drift_section(context: ReportContext) -> Section | None:
    """Post's drift per layer (evaluate.drift), beside recall_lerp's weight of post at the pick when that is the
    method (embeddings, each layer, the head following the last layer)."""
    result = context.result
    report = result.drift
    if report is None:
        return None
    method = methods.method(result.settings.method)
    interpolated = method.reads_recall_weights and method.interpolates  # recall_lerp's weights per layer
    coefficients = context.coefficients if interpolated else None

    def drift_cell(value):
        return Cell("-" if value is None else f"{value:.4g}", value)

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
    cells = [
        [Cell(name, position), drift_cell(drift), *([number(coefficients[index], ".3f")] if shown else [])]
        for position, (name, drift, index) in enumerate(rows)
    ]
    total = "-" if report.total is None else f"{report.total:.4g}"
    text = (
        "Post's relative drift `||post - pre|| / ||pre||` over each layer's weights (Frobenius; "
        f"`mergekit-lite drift` gives every tensor); whole model {total}."
        + (
            " Beside it, the pick's weight of post per layer (recall_lerp sets it from its own per-layer drift "
            " measure, on --recall-texts): are the layers that moved most the ones the merge took least of?"
            if shown
            else ""
        )
    )
    return Section(
        "drift",
        "Where post moved: relative drift per layer",
        [Prose([text]), Table(header, cells, "l" + "r" * (len(header) - 1), key="drift")],
    )


SECTIONS: list[Callable[[ReportContext], Section | None]] = [
    summary_section,
    probe_section,
    lambda context: grid_section(context.results),
    budget_section,
    lambda context: vector_section(context.results),
    plots_section,
    post_map_section,
    pick_map_section,
    lambda context: samples_section(context.results["samples"]),
    lambda context: realign_section(context.results["realign"]) if "realign" in context.results else None,
    layers_section,
    drift_section,
]
