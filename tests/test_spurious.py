"""`mergekit-lite forgetting PRE POST --realigned LOG`: spurious against genuine forgetting, on files lm-eval's own
CLI wrote for the toy pair (session fixture `lm_eval_runs`: multiple choice, acc_norm only, generative tasks with
two filters, generative multiple choice). The re-aligned log is made of lm-eval's own records with a known
split: for every forgotten doc with an even doc_id it holds pre's record (right: spurious), for every other doc
post's (wrong: genuine). Expected values come from the raw jsonl lines, not from our loader."""

import json
import shutil
from pathlib import Path

import pytest
from test_forgetting_samples import FILTER, GROUPS, raw_lines, read_jsonl, run_cli, score
from test_safety import cli, one_error_line

from mergekit_lite.evaluate.spurious import recovered_share

pytestmark = pytest.mark.slow


def forgotten_docs(pre: Path, post: Path, task: str) -> set[int]:
    before, after = raw_lines(pre, task), raw_lines(post, task)
    return {doc for doc in before if score(before[doc]) and not score(after[doc])}


def build_realigned(pre: Path, post: Path, out: Path, tasks, drop_task: str | None = None) -> dict[str, set[int]]:
    """LOG: post's samples files (all filters' lines), with pre's lines for forgotten docs of even doc_id; beside
    it post's results file. Returns task -> the docs that must come out spurious."""
    shutil.copytree(post, out)
    spurious = {}
    for task in tasks:
        [post_file] = out.glob(f"samples_{task}_*.jsonl")
        [pre_file] = pre.glob(f"samples_{task}_*.jsonl")
        chosen = {doc for doc in forgotten_docs(pre, post, task) if doc % 2 == 0}
        pre_lines = [json.loads(line) for line in pre_file.read_text().splitlines() if line.strip()]
        lines = [json.loads(line) for line in post_file.read_text().splitlines() if line.strip()]
        if task == drop_task:  # a log of other docs: the forgotten docs missing
            lines = [line for line in lines if line["doc_id"] not in forgotten_docs(pre, post, task)]
        else:
            lines = [line for line in lines if line["doc_id"] not in chosen] + [
                line for line in pre_lines if line["doc_id"] in chosen
            ]
        post_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
        spurious[task] = chosen
    return spurious


TASKS = ["toy_old", "toy_new", "norm_old", "gen_old", "gen_new", "genmc_old"]


@pytest.fixture(scope="module")
def realigned(lm_eval_runs, tmp_path_factory):
    root = tmp_path_factory.mktemp("realigned")
    spurious = build_realigned(lm_eval_runs.pre, lm_eval_runs.post, root / "log", TASKS)
    return root / "log", spurious


def test_each_forgotten_doc_is_spurious_when_the_realigned_log_gets_it_right(lm_eval_runs, realigned, tmp_path):
    log, spurious = realigned
    result = run_cli(
        lm_eval_runs.pre,
        lm_eval_runs.post,
        "--filter",
        FILTER,
        *GROUPS,
        "--json",
        "--realigned",
        log,
        "--samples",
        tmp_path / "samples.jsonl",
        "--replay",
        tmp_path / "replay.jsonl",
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    tasks = {row["task"]: row for row in payload["tasks"]}
    split_seen = False
    for task in TASKS:
        forgotten = forgotten_docs(lm_eval_runs.pre, lm_eval_runs.post, task)
        row = tasks[task]
        assert (row["spurious"], row["genuine"]) == (len(spurious[task]), len(forgotten) - len(spurious[task])), task
        if forgotten:
            share = len(spurious[task]) / len(forgotten)
            k = float("inf") if row["k"] is None else row["k"]
            assert row["spurious_share"] == pytest.approx(share)
            assert row["spurious_share_true"] == pytest.approx(recovered_share(share, k))
            assert row["genuine_share_true"] == pytest.approx(1 - recovered_share(share, k))
            if k != float("inf") and share:
                assert row["spurious_share_true"] < share  # lucky guesses removed
        split_seen |= task.startswith("gen_") and row["spurious"] > 0 and row["genuine"] > 0
    assert split_seen, "a generative task with a filter has both kinds"
    old = next(row for row in payload["groups"] if row["group"] == "old")
    members = ["toy_old", "norm_old", "gen_old", "genmc_old"]
    assert old["spurious"] == sum(len(spurious[task]) for task in members)
    rows = read_jsonl(tmp_path / "samples.jsonl")
    for row in rows:
        if row["outcome"] == "forgotten":
            assert row["forgetting_kind"] == ("spurious" if row["doc_id"] in spurious[row["task"]] else "genuine")
        else:
            assert "forgetting_kind" not in row
    replayed = {(record["task"], record["doc_id"]) for record in read_jsonl(tmp_path / "replay.jsonl")}
    assert replayed and not any(doc in spurious[task] for task, doc in replayed)
    left_out = sum(len(docs) for docs in spurious.values())
    assert f"{left_out} spurious docs left out" in result.stderr


def test_replay_spurious_keeps_them_and_the_table_shows_the_split(lm_eval_runs, realigned, tmp_path):
    log, spurious = realigned
    result = run_cli(
        lm_eval_runs.pre,
        lm_eval_runs.post,
        "--filter",
        FILTER,
        "--realigned",
        log,
        "--replay",
        tmp_path / "replay.jsonl",
        "--replay-spurious",
    )
    assert result.exit_code == 0, result.output
    replayed = {(record["task"], record["doc_id"]) for record in read_jsonl(tmp_path / "replay.jsonl")}
    assert {(task, doc) for task, docs in spurious.items() for doc in docs} <= replayed
    assert "spurious_share_true" in result.stdout and "spurious docs left out" not in result.stderr


def test_bad_realigned_input_is_one_line_exit_2(lm_eval_runs, tmp_path):
    dropped = next(task for task in TASKS if forgotten_docs(lm_eval_runs.pre, lm_eval_runs.post, task))
    build_realigned(lm_eval_runs.pre, lm_eval_runs.post, tmp_path / "other", TASKS, drop_task=dropped)
    one_error_line(
        cli("forgetting", lm_eval_runs.pre, lm_eval_runs.post, "--realigned", tmp_path / "other"),
        2,
        "no sample of a forgotten doc",
    )
    one_error_line(cli("forgetting", lm_eval_runs.pre, lm_eval_runs.post, "--replay-spurious"), 2, "--realigned")
    one_error_line(
        cli("forgetting", lm_eval_runs.pre, lm_eval_runs.post, lm_eval_runs.post, "--realigned", lm_eval_runs.post),
        2,
        "two models",
    )
