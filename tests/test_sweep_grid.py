"""2-D sweeps (alpha x beta / density / drop) and the budgeted search (--budget): every cell a point of its own,
the pick over every cell, a resident 2-D grid equal to streamed 1-D sweeps at each second value, the budget
counted from the files the run wrote, and a report for every method a sweep accepts."""

import copy
import itertools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mergekit_lite.errors import InputError
from mergekit_lite.merge.methods import SWEEPABLE
from mergekit_lite.sweep import SweepSettings, method_settings, run_comparison, run_sweep
from mergekit_lite.sweep.budget import halving_plan
from mergekit_lite.sweep.report import report_markdown, results_json
from mergekit_lite.sweep.settings import IDENTITY_FIELDS
from mergekit_lite.sweep.store import POINTS_DIR, PROBES_DIR, alpha_label, point_label

pytestmark = pytest.mark.slow

ALPHAS = [0.0, 0.5, 1.0]
DENSITIES = [0.3, 0.9]
CLI = str(Path(sys.executable).parent / "mergekit-lite")


def settings_for(pair, out, **changes) -> SweepSettings:
    options = {"limit": None, "method": "ties", "alphas": ALPHAS, **changes}
    return SweepSettings(
        pair.pre_dir,
        pair.post_dir,
        options.pop("method"),
        options.pop("alphas"),
        pair.old_tasks,
        pair.new_tasks,
        pair.task_dir,
        str(out),
        **options,
    )


@pytest.fixture(scope="module")
def ties_grid(toy_pair, tmp_path_factory):
    """TIES lambda x density, every cell evaluated (the model resident: the task vector is rebuilt per density)."""
    return run_sweep(settings_for(toy_pair, tmp_path_factory.mktemp("grid") / "run", densities=DENSITIES))


def test_a_one_dimensional_sweep_keeps_its_labels_and_identity(toy_pair, tmp_path):
    settings = settings_for(toy_pair, tmp_path / "run", density=0.5)
    assert settings.second is None and point_label(settings, 0.5) == alpha_label(0.5) == "alpha=0.5"
    assert set(settings.identity()) == {*IDENTITY_FIELDS, "pre_content", "post_content"}
    assert settings.cell_identity() == settings.identity()
    grid = settings_for(toy_pair, tmp_path / "run", densities="0.3,0.9")
    assert grid.second == "density" and grid.densities == DENSITIES
    identity = grid.identity()
    assert identity["grid"] == "density" and "density" not in identity
    row = replace(grid, density=0.3)
    assert point_label(row, 0.5) == "alpha=0.5,density=0.3" and row.cell_identity()["density"] == 0.3


def test_bad_grids_fail_before_any_model_is_read(toy_pair, tmp_path):
    with pytest.raises(InputError, match="one second coefficient at a time"):
        settings_for(toy_pair, tmp_path, method="dare_ties", densities="0.3", drops="0.1")
    with pytest.raises(InputError, match="'linear' has no beta"):
        settings_for(toy_pair, tmp_path, method="linear", betas="0,0.5")
    with pytest.raises(InputError, match="densities: 'x' is not a number"):
        settings_for(toy_pair, tmp_path, densities="x")
    with pytest.raises(InputError, match="density"):  # out of the parameter's range, for one cell
        settings_for(toy_pair, tmp_path, densities="0.5,1.5")
    with pytest.raises(InputError, match="budget must be a whole number >= 3"):
        settings_for(toy_pair, tmp_path, budget=2)
    with pytest.raises(InputError, match="without --search golden"):
        settings_for(toy_pair, tmp_path, budget=5, search="golden")
    with pytest.raises(InputError, match="at most 500"):
        settings_for(toy_pair, tmp_path, alphas="0:1:0.01", densities="0.1:1:0.1")


def test_every_cell_is_a_point_and_the_pick_is_the_best_cell(ties_grid):
    out = ties_grid.out
    labels = sorted(path.stem for path in (out / POINTS_DIR).glob("*.json"))
    cells = [f"alpha_{alpha!r},density_{density!r}" for density in DENSITIES for alpha in ALPHAS]
    assert labels == sorted(["pre", "post", *cells])
    saved = json.loads((out / POINTS_DIR / f"{cells[-1]}.json").read_text())
    assert saved["identity"]["density"] == 0.9 and saved["identity"]["grid"] == "density"
    assert len(ties_grid.points) == len(cells)
    best = max(ties_grid.points, key=lambda point: point.selection.harmonic_mean)
    assert ties_grid.best.selection.harmonic_mean == best.selection.harmonic_mean
    assert ties_grid.best.key == (ties_grid.best.alpha, ties_grid.best.second[1])
    data = json.loads((out / "results.json").read_text())
    grid = data["grid"]
    assert grid["coefficients"] == ["lambda", "density"] and grid["values"] == DENSITIES
    assert len(grid["cells"]) == len(cells) and all({"lambda", "density"} <= set(cell) for cell in grid["cells"])
    assert grid["pick"] == {"lambda": ties_grid.best.alpha, "density": ties_grid.best.second[1]}
    assert data["pick"]["density"] == ties_grid.best.second[1]
    assert all("density" in point for point in data["points"])
    report = (out / "report.md").read_text()
    assert "## Grid: harmonic mean over lambda (alpha) x density" in report
    assert f"**Pick: lambda {ties_grid.best.alpha!r}, density {ties_grid.best.second[1]!r}**" in report
    assert report.count("**") >= 4 and (out / "sweep.png").stat().st_size > 0
    rival = next(point for point in ties_grid.points if point.label == ties_grid.separation.rival)  # sweep.power
    assert f"the runner-up (lambda {rival.alpha!r}, density {rival.second[1]!r})" in report
    assert data["pick"]["docs_to_separate"] == ties_grid.separation.to_json()


def test_the_resident_grid_equals_streamed_one_dimensional_sweeps(toy_pair, ties_grid, tmp_path):
    """Each row of the grid (the model resident, TIES's task vector rebuilt when the density changes) scores
    what a 1-D sweep at that density scores when every merge goes through a folder on disk."""
    for density in DENSITIES:
        alone = run_sweep(settings_for(toy_pair, tmp_path / f"d{density}", density=density, stream=True))
        row = [point for point in ties_grid.points if point.second[1] == density]
        for mine, theirs in zip(row, alone.points, strict=True):
            assert mine.alpha == theirs.alpha
            assert [run.outcomes.correct for run in mine.tasks] == [run.outcomes.correct for run in theirs.tasks]


def test_a_rerun_resumes_every_cell_and_saves_the_picked_cell(toy_pair, ties_grid, tmp_path):
    again = run_sweep(settings_for(toy_pair, ties_grid.out, densities=DENSITIES, save_best=str(tmp_path / "best")))
    assert again.evaluated == [] and again.best.key == ties_grid.best.key
    from safetensors.torch import load_file

    from mergekit_lite.audited import merge_state_dict

    alpha, density = again.best.key
    expected = merge_state_dict(settings_for(toy_pair, tmp_path / "x", density=density).merge_config(alpha))
    saved = {}
    for shard in (tmp_path / "best").glob("*.safetensors"):
        saved.update(load_file(shard))
    assert saved.keys() == expected.keys() and all(saved[name].equal(expected[name]) for name in saved)


def test_golden_and_probe_run_along_alpha_in_each_row(toy_pair, tmp_path):
    alphas = [0.0, 0.25, 0.5, 0.75, 1.0]
    golden = run_sweep(settings_for(toy_pair, tmp_path / "golden", alphas=alphas, densities=DENSITIES, search="golden"))
    assert [row["density"] for row in golden.rows] == DENSITIES
    for row in golden.rows:  # the search's points of that row, and nothing else of it, were evaluated
        mine = sorted(point.alpha for point in golden.points if point.second[1] == row["density"])
        assert mine == row["evaluated"] and 0.0 in mine and 1.0 in mine
    assert golden.best.selection.harmonic_mean == max(p.selection.harmonic_mean for p in golden.points)
    probed = run_sweep(settings_for(toy_pair, tmp_path / "probe", alphas=alphas, densities=DENSITIES, probe=0.2))
    assert [(point.alpha, point.second[1]) for point in probed.points] == [
        (row["probe_pick"], row["density"]) for row in probed.rows
    ]  # each row's pick, on every doc
    assert all(row["probed"] == alphas for row in probed.rows)
    assert probed.best.selection.harmonic_mean == max(p.selection.harmonic_mean for p in probed.points)


def test_halving_plans_fit_the_budget_and_keep_as_many_as_they_can():
    plan = halving_plan(16, 12, [0.1, 0.2, 0.4])
    assert plan.keep == 2 and plan.cost <= 12 and plan.rounds[0] == 16
    assert all(b == -(-a // 2) for a, b in itertools.pairwise(plan.rounds))
    for n in range(1, 30):
        for budget in range(3, 40):
            for costs in ([0.05, 0.1, 0.2], [0.5], [1.0]):
                plan = halving_plan(n, budget, costs)
                if plan is None:
                    assert budget < 3 + n * costs[0] - 1e-9
                    continue
                spent = 2 + sum(size * costs[min(k, len(costs) - 1)] for k, size in enumerate(plan.rounds))
                assert spent + plan.survivors == pytest.approx(plan.cost) and plan.cost <= budget + 1e-9
    assert halving_plan(10, 5, [0.5]) is None  # every point probed once is already 5 + 2


def probe_cost(out) -> tuple[float, int]:
    """(cost in full evaluations, model evaluations) counted from what the run wrote: every full point file 1,
    every probe file its docs over a full point's docs."""
    pre = json.loads((out / POINTS_DIR / "pre.json").read_text())
    docs = sum(len(task["correct"]) for task in pre["tasks"] if "correct" in task)
    full = list((out / POINTS_DIR).glob("*.json"))
    probes = list((out / PROBES_DIR).glob("*.json")) if (out / PROBES_DIR).is_dir() else []
    probed = sum(len(task["correct"]) for path in probes for task in json.loads(path.read_text())["tasks"])
    return len(full) + probed / docs, len(full) + len(probes)


def test_the_budget_is_respected_and_its_pick_is_the_full_grids_or_indistinguishable(toy_pair, ties_grid, tmp_path):
    n_cells = len(ALPHAS) * len(DENSITIES)
    budget = n_cells  # below the grid's n_cells + 2 evaluations: the halving decides
    result = run_sweep(settings_for(toy_pair, tmp_path / "budget", densities=DENSITIES, budget=budget, probe=0.2))
    cost, evaluations = probe_cost(result.out)
    assert cost <= budget + 1e-9 and cost == pytest.approx(result.budget["cost"])
    assert evaluations == result.budget["evaluations"] > n_cells
    assert result.budget["rounds"] and len(result.points) == len(result.budget["full"]) < n_cells
    full_pick = ties_grid.best.key
    assert result.best.key == full_pick or result.best.key in ties_grid.indistinguishable + ties_grid.ties
    assert "## Budgeted search (--budget 6)" in (result.out / "report.md").read_text()
    again = run_sweep(settings_for(toy_pair, result.out, densities=DENSITIES, budget=budget, probe=0.2))
    assert again.evaluated == [] and probe_cost(result.out) == (cost, evaluations)  # resumed, nothing new
    roomy = run_sweep(settings_for(toy_pair, ties_grid.out, densities=DENSITIES, budget=n_cells + 2))
    assert roomy.budget["rounds"] == [] and roomy.best.key == full_pick  # the whole grid fits: the grid itself


def test_a_comparison_entry_may_be_a_grid(toy_pair, tmp_path):
    data = {
        "pre": toy_pair.pre_dir,
        "post": toy_pair.post_dir,
        "alphas": ALPHAS,
        "old_tasks": toy_pair.old_tasks,
        "new_tasks": toy_pair.new_tasks,
        "include_path": toy_pair.task_dir,
        "out": str(tmp_path / "run"),
    }
    linear, lines = method_settings(data, ["linear", {"method": "lines", "betas": [0.0, 0.5]}])
    assert linear.second is None and lines.second == "beta" and lines.betas == [0.0, 0.5]
    comparison = run_comparison([linear, lines])
    assert comparison.evaluations == 2 + len(ALPHAS) * 3  # linear's alphas, lines' alphas x 2 betas
    pick = comparison.sweeps["lines"].best
    entry = json.loads((comparison.out / "comparison.json").read_text())["methods"][1]
    assert (entry["pick"], entry["beta"]) == (pick.alpha, pick.second[1]) and len(entry["points"]) == 6
    assert f"alpha {pick.alpha!r}, beta {pick.second[1]!r}" in (comparison.out / "comparison.md").read_text()
    with pytest.raises(InputError, match="no drop"):
        method_settings(data, [{"method": "ties", "drops": [0.1]}])


@pytest.mark.parametrize("method", list(SWEEPABLE))
def test_every_sweepable_method_gets_a_report(ties_grid, method):
    """results.json and report.md render for every method `sweep` accepts (the grid's scores stand in: the text
    depends on the method only through its name and coefficient)."""
    result = copy.copy(ties_grid)
    result.settings = copy.copy(ties_grid.settings)
    result.settings.method = method
    results = results_json(result)
    assert results["alpha_means"] and results["coefficient"] == SWEEPABLE[method].main_coefficient
    assert f"# Sweep: {method} between pre and post" in report_markdown(result, results)


def test_cli_takes_the_grid_from_flags_and_the_yaml(toy_pair, ties_grid, tmp_path):
    """--densities on the command line, `densities:` in a YAML file: the same grid, resumed from its folder."""
    config = tmp_path / "sweep.yaml"
    config.write_text(
        f"pre: {toy_pair.pre_dir}\npost: {toy_pair.post_dir}\nmethod: ties\nalphas: [0.0, 0.5, 1.0]\n"
        f"densities: [0.3, 0.9]\nold-tasks: {','.join(toy_pair.old_tasks)}\n"
        f"new-tasks: {','.join(toy_pair.new_tasks)}\ninclude-path: {toy_pair.task_dir}\n"
    )
    best = f"best  alpha={ties_grid.best.alpha!r} density={ties_grid.best.second[1]!r} (lambda of ties)"
    for args in (
        [str(config)],
        [
            "--pre",
            toy_pair.pre_dir,
            "--post",
            toy_pair.post_dir,
            "--method",
            "ties",
            "--alphas",
            "0,0.5,1",
            "--densities",
            "0.3,0.9",
            "--include-path",
            toy_pair.task_dir,
            "--old-tasks",
            ",".join(toy_pair.old_tasks),
            "--new-tasks",
            ",".join(toy_pair.new_tasks),
        ],
    ):
        done = subprocess.run(
            [CLI, "sweep", *args, "--out", str(ties_grid.out), "-q"], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        assert best in done.stdout and "evaluated 0 models" in done.stdout
    done = subprocess.run(
        [CLI, "sweep", str(config), "--drops", "0.1", "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error: sweep one second")
