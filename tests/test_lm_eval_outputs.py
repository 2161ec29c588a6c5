"""The forgetting map and the sweep on files lm-eval itself writes (its CLI with --log_samples, run once per
model in the session fixture `lm_eval_runs`), for tasks of every output type: multiple_choice, an
acc_norm-only multiple choice, generate_until with two filters (gsm8k-style) and generative multiple choice.

The paper's numbers ("Mapping Post-Training Forgetting in Language Models at Scale", §2 and the official
code's category means) are recomputed here in plain Python from the raw jsonl lines and compared."""

import json
import math
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_safety import cli

from mergekit_lite.cli.main import main
from mergekit_lite.evaluate.outcomes import Scoring, load_lm_eval_run

pytestmark = pytest.mark.slow

OLD = ["toy_old", "norm_old", "gen_old", "genmc_old"]
NEW = ["toy_new", "gen_new"]
SHARES = ("F", "BT", "F_true", "BT_true", "F_max", "BT_max")


def forgetting_json(*args):
    result = CliRunner().invoke(main, ["forgetting", *map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result.stderr


def samples_file(folder: Path, task: str) -> Path:
    [path] = folder.glob(f"samples_{task}_*.jsonl")
    return path


def raw_outcomes(path: Path, wanted_filter: str) -> tuple[dict, float | None]:
    """doc_hash -> 0/1 of the task's one metric under a filter, and k (None: free-form), from the raw lines."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    filters = [line["filter"] for line in lines]
    chosen = wanted_filter if wanted_filter in filters else filters[0]
    lines = [line for line in lines if line["filter"] == chosen]
    metric = lines[0]["metrics"][0]
    first_argument = lines[0]["arguments"]["gen_args_0"]
    if isinstance(first_argument["arg_1"], dict):  # generate_until: k from the doc's choices, if any
        k = len(lines[0]["doc"]["choices"]) if "genmc" in path.name else None
    else:
        k = len(lines[0]["arguments"])
    return {line["doc_hash"]: line[metric] for line in lines}, k


def paper_numbers(pre: dict, post: dict, k: float | None) -> dict:
    """Paper §2: F, BT, chance terms, F_true, BT_true and the ceilings F_max = a_pre_true, BT_max = a_post_true."""
    n = len(pre)
    forgotten = sum(1 for key in pre if pre[key] == 1 and post[key] == 0)
    gained = sum(1 for key in pre if pre[key] == 0 and post[key] == 1)
    a_pre, a_post = sum(pre.values()) / n, sum(post.values()) / n
    chance = 0.0 if k is None else (1 - a_pre) / (k - 1) * (1 - a_post)
    true = (lambda a: a) if k is None else (lambda a: max((k * a - 1) / (k - 1), 0))
    return {
        "F": forgotten / n,
        "BT": gained / n,
        "F_true": max(forgotten / n - chance, 0),
        "BT_true": max(gained / n - chance, 0),
        "F_max": true(a_pre),
        "BT_max": true(a_post),
    }


def test_every_score_equals_what_lm_eval_aggregates(lm_eval_runs):
    """Each (metric, filter) lm-eval reports in results_*.json is the mean of our per-sample scoring."""
    for folder in (lm_eval_runs.pre, lm_eval_runs.post):
        [results_file] = folder.glob("results_*.json")
        results = json.loads(results_file.read_text())["results"]
        checked = 0
        for task in lm_eval_runs.tasks:
            for key, value in results[task].items():
                if "," not in key or "_stderr" in key:
                    continue
                metric, filter_ = key.split(",")
                run = load_lm_eval_run(folder, Scoring.from_specs([f"{task}={metric}"], [f"{task}={filter_}"]))
                [outcomes] = run.outcomes[task].values()
                assert len(outcomes.correct) == lm_eval_runs.limit
                assert outcomes.accuracy == pytest.approx(value), (folder.name, task, key)
                checked += 1
        assert checked == len(lm_eval_runs.tasks) + 2  # gen_old and gen_new each log two filters
    k = {
        task: next(iter(outcomes.values())).n_choices
        for task, outcomes in load_lm_eval_run(lm_eval_runs.pre).outcomes.items()
    }
    assert k == {"toy_old": 4, "toy_new": 4, "norm_old": 4, "genmc_old": 4, "gen_old": math.inf, "gen_new": math.inf}


def test_forgetting_cli_matches_the_paper_computed_independently(lm_eval_runs):
    payload, _ = forgetting_json(
        lm_eval_runs.pre,
        lm_eval_runs.post,
        "--filter",
        "flexible-extract",
        "--group",
        "old=" + ",".join(OLD),
        "--group",
        "new=" + ",".join(NEW),
    )
    rows = {row["task"]: row for row in payload["tasks"]}
    assert sorted(rows) == sorted(OLD + NEW) and payload["skipped"] == []
    assert rows["norm_old"]["metric"] == "acc_norm" and rows["gen_new"]["metric"] == "exact_match/flexible-extract"
    expected = {}
    for task in OLD + NEW:
        pre, k = raw_outcomes(samples_file(lm_eval_runs.pre, task), "flexible-extract")
        post, _ = raw_outcomes(samples_file(lm_eval_runs.post, task), "flexible-extract")
        expected[task] = paper_numbers(pre, post, k)
        for share in SHARES:
            assert rows[task][share] == pytest.approx(expected[task][share]), (task, share)
    assert rows["toy_old"]["F_true"] > 0.2 and rows["gen_new"]["BT_true"] > 0.2  # the pair forgets and learns
    groups = {group["group"]: group for group in payload["groups"]}
    for name, tasks in (("old", OLD), ("new", NEW)):
        for share in SHARES:  # official create_pivot_table: the category value is the mean of its tasks'
            assert groups[name][share] == pytest.approx(sum(expected[t][share] for t in tasks) / len(tasks))


def test_filter_and_metric_can_be_chosen_per_task(lm_eval_runs):
    strict, _ = forgetting_json(lm_eval_runs.pre, lm_eval_runs.post)
    flexible, _ = forgetting_json(lm_eval_runs.pre, lm_eval_runs.post, "--filter", "gen_old=flexible-extract")
    strict_row, flexible_row = (
        {row["task"]: row for row in payload["tasks"]}["gen_old"] for payload in (strict, flexible)
    )
    assert strict_row["metric"] == "exact_match/strict-match" and strict_row["acc_pre"] == 0  # 2 words never match
    assert flexible_row["acc_pre"] > 0.9
    result = CliRunner().invoke(
        main, ["forgetting", str(lm_eval_runs.pre), str(lm_eval_runs.post), "--metric", "toy_old=acc_norm"]
    )
    assert result.exit_code == 2 and "no metric 'acc_norm'" in result.stderr


def test_a_folder_holding_several_models_is_an_error_naming_them(lm_eval_runs):
    root = lm_eval_runs.pre.parent.parent
    result = CliRunner().invoke(main, ["forgetting", str(root), str(lm_eval_runs.post)])
    assert result.exit_code == 2
    assert "holds samples of 2 models" in result.stderr
    assert str(lm_eval_runs.pre) in result.stderr and str(lm_eval_runs.post) in result.stderr


def test_a_misaligned_task_is_skipped_and_listed(lm_eval_runs, tmp_path):
    post = tmp_path / "post"
    shutil.copytree(lm_eval_runs.post, post)
    truncated = samples_file(post, "toy_new")
    truncated.write_text("".join(truncated.read_text().splitlines(keepends=True)[:-1]))
    payload, stderr = forgetting_json(lm_eval_runs.pre, post)
    assert payload["skipped"] == [{"task": "toy_new", "reason": payload["skipped"][0]["reason"]}]
    assert "samples differ (pre 32, post 31" in payload["skipped"][0]["reason"]
    assert "warning: task 'toy_new' skipped" in stderr
    assert len(payload["tasks"]) == len(lm_eval_runs.tasks) - 1


def add_seed(source: Path, target: Path, stamp: str, seed: int, flip_task: str | None = None, flips: int = 0):
    """Another run of the model in `target`: lm-eval's files under a new timestamp whose results json records
    another seed; optionally `flips` outcomes of one task changed, as a different sampling seed could."""
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        old_stamp = path.name.rsplit("_", 1)[1].removesuffix(".jsonl").removesuffix(".json")
        name = path.name.replace(old_stamp, stamp)
        if path.name.startswith("results_"):
            results = json.loads(path.read_text())
            results["config"].update(random_seed=seed, numpy_seed=seed, torch_seed=seed, fewshot_seed=seed)
            (target / name).write_text(json.dumps(results))
            continue
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        if flip_task and path.name.startswith(f"samples_{flip_task}_"):
            for line in lines[:flips]:
                line["acc"] = 1 - line["acc"]
        (target / name).write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_seeds_are_compared_seed_by_seed_and_averaged(lm_eval_runs, tmp_path):
    pre, post = tmp_path / "pre", tmp_path / "post"
    for source, target in ((lm_eval_runs.pre, pre), (lm_eval_runs.post, post)):
        shutil.copytree(source, target)
    add_seed(lm_eval_runs.pre, pre, "2030-01-01T00-00-00.000001", 7)
    add_seed(lm_eval_runs.post, post, "2030-01-01T00-00-00.000001", 7, flip_task="toy_old", flips=6)
    payload, _ = forgetting_json(pre, post, "--group", "old=toy_old,norm_old")
    assert payload["seeds"] == ["0/1234/1234/1234", "7"]
    row = {row["task"]: row for row in payload["tasks"]}["toy_old"]
    per_seed = []
    pre_values, k = raw_outcomes(samples_file(lm_eval_runs.pre, "toy_old"), "none")
    for post_file in sorted(post.glob("samples_toy_old_*.jsonl")):
        per_seed.append(paper_numbers(pre_values, raw_outcomes(post_file, "none")[0], k))
    assert per_seed[0] != per_seed[1] and row["seeds"] == 2
    for share in SHARES:
        assert row[share] == pytest.approx((per_seed[0][share] + per_seed[1][share]) / 2)
    norm = paper_numbers(
        *[raw_outcomes(samples_file(side, "norm_old"), "none")[0] for side in (lm_eval_runs.pre, lm_eval_runs.post)], 4
    )
    [old] = payload["groups"]
    assert old["F_true"] == pytest.approx(sum((seed["F_true"] + norm["F_true"]) / 2 for seed in per_seed) / 2)


def test_sweep_cli_end_to_end_on_a_gsm8k_style_task_scores_like_the_lm_eval_files(toy_pair, lm_eval_runs, tmp_path):
    """`mergekit-lite sweep` with a generate_until task (two filters) as the new skill and an acc_norm-only old
    task: it runs lm-eval in-process; its pre/post outcomes must equal what the forgetting map reads from
    lm-eval's CLI files."""
    out = tmp_path / "run"
    done = cli(
        "sweep",
        "--pre",
        toy_pair.pre_dir,
        "--post",
        toy_pair.post_dir,
        "--alphas",
        "0.5",
        "--old-tasks",
        "toy_old,genmc_old,norm_old",
        "--new-tasks",
        "gen_new",
        "--filter",
        "gen_new=flexible-extract",
        "--include-path",
        lm_eval_runs.include_path,
        "--limit",
        lm_eval_runs.limit,
        "--bootstrap",
        "200",
        "--out",
        out,
        "--quiet",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    scoring = Scoring.from_specs([], ["gen_new=flexible-extract"])
    for label, folder in (("pre", lm_eval_runs.pre), ("post", lm_eval_runs.post)):
        point = json.loads((out / "points" / f"{label}.json").read_text())
        from_files = load_lm_eval_run(folder, scoring).outcomes
        for task in point["tasks"]:
            [outcomes] = from_files[task["task"]].values()
            assert task["correct"] == outcomes.correct and task["filter"] == outcomes.filter, (label, task["task"])
            assert (task["n_choices"] or math.inf) == outcomes.n_choices  # k = 4 for genmc_old, inf for gen_new
    assert results["post"]["tasks"]["gen_new"]["filter"] == "flexible-extract"
    assert results["post"]["tasks"]["norm_old"]["metric"] == "acc_norm"
    assert results["post"]["new"] > results["pre"]["new"]
    docs = results["selection"]["docs"]
    assert all(
        split["selection"] + split["report"] == lm_eval_runs.limit and min(split.values()) > 0
        for split in docs.values()
    )
    pick = results["pick"]
    assert pick["selection_harmonic_mean"] == max(p["selection"]["harmonic_mean"] for p in results["points"])
    for point in results["points"]:
        low, high = point["intervals"]["harmonic_mean"]
        assert low <= point["harmonic_mean"] <= high
    report = (out / "report.md").read_text()
    assert "selection split" in report and "Indistinguishable from the pick" in report
    assert (out / "forgetting_map.png").stat().st_size > 0
    assert "indistinguishable from the pick" in done.stdout
