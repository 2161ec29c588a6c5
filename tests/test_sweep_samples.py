"""samples.jsonl, the report's sample section and `--replay` of a sweep (sweep.samples), on one real toy sweep
through the CLI (the toy pair, lm-eval's local tasks: multiple choice and a generative task with two filters,
alphas 0.3 and 0.7, the first 32 docs). Expected values come from the point files' raw JSON, results.json's
forgetting maps and the files lm-eval's own CLI wrote for pre and post (`lm_eval_runs`), not from the module
under test."""

import json
import shutil

import pytest
from click.testing import CliRunner

from mergekit_lite.cli.main import main
from mergekit_lite.sweep.samples import SAMPLES_FILE

pytestmark = pytest.mark.slow

OLD, NEW, FILTER = ["toy_old", "gen_old"], ["toy_new"], "flexible-extract"


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


def sweep_cli(toy_pair, lm_eval_runs, out, *extra):
    result = CliRunner().invoke(
        main,
        [
            "sweep",
            "--pre",
            str(toy_pair.pre_dir),
            "--post",
            str(toy_pair.post_dir),
            "--alphas",
            "0.3,0.7",
            "--old-tasks",
            ",".join(OLD),
            "--new-tasks",
            ",".join(NEW),
            "--include-path",
            str(lm_eval_runs.include_path),
            "--limit",
            str(lm_eval_runs.limit),
            "--filter",
            f"gen_old={FILTER}",
            "--bootstrap",
            "0",
            "-q",
            "--out",
            str(out),
            *map(str, extra),
        ],
    )
    return result


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def sweep(toy_pair, lm_eval_runs, tmp_path_factory):
    """The sweep with --replay (the still-lost docs), then the same command again with --replay-all as chat
    messages: every point resumes, and samples.jsonl comes out byte-identical from the saved points."""
    root = tmp_path_factory.mktemp("sweep-samples")
    first = sweep_cli(toy_pair, lm_eval_runs, root / "run", "--replay", root / "replay.jsonl")
    assert first.exit_code == 0, first.output
    fresh = (root / "run" / SAMPLES_FILE).read_bytes()
    again = sweep_cli(
        toy_pair,
        lm_eval_runs,
        root / "run",
        "--replay",
        root / "all.jsonl",
        "--replay-all",
        "--replay-format",
        "messages",
    )
    assert again.exit_code == 0, again.output
    assert "evaluated 0 models, resumed 4" in again.stdout
    assert (root / "run" / SAMPLES_FILE).read_bytes() == fresh  # texts read back from the point files
    return root, first.stderr, again.stderr


def saved(folder, label: str) -> dict[str, dict]:
    """task -> its entry in a point file's JSON."""
    data = json.loads((folder / "points" / f"{label.replace('=', '_')}.json").read_text())
    return {task["task"]: task for task in data["tasks"]}


def rows_and_points(root):
    out = root / "run"
    results = json.loads((out / "results.json").read_text())
    points = {
        name: saved(out, label)
        for name, label in (("pre", "pre"), ("post", "post"), ("pick", results["samples"]["pick"]))
    }
    return results, read_jsonl(out / SAMPLES_FILE), points


def test_every_doc_is_classified_as_the_point_files_say_and_counts_add_up(sweep):
    results, rows, points = rows_and_points(sweep[0])
    pick = results["samples"]["pick"]
    assert pick.startswith("alpha=") and results["samples"]["split"] == "report"
    assert {row["task"] for row in rows} == {*OLD, *NEW}
    for row in rows:
        right = [points[name][row["task"]]["correct"][row["key"]] for name in ("pre", "post", "pick")]
        assert row["scores"] == [int(value) for value in right] and row["models"] == ["pre", "post", pick]
        assert row["class"] == expected_class(*right)
        assert (
            row["outcome_post"]
            == {(1, 1): "kept", (1, 0): "forgotten", (0, 1): "gained", (0, 0): "never"}[right[0], right[1]]
        )
        assert (
            row["outcome_pick"]
            == {(1, 1): "kept", (1, 0): "forgotten", (0, 1): "gained", (0, 0): "never"}[right[0], right[2]]
        )
        assert row["answers"] == [
            points[name][row["task"]]["texts"][row["key"]]["answer"] for name in ("pre", "post", "pick")
        ]
    maps = {
        name: {entry["task"]: entry for entry in point["forgetting"]["tasks"]}
        for name, point in (
            ("post", results["post"]),
            ("pick", next(p for p in results["points"] if p["label"] == pick)),
        )
    }
    for task, docs in results["selection"]["docs"].items():
        mine = [row for row in rows if row["task"] == task]
        assert len(mine) == docs["selection"] + docs["report"] == len(points["pre"][task]["correct"])
        assert sum(row["split"] == "report" for row in mine) == docs["report"]
        assert [row["doc_id"] for row in mine] == sorted(row["doc_id"] for row in mine)
        counts = results["samples"]["counts"][task]
        report = [row for row in mine if row["split"] == "report"]
        assert counts == {name: sum(row["class"] == name for row in report) for name in counts}
        assert counts["recovered"] + counts["still_lost"] == maps["post"][task]["forgotten"]
        assert counts["still_lost"] + counts["newly_lost"] == maps["pick"][task]["forgotten"]
        assert counts["kept"] + counts["recovered"] == maps["pick"][task]["kept"]
        assert counts["kept"] + counts["newly_lost"] == maps["post"][task]["kept"]
    for group, tasks in (("old", OLD), ("new", NEW)):
        assert results["samples"]["groups"][group] == {
            name: sum(results["samples"]["counts"][task][name] for task in tasks)
            for name in results["samples"]["counts"][tasks[0]]
        }
    assert sum(counts["recovered"] for counts in results["samples"]["counts"].values()) > 0  # the toy pair forgets
    assert results["samples"]["without_text"] == 0


def chosen_option(line: dict) -> str:
    """Multiple choice: the option with the highest loglikelihood in lm-eval's record (acc's rule)."""
    lls = [float(resp[0][0]) for resp in line["resps"]]
    return line["arguments"][f"gen_args_{lls.index(max(lls))}"]["arg_1"]


def test_prompts_gold_and_answers_are_what_lm_eval_logs_for_pre_and_post(sweep, lm_eval_runs):
    """The sweep scores pre and post itself; lm-eval's own CLI on the same models and docs logs the same prompt,
    gold answer, answer and score for each doc."""
    _, rows, _ = rows_and_points(sweep[0])
    for task in (*OLD, *NEW):
        logged = []
        for folder in (lm_eval_runs.pre, lm_eval_runs.post):
            [path] = folder.glob(f"samples_{task}_*.jsonl")
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            chosen = FILTER if any(line["filter"] == FILTER for line in lines) else lines[0]["filter"]
            logged.append({line["doc_id"]: line for line in lines if line["filter"] == chosen})
        mine = [row for row in rows if row["task"] == task]
        assert sorted(row["doc_id"] for row in mine) == sorted(logged[0])
        for row in mine:
            pre, post = logged[0][row["doc_id"]], logged[1][row["doc_id"]]
            assert row["doc_hash"] == pre["doc_hash"] and row["prompt"] == pre["arguments"]["gen_args_0"]["arg_0"]
            generative = isinstance(pre["arguments"]["gen_args_0"]["arg_1"], dict)
            choice = pre["doc"]["choices"][pre["doc"]["label"]]
            assert row["gold"] == (choice if generative else " " + choice)
            assert row["completion"] == " " + choice
            answers = [line["filtered_resps"][0] if generative else chosen_option(line) for line in (pre, post)]
            assert row["answers"][:2] == answers
            assert row["scores"][:2] == [int(line[line["metrics"][0]]) for line in (pre, post)]


def test_report_shows_the_counts_and_examples_as_text(sweep):
    results, rows, _ = rows_and_points(sweep[0])
    report = (sweep[0] / "run" / "report.md").read_text()
    section = report[report.index(f"(report split, `{SAMPLES_FILE}`)") :]
    samples = results["samples"]
    for task, counts in samples["counts"].items():
        assert f"| {task} | {counts['recovered']} | {counts['still_lost']} | {counts['newly_lost']} |" in section
    for group, counts in samples["groups"].items():
        assert f"| **{group}** | {counts['recovered']} | {counts['still_lost']} | {counts['newly_lost']} |" in section
    by_doc = {(row["task"], row["doc_id"]): row for row in rows}
    for name, examples in samples["examples"].items():
        total = sum(counts[name] for counts in samples["counts"].values())
        assert len(examples) == min(total, 3) and f"- {name.replace('_', ' ')}: {total}\n" in section
        for example in examples:
            row = by_doc[example["task"], example["doc_id"]]
            assert row["class"] == name and row["split"] == "report"
            assert [example["gold"], example["post"], example["pick"]] == [row["gold"], *row["answers"][1:]]
            prompt = " ".join(row["prompt"].split())
            assert example["prompt"] == prompt or example["prompt"] == "..." + prompt[-157:]
            assert (
                f"  - {example['task']} doc {example['doc_id']}: `{example['prompt']}` gold `"
                f"{' '.join(row['gold'].split())}`, post `{' '.join(row['answers'][1].split())}`" in section
            )


def test_replay_holds_the_still_lost_docs_or_every_forgotten_one(sweep):
    root, first, again = sweep
    _, rows, _ = rows_and_points(root)
    still = [row for row in rows if row["class"] == "still_lost"]
    forgotten = [row for row in rows if row["outcome_post"] == "forgotten"]
    assert still and len(forgotten) > len(still)
    replay = read_jsonl(root / "replay.jsonl")
    assert [(record["task"], record["doc_id"]) for record in replay] == [(row["task"], row["doc_id"]) for row in still]
    assert all(
        record["completion"] == row["completion"]
        and record["prompt"] == row["prompt"]
        and record["completion"].strip() == row["gold"].strip()
        for record, row in zip(replay, still, strict=True)
    )
    assert f"replay: {len(still)} docs still lost by the pick written to {root / 'replay.jsonl'}; 0 left out" in first
    messages = read_jsonl(root / "all.jsonl")
    assert [(record["task"], record["doc_id"]) for record in messages] == [(r["task"], r["doc_id"]) for r in forgotten]
    assert all(
        record["messages"]
        == [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["gold"].strip()}]
        for record, row in zip(messages, forgotten, strict=True)
    )
    assert f"replay: {len(forgotten)} docs forgotten by post written to" in again


@pytest.mark.parametrize(
    "where, message",
    [
        ("existing", "already exists"),
        ("pre", "is inside the input"),
        ("run", "is inside the run folder"),
        ("best", "is inside --save-best"),
        ("flag-only", "give --replay FILE.jsonl"),
        ("methods", "give a single --method"),
    ],
)
def test_a_bad_replay_path_is_refused_before_any_work(sweep, toy_pair, lm_eval_runs, tmp_path, where, message):
    root = sweep[0]
    out = tmp_path / "run"
    replay = tmp_path / "replay.jsonl"
    args = {
        "existing": ["--replay", root / "replay.jsonl"],
        "pre": ["--replay", toy_pair.pre_dir / "replay.jsonl"],
        "run": ["--replay", out / "replay.jsonl"],
        "flag-only": ["--replay-all"],
        "best": ["--save-best", tmp_path / "best", "--replay", tmp_path / "best" / "replay.jsonl"],
        "methods": ["--method", "linear,task_arithmetic", "--replay", replay],
    }[where]
    result = sweep_cli(toy_pair, lm_eval_runs, out, *args)
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert not out.exists() and not (tmp_path / "best").exists() and not replay.exists()
    assert not (toy_pair.pre_dir / "replay.jsonl").exists()


def test_an_old_run_folder_resumes_with_null_texts(sweep, toy_pair, lm_eval_runs, tmp_path):
    """A run folder from before texts and samples.jsonl: its point files keep 0/1 outcomes only. Every point
    resumes, the classes are the same, the texts null, and --replay writes nothing and says how many it left out."""
    root = sweep[0]
    copy = tmp_path / "run"
    shutil.copytree(root / "run", copy)
    (copy / SAMPLES_FILE).unlink()
    for path in (copy / "points").glob("*.json"):
        point = json.loads(path.read_text())
        for task in point["tasks"]:
            task.pop("texts", None), task.pop("answer_rule", None)
        path.write_text(json.dumps(point) + "\n")
    results = json.loads((copy / "results.json").read_text())
    del results["samples"]
    (copy / "results.json").write_text(json.dumps(results))
    result = sweep_cli(toy_pair, lm_eval_runs, copy, "--replay", tmp_path / "replay.jsonl")
    assert result.exit_code == 0, result.output
    assert "evaluated 0 models, resumed 4" in result.stdout
    new, old = read_jsonl(root / "run" / SAMPLES_FILE), read_jsonl(copy / SAMPLES_FILE)
    text = ("prompt", "gold", "answers", "answer_rule", "completion")
    assert [{k: v for k, v in row.items() if k not in text} for row in new] == [
        {k: v for k, v in row.items() if k not in text} for row in old
    ]
    assert all(
        row["prompt"] is row["gold"] is row["completion"] is row["answer_rule"] is None and row["answers"] == [None] * 3
        for row in old
    )
    still = sum(row["class"] == "still_lost" for row in old)
    assert (tmp_path / "replay.jsonl").read_text() == ""
    assert (
        f"replay: 0 docs still lost by the pick written to {tmp_path / 'replay.jsonl'}; {still} left out"
        in result.stderr
    )
    samples = json.loads((copy / "results.json").read_text())["samples"]
    assert samples["counts"] == json.loads((root / "run" / "results.json").read_text())["samples"]["counts"]
    assert samples["without_text"] == sum(row["split"] == "report" for row in old)
    report = (copy / "report.md").read_text()
    assert "gold ?, post ?, pick ?" in report and "points saved before they were kept" in report
