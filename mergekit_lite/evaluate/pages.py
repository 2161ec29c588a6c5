"""`forgetting --html` and `drift --html`: the forgetting map of two models, the map along a training run, the
forgetting matrix, a prediction from its history and a model's drift, as report pages (io/report_page): the tables
the command prints, the plots it draws, and every sample row (`--samples`'s lines) to browse. Rendered from the
same rows the command prints and writes, so the page and the output agree."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from mergekit_lite.evaluate.forgetting import GROUP_COLUMNS, TASK_COLUMNS, GroupForgetting, TaskForgetting, format_table
from mergekit_lite.evaluate.forgetting import _cell as map_cell
from mergekit_lite.io.report_page import Cell, Headline, Plot, Prose, SampleList, Section, Table, number, render_html

HEATMAP_FILE = "heatmap.png"


def forgetting_table(
    rows: Sequence[TaskForgetting | GroupForgetting], key: str, checkpoints: Sequence[str] | None = None
) -> Table:
    """Forgetting rows (per task or group) as a table, cells as format_table prints them (its padded text is the
    Markdown); `checkpoints` adds the column naming each row's checkpoint."""
    columns = GROUP_COLUMNS if rows and isinstance(rows[0], GroupForgetting) else TASK_COLUMNS
    cells = [
        [
            Cell(map_cell(column, value), value if isinstance(value, int | float) and not math.isinf(value) else None)
            for column in columns
            for value in [getattr(row, column)]
        ]
        for row in rows
    ]
    names = list(columns)
    if checkpoints is not None:
        names = ["checkpoint", *names]
        cells = [
            [Cell(label, position), *line]
            for position, (label, line) in enumerate(zip(checkpoints, cells, strict=True))
        ]
    align = "l" * (1 + (checkpoints is not None)) + "r" * len(columns[1:])
    return Table(names, cells, align, format_table(rows, checkpoints=checkpoints), key=key)


def _drawn(draw: Callable[[Path], None]) -> dict[str, Path]:
    """A plot drawn into a temporary file, for the page to inline."""
    folder = Path(tempfile.mkdtemp(prefix="mergekit-lite-page-"))
    draw(folder / HEATMAP_FILE)
    return {HEATMAP_FILE: folder / HEATMAP_FILE}


def _page(headline: Headline, sections: list[Section], samples=None, plots=None) -> str:
    try:
        return render_html(headline, sections, None, samples, plots)
    finally:
        for path in (plots or {}).values():
            path.unlink(missing_ok=True)
            os.rmdir(path.parent)


def _worst(rows, name_of, metric: str) -> tuple[str, float] | None:
    found = [(name_of(row), getattr(row, metric)) for row in rows]
    return max(found, key=lambda item: item[1]) if found else None


def map_verdict(tasks, groups, who: str) -> str:
    """One sentence: where the map forgets most and gains most (chance-corrected)."""
    rows, name_of = (groups, lambda row: row.group) if groups else (tasks, lambda row: row.task)
    forgot, gained = _worst(rows, name_of, "F_true"), _worst(rows, name_of, "BT_true")
    if forgot is None:
        return f"{who}: nothing compared."
    return (
        f"{who} forgets most on {forgot[0]} (F_true {forgot[1]:.3f}) and gains most on {gained[0]} "
        f"(BT_true {gained[1]:.3f}), chance-corrected."
    )


def _scores(rows, name_of) -> list[tuple[str, float, None]]:
    return [
        (f"{name_of(row)} {metric}", getattr(row, metric), None) for row in rows for metric in ("F_true", "BT_true")
    ]


def forgetting_page(series, group_rows, crossed: list[dict], split=None) -> str:
    """The two-model map or the map along a training run (checkpoint i against checkpoint 0), its heat map, the
    realigned split, the alerts, and every compared sample."""
    from mergekit_lite.evaluate.trajectory import plot_heatmap, sample_rows

    two_models = len(series.labels) == 2
    last, last_groups = series.maps[-1], group_rows[-1]
    rows = sample_rows(series)
    labels = [str(position) for position in range(1, len(series.labels))]
    task_rows = [
        (label, row) for label, result in zip(labels, series.maps, strict=True) for row in result.rows.values()
    ]
    group_cells = [(label, row) for label, groups in zip(labels, group_rows, strict=True) for row in groups]
    checkpoints = None if two_models else [label for label, _ in task_rows]
    blocks = [forgetting_table([row for _, row in task_rows], "tasks", checkpoints)]
    if group_cells:
        group_labels = None if two_models else [label for label, _ in group_cells]
        blocks.append(forgetting_table([row for _, row in group_cells], "groups", group_labels))
    sections = [Section("map", "Forgetting map" if two_models else "Forgetting along the run", blocks)]
    if split is not None:
        from mergekit_lite.evaluate.spurious import SPLIT_COLUMNS, format_split_table

        parts = [*split.rows.values(), *split.groups.values()]
        cells = [
            [Cell(row.name)] + [number(getattr(row, column), ".3f") for column in SPLIT_COLUMNS[1:]] for row in parts
        ]
        table = Table(list(SPLIT_COLUMNS), cells, "l" + "r" * 6, format_split_table(parts), key="realigned")
        sections.append(Section("realigned", "Spurious or genuine forgetting (--realigned)", [table]))
    skipped = [
        f"- checkpoint {position}: {task} ({reason})"
        for position, result in enumerate(series.maps, start=1)
        for task, reason in result.skipped.items()
    ]
    if skipped:
        sections.append(Section("skipped", "Skipped tasks", [Prose(skipped)]))
    sections.append(
        Section(
            "checkpoints",
            "Models",
            [
                Prose([f"- {position}: `{label}`" for position, label in enumerate(series.labels)]),
                Plot(HEATMAP_FILE, "F_true and BT_true"),
            ],
        )
    )
    who = "post" if two_models else f"checkpoint {len(series.labels) - 1}"
    name_of = (lambda row: row.group) if last_groups else (lambda row: row.task)
    shown = last_groups or list(last.rows.values())
    headline = Headline(
        "Forgetting: pre -> post" if two_models else f"Forgetting along {len(series.labels)} checkpoints",
        f"{series.labels[-1]} against {series.labels[0]}",
        _scores(shown[:4], name_of),
        map_verdict(list(last.rows.values()), last_groups, who),
        [
            f"alert: checkpoint {alert['checkpoint']}: {alert['group']} {alert['metric']} = {alert['value']:.3f} "
            f"crosses {alert['alert']}"
            for alert in crossed
        ],
        [(str(position), label) for position, label in enumerate(series.labels)],
    )
    headline.pick_label = "compared"
    models = ["pre", "post"] if two_models else [f"checkpoint {i}" for i in range(len(series.labels))]
    filters = ["outcome", "task", "seed"] + (["forgetting_kind"] if split is not None else [])
    if not two_models:
        filters.append("first_forgotten")
    samples = SampleList(rows, models, filters, "outcome", note="Every compared (task, doc, seed); click a row.")
    if split is not None:  # forgotten rows carry their kind, as --samples writes them
        for row in rows:
            if row["outcome"] == "forgotten":
                doc = row["doc_id"] if row["doc_id"] is not None else row["doc_hash"]
                row["forgetting_kind"] = split.map.kind(row["task"], row["seed"], doc)
    plots = _drawn(lambda path: plot_heatmap(series, group_rows, path))
    return _page(headline, sections, samples, plots)


def history_page(report: dict, rows: list[dict], method: str) -> str:
    """`--history`: the prediction's counts, and every doc with its observed or predicted score."""
    binary = "F_predicted" in report
    facts = [(name.replace("_", " "), str(value)) for name, value in report.items() if not isinstance(value, dict)]
    if binary:
        verdict = (
            f"{report['observed_forgotten']} docs observed forgotten, {report['expected_forgotten']:.1f} expected "
            f"among the predicted; predicted F = {report['F_predicted']:.4f} of {report['docs']} docs."
        )
        scores = [("predicted F", report["F_predicted"], None)]
    else:
        observed, predicted = report["observed_mean_drop"], report["predicted_mean_drop"]
        verdict = f"Mean log-likelihood drop: observed {observed}, predicted {predicted}."
        scores = [
            (name, value, None)
            for name, value in (("observed drop", observed), ("predicted drop", predicted))
            if value is not None
        ]
    table = Table(
        ["quantity", "value"],
        [[Cell(name), Cell(value)] for name, value in facts],
        "lr",
        key="prediction",
    )
    for row in rows:
        row["kind"] = "predicted" if row["predicted"] else "observed"
        row["scores"] = [int(row["pre_correct"])]
        row["answers"] = [None]
    headline = Headline("Forgetting predicted from a history", f"predicted by {method}", scores, verdict)
    headline.pick_label = "new fine-tune"
    samples = SampleList(rows, ["pre"], ["kind", "task", "pre_correct"], "kind", note="Every doc of the history.")
    return _page(headline, [Section("prediction", "Prediction", [table])], samples)


def matrix_page(payload: dict, folder: Path) -> str:
    """`--matrix`: R^2 by rank, the completion tables, and the matrix's plots (from the folder just written)."""
    r2 = payload["r2_by_rank"]
    blocks = [
        Table(
            ["rank", "R^2"],
            [[Cell(str(rank), rank), number(value, ".3f")] for rank, value in enumerate(r2, start=1)],
            "rr",
            key="r2",
        )
    ]
    for table in payload["completion"]:
        metrics = ["f1", "precision", "recall", "auc"] if table["metric"] == "f1" else ["rmse"]
        cells = [
            [Cell(name + (" (best)" if name == table["best"] else ""), strong=name == table["best"])]
            + [number(values.get(metric), ".3f") for metric in metrics]
            for name, values in table["methods"].items()
        ]
        caption = (
            f"leave one of {table['held_out_rows']} fine-tunes out, {table['known']} docs observed "
            f"(seed {table['seed']})"
        )
        blocks.append(Table(["method", *metrics], cells, "l" + "r" * len(metrics), caption=caption, key="completion"))
    plots = {name: folder / name for name in ("matrix.png", "rank.png")}
    sections = [
        Section("matrix", "Forgetting matrix", blocks + [Plot(name, name) for name in plots]),
        Section("rows", "Fine-tunes", [Prose([f"- `{row}`" for row in payload["rows"]])]),
    ]
    docs = payload["docs"]
    verdict = (
        f"{len(payload['rows'])} fine-tunes x {docs['count']} docs ({docs['forgettable']} can be forgotten); rank 1 "
        f"explains R^2 = {r2[0]:.3f}" + (f", rank {min(5, len(r2))} {r2[min(5, len(r2)) - 1]:.3f}." if r2 else ".")
    )
    headline = Headline("Forgetting matrix", payload["value"], [("mean", payload["mean"], None)], verdict)
    headline.pick_label = "value"
    return render_html(headline, sections, None, None, plots)


def drift_page(report, heatmap: Callable[[Path], None]) -> str:
    """`drift --html`: the drift table (layers by module type, CKA when measured) and its heat map."""
    from mergekit_lite.evaluate.drift import OUTSIDE, format_drift_table, group_drift

    columns = report.module_columns()
    with_cka = any(row.cka is not None for row in report.layers)
    rows = [
        [Cell(str(row.layer), row.layer), number(row.relative_drift)]
        + [number(row.modules.get(column)) if column in row.modules else Cell("") for column in columns]
        + ([number(row.cka)] if with_cka else [])
        for row in report.layers
    ]
    if report.outside:
        outside = group_drift([t for t in report.tensors if t.layer is None])
        rows.append(
            [Cell(OUTSIDE, math.inf), number(outside)]
            + [number(report.outside.get(column)) if column in report.outside else Cell("") for column in columns]
            + ([Cell("")] if with_cka else [])
        )
    header = ["layer", "all", *columns, *(["cka"] if with_cka else [])]
    table = Table(header, rows, "l" + "r" * (len(header) - 1), format_drift_table(report), key="drift")
    layers = [row for row in report.layers if row.relative_drift is not None]
    most = max(layers, key=lambda row: row.relative_drift) if layers else None
    total = "-" if report.total is None else f"{report.total:.4f}"
    verdict = f"Whole model {total}" + (
        f"; layer {most.layer} moved most ({most.relative_drift:.4f})." if most else "."
    )
    headline = Headline(
        "Drift: where post moved",
        f"{report.post} against {report.pre}",
        [("relative drift", report.total, None)] if report.total is not None else [],
        verdict,
        facts=[("pre", report.pre), ("post", report.post)],
    )
    headline.pick_label = "compared"
    sections = [Section("drift", "Relative drift ||post - pre|| / ||pre||", [table, Plot(HEATMAP_FILE, "drift")])]
    return _page(headline, sections, None, _drawn(heatmap))
