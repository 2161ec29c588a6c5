"""`sweep --realign-shots K`: post scored again with K demonstrations on the docs it forgot, its forgetting and the
pick's still-lost docs split into spurious and genuine; checked against the run's own saved lm-eval outcomes with the
split's definitions written out here (Zheng et al., ICLR 2025: spurious = the re-aligned model gets it right)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SHOTS = 2


def cli(*args, cwd):
    command = [str(Path(sys.executable).with_name("mergekit-lite")), "sweep", *map(str, args)]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=environment, timeout=600)


def sweep_args(pair, folder):
    return [
        "--pre",
        pair.pre_dir,
        "--post",
        pair.post_dir,
        "--method",
        "recall_lerp",
        "--recall-texts",
        pair.typical_texts,
        "--alphas",
        "0.5,1",
        "--old-tasks",
        ",".join(pair.old_tasks),
        "--new-tasks",
        ",".join(pair.new_tasks),
        "--include-path",
        pair.task_dir,
        "--limit",
        12,
        "--bootstrap",
        0,
        "--realign-shots",
        SHOTS,
        "--out",
        folder,
        "--quiet",
    ]


def saved(folder: Path, name: str) -> dict:
    return {task["task"]: task for task in json.loads((folder / "points" / name).read_text())["tasks"]}


def chance_corrected(spurious: int, forgotten: int, k) -> float | None:
    if not forgotten:
        return None
    share = spurious / forgotten
    return share if k is None else max((k * share - 1) / (k - 1), 0.0)


@pytest.mark.slow
def test_realign_shots_splits_forgetting_as_the_saved_outcomes_say(toy_pair, tmp_path):
    folder = tmp_path / "run"
    done = cli(*sweep_args(toy_pair, folder), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    results = json.loads((folder / "results.json").read_text())
    pre, post = saved(folder, "pre.json"), saved(folder, "post.json")
    realigned_file = json.loads((folder / "points" / f"realigned-shots_{SHOTS}.json").read_text())
    assert realigned_file["identity"]["realign_shots"] == SHOTS
    realigned = {task["task"]: task for task in realigned_file["tasks"]}
    pick = saved(folder, f"alpha_{results['pick']['alpha']!r}.json")
    rows = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    report_keys = {(row["task"], row["key"]) for row in rows if row["split"] == "report"}

    total_forgotten = 0
    for task in pre:
        forgotten = [key for key, right in pre[task]["correct"].items() if right and not post[task]["correct"][key]]
        total_forgotten += len(forgotten)
        # only the forgotten docs were scored again
        scored = realigned[task]["correct"] if task in realigned else {}
        assert sorted(scored) == sorted(forgotten)
        assert (
            sorted(realigned[task]["doc_ids"].values()) == sorted(pre[task]["doc_ids"][k] for k in forgotten)
            if forgotten
            else task not in realigned
        )
        kinds = {key: "spurious" if scored[key] else "genuine" for key in forgotten}
        assert {row["key"]: row["forgetting_kind"] for row in rows if row["task"] == task} == {
            key: kinds.get(key) for key in pre[task]["correct"]
        }
        k = pre[task]["n_choices"]
        for part, keys in (
            ("forgetting", forgotten),
            ("still_lost", [key for key in forgotten if not pick[task]["correct"][key]]),
        ):
            shown = [key for key in keys if (task, key) in report_keys]
            spurious = sum(kinds[key] == "spurious" for key in shown)
            entry = results["realign"][part]["tasks"][task]
            assert (entry["forgotten"], entry["spurious"], entry["genuine"]) == (
                len(shown),
                spurious,
                len(shown) - spurious,
            )
            assert entry["spurious_share_true"] == pytest.approx(chance_corrected(spurious, len(shown), k))
    assert total_forgotten > 0  # the toy post forgets: the split above is not of nothing
    assert_lm_evals_own_cli_scores_the_forgotten_docs_alike(toy_pair, realigned, tmp_path / "lm_eval")
    assert results["realign"]["shots"] == SHOTS and f"--num_fewshot {SHOTS}" in results["realign"]["lm_eval"]

    report = (folder / "report.md").read_text()
    assert f"post again with {SHOTS} demonstrations" in report
    # post's drift per layer beside recall_lerp's weight of post at the pick, a row per layer between embed and head
    layers = json.loads((toy_pair.pre_dir / "config.json").read_text())["num_hidden_layers"]
    assert len(results["drift"]["layers"]) == layers
    table = report.split("## Where post moved: relative drift per layer")[1].split("\n\n")[2].splitlines()
    assert f"recall_lerp weight of post (alpha {results['pick']['alpha']!r})" in table[0]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    assert [row[0] for row in cells][1 : layers + 1] == [f"layer {index}" for index in range(layers)]
    for row, drift in zip(cells[1 : layers + 1], results["drift"]["layers"], strict=True):
        assert float(row[1]) == pytest.approx(drift["relative_drift"], rel=1e-3)
        assert 0 <= float(row[2]) <= 1

    before = (folder / "points" / f"realigned-shots_{SHOTS}.json").stat().st_mtime_ns
    again = cli(*sweep_args(toy_pair, folder), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "evaluated 0 models" in again.stdout
    assert (folder / "points" / f"realigned-shots_{SHOTS}.json").stat().st_mtime_ns == before  # resumed, not redone
    assert json.loads((folder / "results.json").read_text())["realign"] == results["realign"]


def assert_lm_evals_own_cli_scores_the_forgotten_docs_alike(pair, realigned: dict, output: Path) -> None:
    """lm-eval's CLI on post with --num_fewshot K and --samples of the forgotten docs gives each doc the outcome the
    realigned point saved: the same docs, the same demonstrations."""
    from lm_eval.__main__ import cli_evaluate
    from lm_eval_tasks import lm_eval_arguments, samples_folder

    chosen = {task: sorted(entry["doc_ids"].values()) for task, entry in realigned.items()}
    saved_argv = sys.argv
    sys.argv = [
        "lm_eval",
        *lm_eval_arguments(
            pair.post_dir,
            ",".join(chosen),
            pair.task_dir,
            output,
            "--num_fewshot",
            str(SHOTS),
            "--samples",
            json.dumps(chosen),
        ),
    ]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved_argv
    folder = samples_folder(output)
    for task, entry in realigned.items():
        [log] = folder.glob(f"samples_{task}_*.jsonl")
        records = {record["doc_id"]: record for record in map(json.loads, log.read_text().splitlines())}
        assert {entry["doc_ids"][key]: right for key, right in entry["correct"].items()} == {
            doc_id: bool(record["acc"]) for doc_id, record in records.items()
        }
        [results_file] = folder.glob("results_*.json")
        assert json.loads(results_file.read_text())["n-shot"][task] == SHOTS


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "two"])
def test_a_bad_realign_shots_is_one_line_exit_2(tmp_path, value):
    done = cli(
        "--pre",
        "a",
        "--post",
        "b",
        "--alphas",
        "0.5",
        "--old-tasks",
        "x",
        "--new-tasks",
        "y",
        "--out",
        tmp_path / "run",
        "--realign-shots",
        value,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "realign" in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_sweep_file_with_a_fractional_realign_shots_is_one_line_exit_2(tmp_path):
    config = tmp_path / "sweep.yaml"
    config.write_text("pre: a\npost: b\nalphas: 0.5\nold_tasks: x\nnew_tasks: y\nrealign_shots: 2.5\n")
    done = cli(config, "--out", tmp_path / "run", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "realign_shots" in done.stderr
