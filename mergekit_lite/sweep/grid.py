"""2-D sweeps: alpha (the method's main coefficient) against a second one, LiNeS's beta (`--betas`), TIES's
density (`--densities`) or DARE's drop (`--drops`). [ours]

A 2-D grid is a stack of rows, one 1-D sweep per value of the second coefficient (`rows`), all in one run
folder: a cell is an ordinary point whose label names both coefficients (`alpha=0.5,density=0.3`), so it is
stored, resumed and run on Ray like any point; a 1-D sweep is the one row with today's labels. The rule for
the searches that skip points:

- full grid: every cell is evaluated; the pick is the best selection-split harmonic mean over all cells
  (ties to the smallest second value, then the smallest alpha), exactly the 1-D rule over more points.
- `--search golden`: a golden-section search along alpha in each row (alpha is the coefficient whose harmonic
  mean rises and falls: the search's unimodality assumption; the second coefficient need not be unimodal);
  the pick is the best of the evaluated cells.
- `--probe`: each row's alphas are scored on probe docs and the row's best estimate is scored on every doc;
  the pick is the best of those row picks on the selection split.
- `--budget N`: successive halving over every cell at once (sweep.budget).

The report shows the report-split harmonic mean of every evaluated cell as a heat map (sweep.png) and a table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from mergekit_lite.io.report_page import Cell as TableCell
from mergekit_lite.io.report_page import Prose, Section, Table
from mergekit_lite.merge.config import MergeConfig
from mergekit_lite.sweep.models import MergeConfigs
from mergekit_lite.sweep.result import ProbeTrace, SweepResult
from mergekit_lite.sweep.search import SearchTrace
from mergekit_lite.sweep.settings import SECOND_AXES, SweepSettings
from mergekit_lite.sweep.store import point_label

SECONDS = tuple(SECOND_AXES.values())
RULE = (
    "full grid: every cell; golden: a golden-section search along alpha in each row of the second "
    "coefficient; probe: each row's alphas on probe docs, the row's best estimate on every doc; budget: "
    "successive halving over all cells on probe docs, the survivors on every doc. The pick is the best "
    "selection-split harmonic mean among the cells evaluated on every doc."
)


@dataclass
class Cell:
    """One point of the grid: its row (a 1-D sweep at one value of the second coefficient) and its alpha."""

    row: SweepSettings
    alpha: float
    configs: MergeConfigs

    def config(self) -> MergeConfig:
        return self.configs(self.alpha)


def rows(settings: SweepSettings) -> list[SweepSettings]:
    """One 1-D sweep per value of the second coefficient, in increasing order; [settings] for a 1-D sweep."""
    values = settings.second_values()
    return [settings] if values is None else [replace(settings, **{settings.second: value}) for value in values]


def cells(grid: list[SweepSettings], folder: Path) -> dict[str, Cell]:
    """Every cell by label, row by row (the second coefficient's values), alphas in order within a row."""
    found = {}
    for row in grid:
        configs = MergeConfigs(row, folder)
        found.update({point_label(row, alpha): Cell(row, alpha, configs) for alpha in row.alphas})
    return found


def seconds(found: dict[str, Cell]) -> dict[str, tuple[str, float]]:
    """label -> (second coefficient, value) of a 2-D grid's cells; empty for a 1-D sweep."""
    return {
        label: (cell.row.second, getattr(cell.row, cell.row.second))
        for label, cell in found.items()
        if cell.row.second is not None
    }


def row_trace(row: SweepSettings, search: SearchTrace | None, probed: ProbeTrace | None) -> dict:
    """What one row's golden search or probe mode did, for results.json."""
    trace = {} if row.second is None else {row.second: getattr(row, row.second)}
    if search is not None:
        trace.update(evaluated=[row.alphas[index] for index in search.evaluated], stopped=search.reason)
    if probed is not None:
        trace.update(
            probed=list(probed.estimates),
            probe_pick=probed.pick,
            probe_estimates={repr(alpha): estimate.harmonic_mean for alpha, estimate in probed.estimates.items()},
        )
    return trace


def cell_text(point: dict, coefficient: str = "alpha") -> str:
    """A point of a results dict in words: `0.5`, or `lambda 0.5, density 0.3` in a 2-D grid."""
    second = next(((name, point[name]) for name in SECONDS if name in point), None)
    return repr(point["alpha"]) if second is None else f"{coefficient} {point['alpha']!r}, {second[0]} {second[1]!r}"


def cell_key(point: dict):
    """What names a point of a results dict in the pick's ties and the Pareto front (PointResult.key)."""
    second = next((point[name] for name in SECONDS if name in point), None)
    return point["alpha"] if second is None else (point["alpha"], second)


def grid_json(result: SweepResult) -> dict | None:
    """The 2-D grid in results.json: both coefficients' values, every evaluated cell's scores, the rule, each
    row's search; None for a 1-D sweep."""
    settings = result.settings
    if settings.second is None:
        return None
    return {
        "coefficients": [settings.coefficient, settings.second],
        "alphas": settings.alphas,
        "values": settings.second_values(),
        "rule": RULE,
        "rows": result.rows,
        "cells": [
            {
                settings.coefficient: point.alpha,
                settings.second: point.second[1],
                "old": point.old,
                "new": point.new,
                "harmonic_mean": point.harmonic_mean,
                "selection_harmonic_mean": point.selection.harmonic_mean,
            }
            for point in result.points
        ],
        "pick": {settings.coefficient: result.best.alpha, settings.second: result.best.second[1]},
    }


def grid_section(results: dict) -> Section | None:
    """The report's grid table: the report-split harmonic mean of every evaluated cell (selection-split in
    brackets), rows the second coefficient, columns alpha, the pick in bold; None for a 1-D sweep."""
    grid = results.get("grid")
    if grid is None:
        return None
    alpha_name, second = grid["coefficients"]
    scores = {(cell[alpha_name], cell[second]): cell for cell in grid["cells"]}
    pick = (grid["pick"][alpha_name], grid["pick"][second])
    rows = []
    for value in grid["values"]:
        row = [TableCell(repr(value), value)]
        for alpha in grid["alphas"]:
            cell = scores.get((alpha, value))
            text = "-" if cell is None else f"{cell['harmonic_mean']:.3f} ({cell['selection_harmonic_mean']:.3f})"
            row.append(TableCell(text, None if cell is None else cell["harmonic_mean"], strong=(alpha, value) == pick))
        rows.append(row)
    columns = [f"{second} \\ alpha", *map(repr, grid["alphas"])]
    return Section(
        "grid",
        f"Grid: harmonic mean over {alpha_name} (alpha) x {second}",
        [
            Prose([f"Report split (selection split in brackets); `-`: not evaluated on every doc. {grid['rule']}"]),
            Table(columns, rows, "l" + "r" * len(grid["alphas"]), key="grid"),
        ],
    )


def plot_heatmap(result: SweepResult, path: Path, new_figure) -> None:
    """The report-split harmonic mean over the grid (alpha across, the second coefficient up), each evaluated
    cell labelled, the cells not evaluated blank, the pick outlined; `new_figure(size)` makes the figure."""
    import numpy as np

    settings = result.settings
    alphas, values = settings.alphas, settings.second_values()
    matrix = np.full((len(values), len(alphas)), np.nan)
    for point in result.points:
        matrix[values.index(point.second[1]), alphas.index(point.alpha)] = point.harmonic_mean
    figure = new_figure((1.6 + 0.7 * len(alphas), 1.4 + 0.5 * len(values)))
    axes = figure.add_subplot()
    image = axes.imshow(np.ma.masked_invalid(matrix), origin="lower", aspect="auto", cmap="viridis", vmin=0, vmax=1)
    for (row, column), value in np.ndenumerate(matrix):
        if not np.isnan(value):
            axes.text(
                column,
                row,
                f"{value:.2f}",
                ha="center",
                va="center",
                fontsize=7,
                color="black" if value > 0.6 else "white",
            )
    best = result.best
    axes.add_patch(_pick_box(alphas.index(best.alpha), values.index(best.second[1])))
    axes.set_xticks(range(len(alphas)), [f"{alpha:g}" for alpha in alphas], fontsize=7)
    axes.set_yticks(range(len(values)), [f"{value:g}" for value in values], fontsize=7)
    axes.set_xlabel(f"alpha ({settings.coefficient} of {settings.method})")
    axes.set_ylabel(settings.second)
    axes.set_title(
        f"harmonic mean (report split)\nbox: pick ({settings.coefficient} {best.alpha:g}, "
        f"{settings.second} {best.second[1]:g})",
        fontsize=8,
    )
    figure.colorbar(image, ax=axes, shrink=0.8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _pick_box(column: int, row: int):
    from matplotlib.patches import Rectangle

    return Rectangle((column - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5)
