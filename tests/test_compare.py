"""Several methods in one sweep: pre and post evaluated once and shared, each method an ordinary sweep, and the
comparison's linear pick equal to a linear-only sweep's on the same grid and docs."""

import dataclasses
import json
from pathlib import Path

import pytest
from test_safety import cli

from mergekit_lite.errors import InputError
from mergekit_lite.sweep import method_settings, run_comparison
from mergekit_lite.sweep.compare import comparison_summary
from mergekit_lite.sweep.power import docs_needed
from mergekit_lite.sweep.store import POINTS_DIR

pytestmark = pytest.mark.slow

ALPHAS = [0.0, 0.25, 0.5, 0.75, 1.0]
# the baseline and one other method show the sharing; each further method adds len(ALPHAS) lm-eval runs
METHODS = ["linear", "ties"]


def shared(pair, out) -> dict:
    return {
        "pre": pair.pre_dir,
        "post": pair.post_dir,
        "alphas": ALPHAS,
        "old_tasks": pair.old_tasks,
        "new_tasks": pair.new_tasks,
        "include_path": pair.task_dir,
        "out": str(out),
        "limit": None,
    }


@pytest.fixture(scope="module")
def comparison(toy_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "run"
    return run_comparison(method_settings(shared(toy_pair, out), METHODS), baseline="linear")


def test_pre_and_post_are_evaluated_once_for_every_method(comparison):
    out = comparison.out
    n_grid = len(ALPHAS) * len(METHODS)
    assert comparison.evaluations == 2 + n_grid  # not 2 per method
    assert sorted(p.name for p in (out / POINTS_DIR).glob("*.json")) == ["post.json", "pre.json"]
    for method, result in comparison.sweeps.items():
        assert "pre" not in result.evaluated and "post" not in result.evaluated
        assert len(result.evaluated) == len(ALPHAS)
        assert result.out == out / method and (out / method / "report.md").is_file()
        # the shared scores, not another evaluation's
        assert result.pre.old == comparison.pre.old and result.post.new == comparison.post.new


def test_linear_pick_equals_a_linear_only_sweep_on_the_same_grid_and_split(toy_pair, comparison, linear_sweep):
    """`linear_sweep` (tests/conftest.py) is run_sweep on the settings a linear-only comparison would give."""
    alone = linear_sweep
    [settings] = method_settings(shared(toy_pair, "elsewhere"), ["linear"])
    assert dataclasses.replace(settings, out=alone.settings.out) == alone.settings
    row = next(row for row in comparison.rows if row.method == "linear")
    assert row.pick.alpha == alone.best.alpha
    assert (row.pick.old, row.pick.new, row.pick.harmonic_mean) == (
        alone.best.old,
        alone.best.new,
        alone.best.harmonic_mean,
    )
    assert row.pick.intervals == alone.best.intervals
    assert row.diff_to_baseline == [0.0, 0.0] and row.indistinguishable


def test_comparison_files_agree_with_the_result(comparison):
    data = json.loads((comparison.out / "comparison.json").read_text())
    assert data["evaluations"] == comparison.evaluations and data["baseline"] == "linear"
    assert [entry["method"] for entry in data["methods"]] == METHODS
    for entry, row in zip(data["methods"], comparison.rows, strict=True):
        assert entry["pick"] == row.pick.alpha and entry["harmonic_mean"] == row.pick.harmonic_mean
        low, high = entry["diff_to_baseline"]
        assert entry["indistinguishable_from_baseline"] == (low <= 0 <= high)
        assert len(entry["points"]) == len(ALPHAS)
        separation = entry["docs_to_separate"]  # the docs-needed estimate against the baseline's pick (sweep.power)
        assert (separation is None) == (row.method == "linear")
        if separation:
            assert (
                separation
                == docs_needed(row.pick, comparison.sweeps["linear"].best, *shared_splits(comparison)).to_json()
            )
    markdown = (comparison.out / "comparison.md").read_text()
    for row in comparison.rows:
        if row.indistinguishable and row.method != "linear":
            said = row.separation.text("linear's pick")
            assert f"- {row.method}: {said}." in markdown and said in comparison_summary(comparison)
    assert all(f"[{method}]({method}/report.md)" in markdown for method in METHODS)
    assert (comparison.out / "pareto.png").stat().st_size > 0


def shared_splits(comparison):
    reference = comparison.sweeps["linear"]
    return reference.splits, reference.settings.aggregation


def test_a_rerun_resumes_everything(toy_pair, comparison):
    again = run_comparison(method_settings(shared(toy_pair, comparison.out), METHODS), baseline="linear")
    assert again.evaluations == 0
    assert [row.pick.alpha for row in again.rows] == [row.pick.alpha for row in comparison.rows]


def test_bad_method_lists_fail_before_any_model_is_read(toy_pair, tmp_path):
    data = shared(toy_pair, tmp_path / "run")
    with pytest.raises(InputError, match="linear given twice"):
        method_settings(data, ["linear", "linear"])
    with pytest.raises(InputError, match="unknown"):
        method_settings(data, ["linear", "nosuch"])
    with pytest.raises(InputError, match="each entry"):
        method_settings(data, [{"method": "ties", "lambda": 2}])
    with pytest.raises(InputError, match="baseline 'ties' is not among"):
        run_comparison(method_settings(data, ["linear"]), baseline="ties")
    assert not (tmp_path / "run").exists()


def test_cli_compares_methods_and_prints_a_summary(toy_pair, comparison):
    result = cli(
        "sweep",
        "--pre",
        toy_pair.pre_dir,
        "--post",
        toy_pair.post_dir,
        "--method",
        ",".join(METHODS),
        "--alphas",
        ",".join(map(str, ALPHAS)),
        "--old-tasks",
        ",".join(toy_pair.old_tasks),
        "--new-tasks",
        ",".join(toy_pair.new_tasks),
        "--include-path",
        toy_pair.task_dir,
        "--out",
        comparison.out,
        "-q",
    )
    assert result.returncode == 0, result.stderr
    assert "evaluated 0 models" in result.stdout
    for method in METHODS:
        assert f"best {method}" in result.stdout


def test_the_compare_example_gives_each_method_its_own_grid(tmp_path):
    from mergekit_lite.sweep import load_sweep_file

    example = Path(__file__).resolve().parent.parent / "examples" / "compare.yaml"
    data = load_sweep_file(example)
    methods = data.pop("methods")
    settings = method_settings({**data, "out": str(tmp_path / "run")}, methods)
    assert [s.method for s in settings] == ["linear", "task_arithmetic", "ties", "dare_ties", "recall_lerp", "lines"]
    ties = settings[2]
    assert (ties.density, ties.alphas[-1], settings[0].alphas[-1]) == (0.5, 1.5, 1.0)
    assert all(Path(s.out) == tmp_path / "run" / s.method for s in settings)
