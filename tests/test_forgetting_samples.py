"""The sample list (--samples), the replay set (--replay) and the trajectory (three or more checkpoints, --alert,
--heatmap) of `mergekit-lite forgetting`, on files lm-eval's own CLI wrote for the toy models (session fixtures
`lm_eval_runs` and `lm_eval_checkpoint`: pre, post-training's step-25 checkpoint and post are three checkpoints
of one training run). Expected values are read from the raw jsonl lines here, not from our loader."""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from mergekit_lite.cli.main import main
from mergekit_lite.evaluate.outcomes import Scoring, load_lm_eval_run
from mergekit_lite.evaluate.records import SampleText, sample_text
from mergekit_lite.evaluate.trajectory import heatmap_values, trajectory

pytestmark = pytest.mark.slow

FILTER = "flexible-extract"
GROUPS = ["--group", "old=toy_old,norm_old,gen_old,genmc_old", "--group", "new=toy_new,gen_new"]


def run_cli(*args):
    return CliRunner().invoke(main, ["forgetting", *map(str, args)])


def raw_lines(folder: Path, task: str) -> dict[int, dict]:
    """doc_id -> the record lm-eval logged under the filter we score by (flexible-extract where logged)."""
    [path] = folder.glob(f"samples_{task}_*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    chosen = FILTER if any(line["filter"] == FILTER for line in lines) else lines[0]["filter"]
    return {line["doc_id"]: line for line in lines if line["filter"] == chosen}


def score(line: dict) -> int:
    return int(line[line["metrics"][0]])


def expected_gold(line: dict) -> str:
    """The toy docs hold choices and label: multiple choice scores ' ' + choice (target_delimiter), generation
    exact-matches the choice."""
    choice = line["doc"]["choices"][line["doc"]["label"]]
    return choice if isinstance(line["arguments"]["gen_args_0"]["arg_1"], dict) else " " + choice


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def two_model_outputs(lm_eval_runs, tmp_path_factory):
    """One CLI run with --samples and --replay (--json output), shared by the tests of the two-model form."""
    out = tmp_path_factory.mktemp("samples")
    result = run_cli(
        lm_eval_runs.pre,
        lm_eval_runs.post,
        "--filter",
        FILTER,
        *GROUPS,
        "--json",
        "--samples",
        out / "samples.jsonl",
        "--replay",
        out / "replay.jsonl",
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), read_jsonl(out / "samples.jsonl"), read_jsonl(out / "replay.jsonl"), result.stderr


def test_the_sample_list_adds_up_to_the_maps_counts_and_says_what_lm_eval_logged(lm_eval_runs, two_model_outputs):
    payload, rows, _, stderr = two_model_outputs
    assert f"samples: {len(rows)} rows written" in stderr
    for task_row in payload["tasks"]:
        task = task_row["task"]
        mine = [row for row in rows if row["task"] == task]
        assert len(mine) == task_row["n"] == lm_eval_runs.limit
        for outcome in ("kept", "gained", "forgotten", "never"):
            assert sum(row["outcome"] == outcome for row in mine) == task_row[outcome], (task, outcome)
        pre, post = raw_lines(lm_eval_runs.pre, task), raw_lines(lm_eval_runs.post, task)
        for row in mine:
            before, after = pre[row["doc_id"]], post[row["doc_id"]]
            assert row["doc_hash"] == before["doc_hash"] and row["scores"] == [score(before), score(after)]
            assert row["prompt"] == before["arguments"]["gen_args_0"]["arg_0"]
            assert row["gold"] == expected_gold(before), task
            for answer, line in zip(row["answers"], (before, after), strict=True):
                if isinstance(line["arguments"]["gen_args_0"]["arg_1"], dict):
                    assert answer == line["filtered_resps"][0]  # the filtered generation
                else:  # the option the metric picked: right exactly when lm-eval scored it right
                    assert answer in [request["arg_1"] for request in line["arguments"].values()]
                    assert (answer == row["gold"]) == bool(score(line)), (task, row["doc_id"])
    rules = {row["task"]: row["answer_rule"] for row in rows}
    assert "(acc)" in rules["toy_old"] and "(acc_norm)" in rules["norm_old"] and FILTER in rules["gen_new"]


def test_acc_norm_answers_are_the_per_character_pick_not_the_raw_argmax(lm_eval_runs, two_model_outputs):
    """On norm_old lm-eval scores acc_norm only; post's raw-loglikelihood argmax differs from it on some docs,
    and the list follows the metric that decides (the previous test: right exactly when acc_norm is 1)."""
    _, rows, _, _ = two_model_outputs
    post = raw_lines(lm_eval_runs.post, "norm_old")
    differs = 0
    for row in (row for row in rows if row["task"] == "norm_old"):
        line = post[row["doc_id"]]
        options = [request["arg_1"] for request in line["arguments"].values()]
        raw_pick = options[max(range(len(options)), key=lambda i: float(line["filtered_resps"][i][0]))]
        differs += raw_pick != row["answers"][1]
    assert differs > 0


def test_replay_holds_exactly_the_forgotten_docs_with_their_gold_answers(lm_eval_runs, two_model_outputs):
    payload, _, replay, stderr = two_model_outputs
    expected = set()
    for task in lm_eval_runs.tasks:
        pre, post = raw_lines(lm_eval_runs.pre, task), raw_lines(lm_eval_runs.post, task)
        expected |= {(task, doc) for doc in pre if score(pre[doc]) == 1 and score(post[doc]) == 0}
    assert {(record["task"], record["doc_id"]) for record in replay} == expected and len(replay) == len(expected)
    assert len(expected) == sum(row["forgotten"] for row in payload["tasks"]) > 0
    assert f"replay: {len(expected)} forgotten samples written" in stderr and "left out" not in stderr
    for record in replay:
        line = raw_lines(lm_eval_runs.pre, record["task"])[record["doc_id"]]
        assert set(record) == {"prompt", "completion", "task", "doc_id"}
        assert record["prompt"] == line["arguments"]["gen_args_0"]["arg_0"]
        gold = line["doc"]["choices"][line["doc"]["label"]]
        assert record["completion"] == " " + gold  # prompt + completion: the text lm-eval scored, or its few-shot join


def test_replay_as_chat_messages(lm_eval_runs, tmp_path):
    out = tmp_path / "replay.jsonl"
    result = run_cli(
        lm_eval_runs.pre, lm_eval_runs.post, "--filter", FILTER, "--replay", out, "--replay-format", "messages"
    )
    assert result.exit_code == 0, result.output
    records = read_jsonl(out)
    assert records and all(set(record) == {"messages", "task", "doc_id"} for record in records)
    for record in records:
        user, assistant = record["messages"]
        line = raw_lines(lm_eval_runs.pre, record["task"])[record["doc_id"]]
        assert user == {"role": "user", "content": line["arguments"]["gen_args_0"]["arg_0"]}
        assert assistant == {"role": "assistant", "content": line["doc"]["choices"][line["doc"]["label"]]}


def test_a_doc_whose_gold_answer_is_not_in_the_log_is_left_out_and_counted(lm_eval_runs, tmp_path):
    """A multiple-target doc (lm-eval logs str([0, 2])) has no single gold answer: not replayed, and said."""
    pre, post = raw_lines(lm_eval_runs.pre, "toy_old"), raw_lines(lm_eval_runs.post, "toy_old")
    forgotten = sorted(doc for doc in pre if score(pre[doc]) == 1 and score(post[doc]) == 0)
    copy = tmp_path / "pre"
    shutil.copytree(lm_eval_runs.pre, copy)
    [path] = copy.glob("samples_toy_old_*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        if line["doc_id"] == forgotten[0]:
            line["target"] = str([0, 2])
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "replay.jsonl"
    result = run_cli(copy, lm_eval_runs.post, "--replay", out)
    assert result.exit_code == 0, result.output
    assert "1 forgotten docs left out: their gold answer or prompt is not in the log" in result.stderr
    replayed = {(record["task"], record["doc_id"]) for record in read_jsonl(out)}
    assert ("toy_old", forgotten[0]) not in replayed and ("toy_old", forgotten[1]) in replayed


def test_sample_text_of_records_lm_eval_shapes_otherwise():
    """Older list arguments, a target given as the option's text, acc_mutual_info's unconditional requests,
    several contexts per doc (multiple_input: no one prompt), and records missing their parts."""
    older = {
        "arguments": [["Q?", " yes"], ["Q?", " no"]],
        "target": "no",
        "filtered_resps": [[-2.0, False], [-1.0, True]],
    }
    assert (
        sample_text(older, "acc", None)
        == sample_text({**older, "target": "1"}, "acc", {})
        == SampleText("Q?", " no", " no", " no")
    )
    mutual = {
        "acc_mutual_info": 1,
        "target": "0",
        "arguments": [["Q?", " a"], ["Q?", " b"], ["", " a"], ["", " b"]],
        "filtered_resps": [[-1.0, True], [-2.0, False], [-0.5, False], [-3.0, False]],
    }
    assert sample_text(mutual, "acc_mutual_info", None).answer == " b"  # -2 - -3 beats -1 - -0.5
    assert sample_text(mutual, "acc", None).answer == " a"
    in_process = {
        "target": 1,
        "arguments": [("Q?", " yes"), ("Q?", " no")],
        "filtered_resps": [(-2.0, False), (-1.0, True)],
    }
    assert sample_text(in_process, "acc", None) == SampleText("Q?", " no", " no", " no")  # the sweep's records
    assert sample_text({**in_process, "target": [0, 1]}, "acc", None).gold is None  # multiple_target: no one gold
    several = {"target": "0", "arguments": [["A is", " x"], ["B is", " x"]], "filtered_resps": [[-1, 0], [-2, 0]]}
    assert sample_text(several, "acc", None).prompt is None
    for broken in ({}, {"arguments": "x"}, {"arguments": [["only one"]]}, {"arguments": {"gen_args_0": 3}}):
        assert sample_text(broken, "acc", None).prompt is None
    generated = {
        "target": "42",
        "arguments": {"gen_args_0": {"arg_0": "2*21=", "arg_1": {"until": []}}},
        "filtered_resps": [["42"]],
    }
    assert sample_text(generated, "exact_match", {"target_delimiter": ""}) == SampleText("2*21=", "42", "42", "42")
    assert sample_text(generated, "exact_match", None).completion == " 42"  # lm-eval's default target_delimiter


# --- the trajectory ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(lm_eval_runs, lm_eval_checkpoint):
    """Three lm-eval outputs of one toy training run, in training order: step 0 (pre), step 25, step 200 (post)."""
    return [lm_eval_runs.pre, lm_eval_checkpoint, lm_eval_runs.post]


def test_each_trajectory_row_is_the_two_model_comparison(checkpoints, tmp_path):
    samples = tmp_path / "samples.jsonl"
    result = run_cli(
        *checkpoints,
        "--filter",
        FILTER,
        *GROUPS,
        "--overall",
        "--json",
        "--samples",
        samples,
        "--heatmap",
        tmp_path / "map.png",
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [row["path"] for row in payload["checkpoints"]] == list(map(str, checkpoints))
    assert [row["checkpoint"] for row in payload["rows"]] == [1, 2]
    for row, later in zip(payload["rows"], checkpoints[1:], strict=True):
        pair = run_cli(checkpoints[0], later, "--filter", FILTER, *GROUPS, "--overall", "--json")
        assert pair.exit_code == 0, pair.output
        two_models = json.loads(pair.stdout)
        assert row["tasks"] == two_models["tasks"] and row["groups"] == two_models["groups"]
    old_true = [{group["group"]: group for group in row["groups"]}["old"]["F_true"] for row in payload["rows"]]
    assert old_true[0] != old_true[1]  # the middle checkpoint is a point of its own, not post again
    assert (tmp_path / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = read_jsonl(samples)
    assert len(rows) == sum(task["n"] for task in payload["rows"][0]["tasks"])
    for row in rows:
        lines = [raw_lines(folder, row["task"])[row["doc_id"]] for folder in checkpoints]
        assert row["scores"] == [score(line) for line in lines]
        first = next((i for i in (1, 2) if row["scores"][0] == 1 and row["scores"][i] == 0), None)
        assert row["first_forgotten"] == first
    assert {row["first_forgotten"] for row in rows} == {None, 1, 2}  # forgotten at step 25, and only later


def test_heatmap_without_groups_has_a_row_per_task(checkpoints, tmp_path):
    series = trajectory([load_lm_eval_run(folder, Scoring()) for folder in checkpoints], list(map(str, checkpoints)))
    names, values = heatmap_values(series, [[], []])
    assert names == sorted(series.maps[0].rows) and len(values["F_true"][0]) == 2
    assert values["F_true"][names.index("toy_old")] == [series.maps[i].rows["toy_old"].F_true for i in (0, 1)]
    result = run_cli(*checkpoints, "--heatmap", tmp_path / "map.png")
    assert result.exit_code == 0 and (tmp_path / "map.png").read_bytes()[:4] == b"\x89PNG"


def alert_run(checkpoints, *alerts):
    return run_cli(
        *checkpoints, "--filter", FILTER, *GROUPS, *[part for alert in alerts for part in ("--alert", alert)]
    )


def test_alert_exits_3_only_when_a_checkpoint_crosses_it(checkpoints):
    result = run_cli(*checkpoints, "--filter", FILTER, *GROUPS, "--json")
    rows = json.loads(result.stdout)["rows"]
    old = [{group["group"]: group for group in row["groups"]}["old"]["F_true"] for row in rows]
    new = [{group["group"]: group for group in row["groups"]}["new"]["BT_true"] for row in rows]
    high, low = max(old), min(old)
    between = (high + low) / 2
    crossed = alert_run(checkpoints, f"old:F_true>{between}")
    assert crossed.exit_code == 3, crossed.output
    which = old.index(high) + 1
    assert f"alert: checkpoint {which} ({checkpoints[which]}): old F_true = {high:.3f} crosses" in crossed.stderr
    assert crossed.stderr.count("alert:") == 1 and "| checkpoint" in crossed.stdout  # the tables are still printed
    assert alert_run(checkpoints, f"old:F_true>{high + 0.01}", f"new:BT_true<{min(new) - 0.01}").exit_code == 0
    below = alert_run(checkpoints, f"new:BT_true<{(min(new) + max(new)) / 2}")
    assert below.exit_code == 3 and "new BT_true" in below.stderr
    two_models = run_cli(*checkpoints[::2], "--filter", FILTER, *GROUPS, "--alert", f"old:F_true>{old[-1] - 0.01}")
    assert two_models.exit_code == 3 and "alert: checkpoint 1" in two_models.stderr


@pytest.mark.parametrize(
    "alert, message",
    [
        ("old F_true>0.1", "expected GROUP:METRIC>VALUE"),
        ("old:F_ture>0.1", "unknown metric 'F_ture'"),
        ("gone:F_true>0.1", "no group 'gone' (groups: old, new)"),
        ("old:F_true>x", "'x' is not a number"),
        ("old:F_true>nan", "not a number"),
    ],
)
def test_a_bad_alert_is_one_line_before_any_work(tmp_path, alert, message):
    missing = tmp_path / "nothing-here"  # inputs are not read: the alert is refused first
    missing.mkdir()
    result = run_cli(missing, missing, missing, *GROUPS, "--alert", alert)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_outputs_are_new_files_apart_from_the_inputs(lm_eval_runs, tmp_path):
    existing = tmp_path / "mine.jsonl"
    existing.write_text("keep me\n")
    result = run_cli(lm_eval_runs.pre, lm_eval_runs.post, "--samples", existing)
    assert result.exit_code == 2 and "already exists" in result.stderr and existing.read_text() == "keep me\n"
    inside = run_cli(lm_eval_runs.pre, lm_eval_runs.post, "--replay", lm_eval_runs.post / "replay.jsonl")
    assert inside.exit_code == 2 and "inside the input" in inside.stderr
    same = run_cli(lm_eval_runs.pre, lm_eval_runs.post, "--samples", tmp_path / "a", "--replay", tmp_path / "a")
    assert same.exit_code == 2 and "must name different files" in same.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mine.jsonl"]


def test_one_input_is_not_a_comparison(lm_eval_runs):
    result = run_cli(lm_eval_runs.pre)
    assert result.exit_code == 2 and "forgetting needs at least two lm-eval outputs" in result.stderr
