"""How a sweep chooses which points to evaluate: one strategy per search mode behind one small interface, so the
sweep itself (`run.run_sweep`) reads as: prepare, search, build the result, report, save.

A strategy gets the sweep in progress (`SweepRun`: the settings, the grid's cells, the run folder, the points
saved so far and the two ways of scoring a merge: on every doc, or on probe docs) and returns what it searched
(`Searched`: the points to build the result from, and its trace for the report). The modes:

- `FullGrid`: every cell, one after another here;
- `RayGrid`: every cell not saved yet, on Ray actors (sweep.distributed);
- `Golden`: a golden-section search along alpha in each row (sweep.adaptive);
- `Probe`: each row's alphas on probe docs, the row's best estimate on every doc (sweep.adaptive);
- `Budget`: successive halving over every cell on probe docs, the survivors on every doc (sweep.budget).

`strategy_for` picks one from the settings; the per-layer-group search (sweep.vector) wraps one of them: the scalar
pick it finds is the baseline every vector is judged against.
"""

from __future__ import annotations

from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mergekit_lite import interrupts
from mergekit_lite.sweep import grid
from mergekit_lite.sweep.evaluator import PointEvaluator, evaluate_point
from mergekit_lite.sweep.result import ProbeTrace
from mergekit_lite.sweep.scoring import TaskRun
from mergekit_lite.sweep.search import SearchTrace
from mergekit_lite.sweep.settings import SweepSettings
from mergekit_lite.sweep.store import load_points, point_label

Plan = list[tuple[str, float | None]]  # (label, alpha) per point; alpha None for pre and post


@dataclass
class SweepRun:
    """A sweep in progress: what every strategy reads (settings, rows, cells, saved points) and the ways it scores
    a model. `evaluate(label, alpha)` scores a point on every doc and saves it (a saved one is not scored again);
    `probe(label, alpha, samples)` scores a merge on {group: {task: doc ids}} only."""

    settings: SweepSettings
    rows: list[SweepSettings]
    found: dict[str, grid.Cell]  # label -> cell, row by row
    folder: Path
    runs: dict[str, list[TaskRun]]  # label -> saved point (pre and post among them once scored)
    bar: object = None  # tqdm, set by the sweep
    opened: ExitStack | None = None  # where the evaluator is closed
    evaluated: list[str] = field(default_factory=list)  # labels scored by this call
    evaluator: PointEvaluator | None = None

    @property
    def plan(self) -> Plan:
        """pre, post and every cell, in order."""
        return [("pre", None), ("post", None)] + [(label, cell.alpha) for label, cell in self.found.items()]

    @property
    def n_tasks(self) -> int:
        return len(self.settings.old_tasks) + len(self.settings.new_tasks)

    def point_evaluator(self) -> PointEvaluator:
        """The evaluator, built on first use (a resumed sweep with every point saved loads no model)."""
        interrupts.check()
        if self.evaluator is None:
            self.evaluator = self.opened.enter_context(closing(PointEvaluator(self.rows[0], self.folder, self.bar)))
        return self.evaluator

    def evaluate(self, label: str, alpha: float | None) -> None:
        if label in self.runs:
            return
        point = self.point_evaluator()
        self.bar.set_postfix_str(label)
        cell = self.found.get(label)
        self.runs[label] = evaluate_point(
            point, cell.row if cell else self.settings, label, alpha, cell and cell.config()
        )
        self.evaluated.append(label)

    def probe(self, label: str, alpha: float, samples: dict) -> list[TaskRun]:
        point = self.point_evaluator()
        self.bar.set_postfix_str(f"{label} (probe)")
        return point.merged(self.found[label].config(), samples)

    def endpoints(self) -> Plan:
        """pre and post, scored on every doc when not saved."""
        plan = self.plan[:2]
        for label, alpha in plan:
            self.evaluate(label, alpha)
        return plan


@dataclass
class Searched:
    """What a strategy evaluated: the points the result is built from (those saved), and its trace."""

    plan: Plan
    search: SearchTrace | None = None  # the last row's golden search (a 1-D sweep's only one)
    probed: ProbeTrace | None = None  # the last row's probe mode
    traces: list[dict] = field(default_factory=list)  # each row's golden search or probe mode (2-D grids)
    budget: dict | None = None  # --budget's rounds
    vector: dict | None = None  # the per-group search's trials, pick and comparison (sweep.vector)

    def annotate(self, result) -> None:
        """Put the trace where the report reads it: a 1-D sweep's search and probe, a 2-D grid's rows."""
        if result.settings.second is None:
            result.search, result.probe = self.search, self.probed
        else:
            result.rows = self.traces or None
        result.budget = self.budget


class SearchStrategy(Protocol):
    """One search mode: how many points the progress bar counts, and the search itself."""

    def bar_points(self, sweep: SweepRun) -> int: ...

    def run(self, sweep: SweepRun) -> Searched: ...


class FullGrid:
    """Every cell on every doc, one after another."""

    def bar_points(self, sweep: SweepRun) -> int:
        return len(sweep.plan)

    def run(self, sweep: SweepRun) -> Searched:
        plan = sweep.plan
        for label, alpha in plan:
            sweep.evaluate(label, alpha)
        return Searched(plan)


class RayGrid(FullGrid):
    """Every cell not saved yet on Ray actors; each row saves its points under its own cell identity."""

    def run(self, sweep: SweepRun) -> Searched:
        from mergekit_lite.sweep.distributed import run_points_on_ray

        settings, found = sweep.settings, sweep.found
        todo = [(label, alpha) for label, alpha in sweep.plan if label not in sweep.runs]
        for index, row in enumerate(sweep.rows):
            points = [
                (label, alpha, None if alpha is None else found[label].config().to_dict())
                for label, alpha in todo
                if (index == 0 if alpha is None else found[label].row is row)
            ]
            for _ in run_points_on_ray(row, points, settings.ray) if points else ():
                sweep.bar.update(sweep.n_tasks)
        sweep.runs.update(load_points(sweep.folder, settings.identity()))
        sweep.evaluated.extend(label for label, _ in todo)
        return Searched(sweep.plan)


class Golden(FullGrid):
    """A golden-section search along alpha in each row; the bar is resized to the points it visited. The result
    holds every saved cell (a point an earlier full grid saved in this run folder counts too)."""

    def run(self, sweep: SweepRun) -> Searched:
        from mergekit_lite.sweep.adaptive import golden_search

        sweep.endpoints()
        searched = Searched(sweep.plan)
        for row in sweep.rows:
            searched.search = golden_search(row, sweep.runs, sweep.evaluate)
            searched.traces.append(grid.row_trace(row, searched.search, None))
        sweep.bar.total = (sum(len(trace["evaluated"]) for trace in searched.traces) + 2) * sweep.n_tasks
        sweep.bar.refresh()
        return searched


class Probe:
    """Each row's alphas on probe docs; the row's best estimate scored on every doc."""

    def bar_points(self, sweep: SweepRun) -> int:
        return len(sweep.plan) + len(sweep.rows)  # every alpha, then each row's pick

    def run(self, sweep: SweepRun) -> Searched:
        from mergekit_lite.sweep.adaptive import run_probes

        searched = Searched(sweep.endpoints())
        for row in sweep.rows:
            searched.probed, searched.search = run_probes(row, sweep.folder, sweep.runs, sweep.probe)
            label = point_label(row, searched.probed.pick)
            sweep.evaluate(label, searched.probed.pick)
            searched.plan.append((label, searched.probed.pick))
            searched.traces.append(grid.row_trace(row, searched.search, searched.probed))
        return searched


class Budget(FullGrid):
    """--budget: successive halving on probe docs, the survivors on every doc."""

    def run(self, sweep: SweepRun) -> Searched:
        from mergekit_lite.sweep.budget import run_budget

        plan = sweep.endpoints()
        budget = run_budget(sweep.settings, sweep.found, sweep.folder, sweep.runs, sweep.probe, sweep.evaluate)
        return Searched(plan + [(label, sweep.found[label].alpha) for label in budget["full"]], budget=budget)


def strategy_for(settings: SweepSettings, resuming_everything: bool = False) -> SearchStrategy:
    """The scalar search the settings ask for (Ray only while some point is left to evaluate: a resumed sweep with
    every point saved runs here)."""
    if settings.ray is not None and not resuming_everything:
        return RayGrid()
    if settings.budget is not None:
        return Budget()
    if settings.probe is not None:
        return Probe()
    return Golden() if settings.search == "golden" else FullGrid()
