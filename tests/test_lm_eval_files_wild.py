"""`mergekit-lite forgetting` on lm-eval outputs as users have them, every file written by lm-eval 0.4.13's own CLI
in this test run (fixture `wild_runs`): loglikelihood and loglikelihood_rolling tasks (perplexity), corpus metrics
(bleu, brier_score), repeats under two filters, a task with num_fewshot, an lm-eval group of two tasks,
--predict_only, a second run in the same output folder over other docs (--samples) and other few-shot settings,
and the layouts older lm-eval releases wrote (records without `filter`/`metrics`; results.json with JSON-array
sample files). Expected numbers come from lm-eval's own aggregates (results_*.json) and from the paper's
definitions recomputed from the raw lines (`paper_numbers`, as the official post-forget code's create_csv.py
and create_pivot_table define them)."""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import once_per_run
from lm_eval_tasks import EXACT_MATCH, TWO_FILTERS, _base, lm_eval_arguments, samples_folder, write_tasks
from test_lm_eval_outputs import SHARES, paper_numbers, samples_file
from test_safety import cli, one_error_line

from mergekit_lite.evaluate.outcomes import Scoring, load_lm_eval_run

pytestmark = pytest.mark.slow

MC = {"output_type": "multiple_choice", "doc_to_choice": "choices", "doc_to_target": "label"}
GENERATE = {
    "output_type": "generate_until",
    "doc_to_target": "{{choices[label]}}",
    "generation_kwargs": {"until": ["\n"], "max_gen_toks": 2, "do_sample": False},
}
# the 0/1 metric each task also logs, beside a first metric lm-eval does not score 0/1 per sample
ALTERNATIVE = {"ll_target": "acc", "gen_bleu": "exact_match", "mc_brier": "acc"}
LIMIT = 8
FLEX = "flexible-extract"
RESAMPLED = list(range(1, 2 * LIMIT, 2))  # as many docs as --limit, other ones


def metrics(*names: str) -> list[dict]:
    return [{"metric": name} for name in names]


def wild_configs(data_file: Path) -> dict[str, dict]:
    """Task shapes users run, over the toy pair's old-skill docs."""
    return {
        "ll_target": {
            **_base("ll_target", data_file),
            "output_type": "loglikelihood",
            "doc_to_target": " {{choices[label]}}",
            "metric_list": metrics("perplexity", "acc"),
        },
        "rolling": {
            **_base("rolling", data_file),
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{question}} {{choices[label]}}",
            "metric_list": metrics("word_perplexity", "byte_perplexity", "bits_per_byte"),
        },
        "gen_bleu": {**_base("gen_bleu", data_file), **GENERATE, "metric_list": metrics("bleu", "exact_match")},
        "mc_brier": {**_base("mc_brier", data_file), **MC, "metric_list": metrics("brier_score", "acc")},
        "gen_repeat": {
            **_base("gen_repeat", data_file),
            **GENERATE,
            "repeats": 3,
            "metric_list": EXACT_MATCH,
            "filter_list": [
                {
                    "name": "maj",
                    "filter": [
                        {"function": "regex", "regex_pattern": r"(\w+)"},
                        {"function": "majority_vote"},
                        {"function": "take_first"},
                    ],
                },
                TWO_FILTERS[1],
            ],
        },
        "fewshot_old": {
            **_base("fewshot_old", data_file),
            **MC,
            "num_fewshot": 2,
            "fewshot_split": "test",
            "metric_list": metrics("acc", "acc_norm"),
        },
        "wild_group": {
            "group": "wild_group",
            "task": ["toy_old", "toy_new"],
            "aggregate_metric_list": [{"metric": "acc", "aggregation": "mean", "weight_by_size": True}],
        },
    }


def lm_eval_cli(model: Path, tasks: str, include_path: Path, output: Path, *options: str) -> Path:
    """lm-eval's CLI with `options` (--limit, --samples, --predict_only, ...); returns the model folder it wrote
    (lm-eval's escaped model name). A process of its own: lm-eval bootstraps the stderr of perplexity and bleu in
    a multiprocessing pool, whose fork from a process that already ran torch can hang."""
    argv = [sys.executable, "-m", "lm_eval", *lm_eval_arguments(model, tasks, include_path, output, *options)]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stderr[-3000:]
    return samples_folder(output)


@dataclass(frozen=True)
class WildRuns:
    pre: Path
    post: Path
    predict_only: Path  # pre, --predict_only
    rerun: Path  # post again: toy_old on other docs (--samples), toy_new 2-shot


TASKS = "ll_target,rolling,gen_bleu,mc_brier,gen_repeat,fewshot_old,wild_group,gen_old"


@pytest.fixture(scope="session")
def wild_runs(toy_pair, tmp_path_factory) -> WildRuns:
    def build(root: Path) -> WildRuns:
        include = write_tasks(toy_pair.task_dir, root / "tasks")
        for name, config in wild_configs(Path(toy_pair.task_dir).resolve() / "toy_old.jsonl").items():
            (include / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        limit = ("--limit", str(LIMIT))
        resampled = json.dumps({"toy_old": RESAMPLED, "toy_new": list(range(LIMIT))})
        return WildRuns(
            lm_eval_cli(toy_pair.pre_dir, TASKS, include, root / "pre", *limit),
            lm_eval_cli(toy_pair.post_dir, TASKS, include, root / "post", *limit),
            lm_eval_cli(
                toy_pair.pre_dir, "toy_old,gen_old", include, root / "predict", "--limit", "4", "--predict_only"
            ),
            lm_eval_cli(
                toy_pair.post_dir,
                "toy_old,toy_new",
                include,
                root / "rerun",
                "--samples",
                resampled,
                "--num_fewshot",
                "2",
            ),
        )

    return once_per_run(tmp_path_factory, "lm_eval_wild", build)


def forgetting_json(*args) -> tuple[dict, str]:
    result = cli("forgetting", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def lm_eval_aggregates(folder: Path) -> dict:
    [results] = folder.glob("results_*.json")
    return json.loads(results.read_text())["results"]


def test_every_0_1_score_is_the_mean_lm_eval_reports(wild_runs):
    """repeats under two filters, few-shot acc and acc_norm, and the 0/1 metric beside a corpus metric: our
    per-sample scoring averages to lm-eval's aggregate for every (metric, filter)."""
    for folder in (wild_runs.pre, wild_runs.post):
        aggregates = lm_eval_aggregates(folder)
        for task, metric, filter_ in [
            ("gen_repeat", "exact_match", "maj"),
            ("gen_repeat", "exact_match", FLEX),
            ("fewshot_old", "acc", "none"),
            ("fewshot_old", "acc_norm", "none"),
            *((task, metric, "none") for task, metric in ALTERNATIVE.items()),
        ]:
            run = load_lm_eval_run(folder, Scoring.from_specs([f"{task}={metric}"], [f"{task}={filter_}"]))
            [outcomes] = run.outcomes[task].values()
            assert len(outcomes.correct) == LIMIT and outcomes.num_fewshot == (2 if task == "fewshot_old" else 0)
            assert outcomes.accuracy == pytest.approx(aggregates[task][f"{metric},{filter_}"]), (task, metric, filter_)


def test_the_model_is_lm_evals_name_for_it_not_the_escaped_folder(wild_runs):
    """lm-eval names the folder after the model path with "/" escaped as "__"; the model is its model_name."""
    for folder in (wild_runs.pre, wild_runs.post):
        [results] = folder.glob("results_*.json")
        model = json.loads(results.read_text())["model_name"]
        assert "/" in model and folder.name == model.replace("/", "__")
        assert load_lm_eval_run(folder).model == model


def raw_scores(folder: Path, task: str, metric: str | None = None, filter_: str | None = None) -> dict:
    """doc_hash -> the 0/1 value of `metric` (default: the first the record lists) under `filter_` (default: the
    first logged), read from the raw lines of lm-eval's samples file."""
    lines = [json.loads(line) for line in samples_file(folder, task).read_text().splitlines()]
    chosen = filter_ or lines[0]["filter"]
    return {line["doc_hash"]: line[metric or line["metrics"][0]] for line in lines if line["filter"] == chosen}


def test_metrics_lm_eval_does_not_score_0_1_per_sample_are_skipped_in_one_line_each(wild_runs):
    """perplexity (a loglikelihood per sample), word_perplexity, bleu and brier_score (what lm-eval keeps per
    sample for a corpus-level score) are never thresholded: each task is skipped with one warning line naming the
    0/1 metric it also logs, and scored when it is chosen."""
    payload, stderr = forgetting_json(wild_runs.pre, wild_runs.post)
    skipped = {entry["task"]: entry["reason"] for entry in payload["skipped"]}
    assert sorted(skipped) == ["gen_bleu", "ll_target", "mc_brier", "rolling"]
    for task, metric in ALTERNATIVE.items():
        assert f"--metric {task}={metric}" in skipped[task]
    assert "'word_perplexity' is a per-sample pair" in skipped["rolling"] and "--metric" in skipped["rolling"]
    assert len([line for line in stderr.splitlines() if line.startswith("warning: ")]) == 4
    chosen = [argument for task, metric in ALTERNATIVE.items() for argument in ("--metric", f"{task}={metric}")]
    payload, _ = forgetting_json(wild_runs.pre, wild_runs.post, *chosen, "--choices", "ll_target=4")
    rows = {row["task"]: row for row in payload["tasks"]}
    assert [entry["task"] for entry in payload["skipped"]] == ["rolling"]
    for task, k in (("ll_target", 4), ("gen_bleu", None), ("mc_brier", 4), ("gen_repeat", None), ("fewshot_old", 4)):
        sides = (wild_runs.pre, wild_runs.post)
        expected = paper_numbers(*(raw_scores(side, task, ALTERNATIVE.get(task)) for side in sides), k)
        assert rows[task]["n"] == LIMIT
        for share in SHARES:
            assert rows[task][share] == pytest.approx(expected[share]), (task, share)


def test_an_lm_eval_group_names_its_subtasks_and_is_the_mean_of_their_values(wild_runs):
    """--group old=wild_group: the tasks lm-eval's results list under the group (group_subtasks), their values
    averaged unweighted (official create_pivot_table), not lm-eval's size-weighted group aggregate."""
    payload, _ = forgetting_json(wild_runs.pre, wild_runs.post, "--group", "old=wild_group", "--group", "few=fewshot_*")
    groups = {group["group"]: group for group in payload["groups"]}
    assert groups["old"]["tasks"] == ["toy_new", "toy_old"] and groups["few"]["tasks"] == ["fewshot_old"]
    expected = [
        paper_numbers(raw_scores(wild_runs.pre, task), raw_scores(wild_runs.post, task), 4)
        for task in ("toy_old", "toy_new")
    ]
    for share in SHARES:
        assert groups["old"][share] == pytest.approx((expected[0][share] + expected[1][share]) / 2)
    result = cli("forgetting", wild_runs.pre, wild_runs.post, "--group", "old=no_such_group")
    one_error_line(result, 2, "'no_such_group' matches no task")


def test_predict_only_outputs_are_one_error_line(wild_runs):
    one_error_line(cli("forgetting", wild_runs.predict_only, wild_runs.post), 2, "--predict_only")


def test_a_second_run_in_the_same_folder_wins_and_what_it_changed_is_skipped(wild_runs, tmp_path):
    """lm-eval writes a rerun of the model into the same folder under a newer timestamp: its tasks replace the
    first run's. toy_old now holds as many docs as before but other ones (the official code would pair them by
    prompt); toy_new was run 2-shot. Both are skipped, the first run's other tasks compared."""
    post = tmp_path / wild_runs.post.name
    shutil.copytree(wild_runs.post, post)
    for file in wild_runs.rerun.iterdir():
        shutil.copy(file, post / file.name)
    payload, stderr = forgetting_json(wild_runs.pre, post, "--group", "old=wild_group,gen_old")
    skipped = {entry["task"]: entry["reason"] for entry in payload["skipped"]}
    assert f"samples differ (pre {LIMIT}, post {LIMIT}; {LIMIT // 2} only in pre" in skipped["toy_old"]
    assert skipped["toy_new"].startswith("scored otherwise (num_fewshot 0 in pre, 2 in post)")
    assert "gen_old" in {row["task"] for row in payload["tasks"]} and payload["groups"][0]["tasks"] == ["gen_old"]
    assert "warning: task 'toy_new' skipped" in stderr
    one_error_line(
        cli("forgetting", wild_runs.pre, wild_runs.rerun),
        2,
        "no task could be compared",
        "toy_old \\(samples differ",
        "toy_new \\(scored otherwise",
    )


def test_results_without_per_sample_logs_are_one_error_line(wild_runs, tmp_path):
    for file in wild_runs.pre.glob("results_*.json"):
        shutil.copy(file, tmp_path / file.name)
    one_error_line(cli("forgetting", tmp_path, wild_runs.post), 2, "without per-sample logs", "--log_samples")


def legacy_record(record: dict, layout: str) -> dict:
    """One record as older lm-eval logged it: before v0.4.7 without `filter` and `metrics` (evaluator.py of
    v0.4.3-v0.4.6), before v0.4.3 also without the hashes and with `arguments` as a list of argument lists
    (evaluator.py of v0.4.0-v0.4.2)."""
    record = {key: value for key, value in record.items() if key not in ("filter", "metrics")}
    if layout == "0.4.2":
        record = {key: value for key, value in record.items() if not key.endswith("_hash")}
        record["arguments"] = [list(request.values()) for request in record["arguments"].values()]
    return record


def write_legacy(folder: Path, target: Path, layout: str) -> Path:
    """lm-eval 0.4.13's files of one run rewritten in an older layout: v0.4.3-v0.4.6 kept the file names; v0.4.0-
    v0.4.2 wrote results.json and <model_args, "/" and "=" as "__">_<task>.jsonl, a JSON array (its __main__.py)."""
    target.mkdir(parents=True)
    [results_path] = folder.glob("results_*.json")
    results = json.loads(results_path.read_text())
    model_args = f"pretrained={results['model_name']},dtype=float32"
    for path in folder.glob("samples_*.jsonl"):
        records = [legacy_record(json.loads(line), layout) for line in path.read_text().splitlines()]
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        if layout == "0.4.2":
            (target / f"{re.sub('/|=', '__', model_args)}_{task}.jsonl").write_text(json.dumps(records, indent=2))
        else:
            (target / path.name).write_text("".join(json.dumps(record) + "\n" for record in records))
    if layout == "0.4.2":
        results["config"] = {"model": "hf", "model_args": model_args}  # no seeds recorded before v0.4.3
        results_path = target / "results.json"
    (target / results_path.name).write_text(json.dumps(results))
    return target


@pytest.mark.parametrize("layout", ["0.4.5", "0.4.2"])
def test_older_lm_eval_layouts_score_like_the_files_they_came_from(wild_runs, tmp_path, layout):
    """Records without filter names: a doc's i-th record is the i-th filter of the task config (gen_old logs
    strict-match then flexible-extract), not a second doc; every filter still selectable."""
    pre, post = (
        write_legacy(folder, tmp_path / side, layout)
        for folder, side in ((wild_runs.pre, "pre"), (wild_runs.post, "post"))
    )
    for options in ([], ["--filter", FLEX]):
        legacy, _ = forgetting_json(pre, post, *options)
        current, _ = forgetting_json(wild_runs.pre, wild_runs.post, *options)
        assert legacy["tasks"] == current["tasks"]
        assert [entry["task"] for entry in legacy["skipped"]] == [entry["task"] for entry in current["skipped"]]
    assert load_lm_eval_run(pre).outcomes["gen_old"].keys() == ({"-"} if layout == "0.4.2" else {"0/1234/1234/1234"})
