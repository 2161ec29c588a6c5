"""samples.jsonl of a sweep (sweep.samples): what the pick did to each report doc, on one real toy sweep (the toy
pair, lm-eval's local tasks, alphas 0.3 and 0.7). Expected values come from the point files' raw JSON and
results.json's forgetting map, not from the module under test."""

import dataclasses
import json
import shutil

import pytest

from mergekit_lite.sweep import SweepSettings, run_sweep
from mergekit_lite.sweep.samples import SAMPLES_FILE


def expected_class(pre: bool, post: bool, pick: bool) -> str:
    """The issue's definitions, written out again: what post forgot and the pick won back or not, what the pick
    lost of what both kept, and names for the rest."""
    if pre and not post:
        return "recovered" if pick else "still_lost"
    if pre:
        return "kept" if pick else "newly_lost"
    if not post:
        return "gained" if pick else "never"
    return "gain_kept" if pick else "gain_lost"


@pytest.fixture(scope="module")
def sweep(toy_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep-samples") / "run"
    result = run_sweep(SweepSettings(toy_pair.pre_dir, toy_pair.post_dir, "linear", [0.3, 0.7], toy_pair.old_tasks,
                                     toy_pair.new_tasks, toy_pair.task_dir, out, limit=None))
    return result, out


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def saved_outcomes(folder, label: str) -> dict[str, dict[str, bool]]:
    """task -> key -> 0/1 outcome, straight from a point file's JSON."""
    data = json.loads((folder / "points" / f"{label.replace('=', '_')}.json").read_text())
    return {task["task"]: task["correct"] for task in data["tasks"] if "correct" in task}


def test_every_report_doc_is_classified_as_the_point_files_say(sweep):
    result, out = sweep
    results = json.loads((out / "results.json").read_text())
    rows = read_rows(out / SAMPLES_FILE)
    pick = results["samples"]["pick"]
    assert pick == result.best.label and pick.startswith("alpha=")
    saved = {name: saved_outcomes(out, label) for name, label in (("pre", "pre"), ("post", "post"), ("pick", pick))}
    assert rows and {row["task"] for row in rows} == set(saved["pre"]) == {*result.settings.old_tasks,
                                                                            *result.settings.new_tasks}
    for row in rows:
        right = [saved[name][row["task"]][row["key"]] for name in ("pre", "post", "pick")]
        assert [row["pre"], row["post"], row["pick"]] == [int(value) for value in right]
        assert row["class"] == expected_class(*right)
        assert row["prompt"] is None and row["gold"] is None and row["answers"] is None  # not in point files
        assert row["doc_hash"] == row["key"].partition("#")[0] and isinstance(row["doc_id"], int)
    for task, docs in results["selection"]["docs"].items():
        mine = [row for row in rows if row["task"] == task]
        assert len(mine) == docs["report"] and len({row["key"] for row in mine}) == len(mine)  # report split only
        assert [row["doc_id"] for row in mine] == sorted(row["doc_id"] for row in mine)
        counts = results["samples"]["counts"][task]
        assert counts == {name: sum(row["class"] == name for row in mine) for name in counts}
        assert sum(counts.values()) == docs["report"]
        post_map = next(entry for entry in results["post"]["forgetting"]["tasks"] if entry["task"] == task)
        assert counts["recovered"] + counts["still_lost"] == post_map["forgotten"]
        pick_map = next(entry for entry in next(point for point in results["points"] if point["label"] == pick)
                        ["forgetting"]["tasks"] if entry["task"] == task)
        assert counts["still_lost"] + counts["newly_lost"] == pick_map["forgotten"]
    assert sum(counts["recovered"] for counts in results["samples"]["counts"].values()) > 0  # the toy pair forgets


def test_report_shows_the_counts_and_doc_ids(sweep):
    _, out = sweep
    results = json.loads((out / "results.json").read_text())
    report = (out / "report.md").read_text()
    assert f"(report split, `{SAMPLES_FILE}`)" in report
    for task, counts in results["samples"]["counts"].items():
        assert f"| {task} | {counts['recovered']} | {counts['still_lost']} | {counts['newly_lost']} |" in report
    for name, examples in results["samples"]["examples"].items():
        total = sum(counts[name] for counts in results["samples"]["counts"].values())
        assert len(examples) == min(total, 5)
        line = next(line for line in report.splitlines() if line.startswith(f"- {name.replace('_', ' ')}: "))
        assert line.startswith(f"- {name.replace('_', ' ')}: {total}")
        assert all(f"{task} doc {doc}" in line for task, doc in examples)


@pytest.mark.parametrize("old", [False, True], ids=["rerun", "old-folder"])
def test_a_resumed_run_folder_writes_the_same_samples(sweep, tmp_path, old):
    """A rerun of a finished sweep, and a run folder from before samples.jsonl (its points only kept 0/1
    outcomes then too): every point resumes, nothing is evaluated, samples.jsonl comes out byte-identical."""
    result, out = sweep
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    if old:
        (copy / SAMPLES_FILE).unlink()
        results = json.loads((copy / "results.json").read_text())
        del results["samples"]
        (copy / "results.json").write_text(json.dumps(results))
    again = run_sweep(dataclasses.replace(result.settings, out=copy))
    assert again.evaluated == [] and again.best.label == result.best.label
    assert (copy / SAMPLES_FILE).read_bytes() == (out / SAMPLES_FILE).read_bytes()
