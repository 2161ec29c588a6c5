"""The chance warning (sweep.chance): an untrained pair scores within chance on lm-eval's own outputs, and the sweep
says so on stderr, in report.md and results.json, naming the task and lm-eval's settings, the pick marked
unsupported; a trained pair is not warned."""

import json

import pytest
from click.testing import CliRunner

from cli.main import main
from mergekit_lite.sweep.chance import chance_levels, wilson
from mergekit_lite.toy import build_toy_pair

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chance_pair(tmp_path_factory):
    """The toy pair untrained (pre random, post one step on): 4 choices a doc, answered at chance."""
    return build_toy_pair(tmp_path_factory.mktemp("chance") / "pair", seed=3, pre_steps=0, post_steps=1)


def test_a_pair_at_chance_is_warned_and_its_pick_unsupported(chance_pair, tmp_path):
    out = tmp_path / "run"
    arguments = ["sweep", "--pre", chance_pair.pre_dir, "--post", chance_pair.post_dir, "--alphas", "0,0.5,1"]
    arguments += ["--old-tasks", ",".join(chance_pair.old_tasks), "--new-tasks", ",".join(chance_pair.new_tasks)]
    arguments += ["--include-path", chance_pair.task_dir, "--num-fewshot", "0", "--out", out, "--quiet"]
    done = CliRunner().invoke(main, [str(argument) for argument in arguments])
    assert done.exit_code == 0, done.output
    results = json.loads((out / "results.json").read_text())
    [old_task], [new_task] = chance_pair.old_tasks, chance_pair.new_tasks
    levels = {level["task"]: level for level in results["chance"]}
    assert levels[old_task]["chance"] == 0.25 and "pre" in levels[old_task]["within_chance"]
    assert "post" in levels[new_task]["within_chance"]
    for level in levels.values():  # every model named is within chance: its interval holds 1/4
        for label in level["within_chance"]:
            for name, (_acc, low, high) in level["scores"].items():
                if name == label or label == "every merge" and name not in ("pre", "post"):
                    assert low <= 0.25 <= high
        assert level["lm_eval"] == "--num_fewshot 0"
    assert results["pick"]["unsupported"] is True and results["unsupported"] is True
    assert f"scores within chance on {old_task}: pre" in done.stderr and "--num_fewshot 0" in done.stderr
    assert "the pick is unsupported" in done.stderr
    assert "(unsupported: tasks at chance)" in done.stdout
    report = (out / "report.md").read_text()
    assert "(unsupported: tasks at chance, below)" in report
    assert f"**Warning: scores within chance on {old_task}: pre" in report and "--num_fewshot 0" in report


def test_a_trained_pair_is_not_warned(linear_sweep):
    result = linear_sweep
    assert result.chance == [] and not result.unsupported
    assert json.loads((result.out / "results.json").read_text())["pick"]["unsupported"] is False
    again = chance_levels(result.pre, result.post, result.points, result.splits, 0.95, "lm-eval's defaults")
    assert again == []


def test_the_wilson_interval_holds_the_share_and_stays_in_zero_one():
    assert wilson(0, 10, 0.95)[0] == pytest.approx(0, abs=1e-12) and wilson(10, 10, 0.95)[1] == pytest.approx(1)
    assert 0 <= wilson(0, 10, 0.95)[0] and wilson(10, 10, 0.95)[1] <= 1
    low, high = wilson(8, 32, 0.95)
    assert low < 0.25 < high and high - low < 0.35
