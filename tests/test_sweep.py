"""The alpha sweep: grid parsing, the pick, RECALL re-weighting, and end to end on the toy pair
(interior alpha recovers the old skill, report files agree, resume, lock, settings check, CLI)."""

import dataclasses
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from open_files import closes_what_it_opens
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.forgetting import aggregate, compare
from mergekit_lite.evaluate.outcomes import SampleOutcomes
from mergekit_lite.io.outputs import OUTPUT_MARKER
from mergekit_lite.merge.recall import layer_weights
from mergekit_lite.sweep import PointResult, SweepSettings, load_sweep_file, run_sweep
from mergekit_lite.sweep.evaluator import MERGE_TEMP
from mergekit_lite.sweep.result import pareto_front, pick
from mergekit_lite.sweep.scoring import Scores, TaskRun, group_scores
from mergekit_lite.sweep.settings import parse_alphas
from mergekit_lite.sweep.store import LOCK_FILE, point_file

pytestmark = pytest.mark.slow

ALPHAS = [0.0, 0.25, 0.5, 0.75, 1.0]
TABLE_ROW = re.compile(r"^\| (pre|post|[-0-9.e]+) \| ")


def settings_for(pair, out, **changes) -> SweepSettings:
    options = {"limit": None, **changes}
    return SweepSettings(
        pair.pre_dir,
        pair.post_dir,
        options.pop("method", "linear"),
        options.pop("alphas", ALPHAS),
        pair.old_tasks,
        pair.new_tasks,
        pair.task_dir,
        out,
        **options,
    )


def test_the_shared_linear_sweep_is_this_files_settings(toy_pair, linear_sweep):
    """`linear_sweep` (tests/conftest.py, one per test run) is the sweep `settings_for` describes."""
    assert linear_sweep.settings == settings_for(toy_pair, linear_sweep.out)


def test_parse_alphas_ranges_lists_and_errors():
    assert parse_alphas("0:1:0.25") == ALPHAS
    grid = parse_alphas("0:1:0.1")
    assert len(grid) == 11 and 0.3 in grid and grid[-1] == 1.0
    assert parse_alphas("0.5, 0,0.5") == [0.0, 0.5]
    assert parse_alphas([1, 0.5]) == [0.5, 1.0]
    for bad in ("0:1", "1:0:0.1", "0:1:0", "a,b", "", [True]):
        with pytest.raises(InputError):
            parse_alphas(bad)


def test_with_temperature_equals_computing_at_that_temperature():
    torch.manual_seed(0)
    representations = [torch.randn(3, 6, 8) + shift for shift in (0.0, 0.3, 1.0)]
    similarity, sharp = layer_weights(representations, -1, 0.1)
    _, soft = layer_weights(representations, -1, 2.0)
    from mergekit_lite.merge.recall import RecallWeights

    weights = RecallWeights(["a", "b", "c"], 2, 0.1, similarity, sharp, [0, 1])
    rescaled = weights.with_temperature(2.0)
    assert rescaled.temperature == 2.0 and rescaled.similarity == similarity
    assert torch.allclose(torch.tensor(rescaled.weights, dtype=torch.float64), torch.tensor(soft, dtype=torch.float64))
    assert weights.weights == sharp  # the original is unchanged
    with pytest.raises(InputError):
        weights.with_temperature(0.0)


def point(alpha, old, new):
    hm = 0.0 if old + new == 0 else 2 * old * new / (old + new)
    return PointResult(f"alpha={alpha}", alpha, [], Scores(old, new, hm), Scores(old, new, hm))


def test_pick_reports_ties_and_pareto_front():
    points = [
        point(0.0, 1.0, 0.2),
        point(0.25, 0.9, 0.6),
        point(0.5, 0.6, 0.9),
        point(0.75, 0.5, 0.9),
        point(1.0, 0.2, 1.0),
    ]
    best, ties = pick(points)
    assert best.alpha == 0.25 and ties == [0.25, 0.5]  # 0.9/0.6 and 0.6/0.9 have the same harmonic mean
    assert pareto_front(points) == [0.0, 0.25, 0.5, 1.0]  # 0.75 is beaten by 0.5 on old, equal on new


@pytest.mark.parametrize("aggregation", ["paper", "pooled"])
def test_sweep_scores_aggregate_tasks_as_the_forgetting_map_does(aggregation):
    """A 4-doc and a 100-doc task: the sweep's old score is the map's group accuracy under the same rule
    (paper: the unweighted task mean, (3/4 + 8/100) / 2; pooled: 11 of all 104 docs), not a rule of its own."""

    def outcomes(task, n, right):
        return SampleOutcomes(task, {f"{task}{i}": i < right for i in range(n)}, 4)

    old = [outcomes("small", 4, 3), outcomes("large", 100, 8)]
    new = outcomes("new", 10, 5)
    runs = [TaskRun(o.task, "old", o) for o in old] + [TaskRun("new", "new", new)]
    scores = group_scores(runs, {o.task: list(o.correct) for o in [*old, new]}, aggregation)
    flat = [SampleOutcomes(o.task, dict.fromkeys(o.correct, False), 4) for o in old]  # pre: all wrong
    group = aggregate([compare(pre, post) for pre, post in zip(flat, old, strict=True)], "old", aggregation)
    assert scores.old == pytest.approx(group.acc_post)
    assert scores.old == pytest.approx(0.415 if aggregation == "paper" else 11 / 104)
    assert scores.new == 0.5


def test_settings_are_checked_before_any_model_is_read(tmp_path):
    common = (["old"], ["new"], None, tmp_path / "run")
    with pytest.raises(InputError, match="alpha must be in"):
        SweepSettings("pre", "post", "linear", [0.5, 1.5], *common)
    with pytest.raises(InputError, match="temperature"):
        SweepSettings("pre", "post", "recall", [0.0, 1.0], *common, recall_texts="texts.txt")
    with pytest.raises(InputError, match="recall-texts"):
        SweepSettings("pre", "post", "recall", [0.5], *common)
    with pytest.raises(InputError, match="'model_stock' has no coefficient to sweep"):
        SweepSettings("pre", "post", "model_stock", [0.5], *common)
    with pytest.raises(InputError, match="both an old and a new task"):
        SweepSettings("pre", "post", "linear", [0.5], ["a,b"], ["b"], None, tmp_path / "run")
    with pytest.raises(InputError, match="density"):
        SweepSettings("pre", "post", "linear", [0.5], *common, density=0.5)
    config = tmp_path / "sweep.yaml"
    config.write_text("pre: a\nalpha: 0.5\n")
    with pytest.raises(InputError, match="unknown key 'alpha'"):
        load_sweep_file(config)


def test_sweep_finds_an_interior_alpha_that_recovers_the_old_skill(linear_sweep):
    result = linear_sweep
    pre, post, best = result.pre, result.post, result.best
    assert pre.old > post.old and post.new > pre.new  # the toy pair forgets
    assert 0 < best.alpha < 1
    assert best.old > post.old and best.new > pre.new
    assert best.harmonic_mean > max(pre.harmonic_mean, post.harmonic_mean)
    assert result.recovered > 0
    assert post.groups["old"].F_true > best.groups["old"].F_true
    assert best.alpha in result.pareto


def parse_report_table(text: str) -> dict[str, list[float]]:
    """label -> [HM (selection), old, new, HM, lows and highs of their intervals, F_true(old), BT_true(new)]."""
    rows = {}
    for line in text.splitlines():
        match = TABLE_ROW.match(line)
        if match:
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            numbers = [float(value) for value in re.findall(r"[-+]?[0-9]+\.[0-9]+", " ".join(cells[1:5]))]
            rows[match[1]] = numbers + [float(cells[6]), float(cells[7])]
    return rows


def json_row(data: dict) -> list[float]:
    groups, intervals = data["forgetting"]["groups"], data["intervals"]
    return [
        data["selection"]["harmonic_mean"],
        *[value for key in ("old", "new", "harmonic_mean") for value in (data[key], *intervals[key])],
        groups["old"]["F_true"],
        groups["new"]["BT_true"],
    ]


def test_report_md_and_results_json_agree(linear_sweep):
    folder = linear_sweep.out
    results = json.loads((folder / "results.json").read_text())
    report = (folder / "report.md").read_text()
    assert (folder / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = parse_report_table(report)
    expected = {"pre": results["pre"], "post": results["post"], **{repr(p["alpha"]): p for p in results["points"]}}
    assert set(table) == set(expected)
    for label, data in expected.items():
        assert table[label] == pytest.approx(json_row(data), abs=5e-4), label
    assert f"**Pick: alpha = {results['pick']['alpha']!r}**" in report
    assert results["pick"]["alpha"] == linear_sweep.best.alpha
    assert f"Pareto front (selection split): {', '.join(map(repr, results['pareto']))}." in report
    assert (folder / "forgetting_map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"Forgetting recovered {results['recovered']:.1%}, new skill kept {results['kept']:.1%}." in report
    post_old = results["post"]["forgetting"]["groups"]["old"]
    assert post_old["F"] > 0 and post_old["F_true"] > 0


def test_rerun_evaluates_only_the_missing_alpha_and_streaming_gives_the_same_scores(
    toy_pair, linear_sweep, tmp_path, monkeypatch
):
    from mergekit_lite.evaluate.lm_harness import Evaluator

    folder = tmp_path / "run"
    shutil.copytree(linear_sweep.out, folder)
    missing = point_file(folder, "alpha=0.5")
    missing.unlink()
    others = {path: path.stat().st_mtime_ns for path in (folder / "points").iterdir()}
    calls = []
    evaluate = Evaluator.evaluate
    monkeypatch.setattr(Evaluator, "evaluate", lambda self, *a: calls.append(self.tasks) or evaluate(self, *a))

    result = run_sweep(settings_for(toy_pair, folder, stream=True))

    assert result.evaluated == ["alpha=0.5"] and len(calls) == 2  # one call per group (old, new)
    assert missing.is_file() and not (folder / MERGE_TEMP).exists()
    assert {path: path.stat().st_mtime_ns for path in others} == others
    before = next(p for p in linear_sweep.points if p.alpha == 0.5)
    after = next(p for p in result.points if p.alpha == 0.5)
    assert (after.old, after.new) == (before.old, before.new)
    assert [run.outcomes for run in after.tasks] == [run.outcomes for run in before.tasks]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_sweep_closes_the_inputs_it_reads_when_it_ends(toy_pair, tmp_path):
    """A TIES sweep builds its sparsified task vector from the shards of the inputs it opened once for all its
    points; it closes them when it ends, not the garbage collector whenever it frees them."""
    with closes_what_it_opens(toy_pair.pre_dir, toy_pair.post_dir):
        result = run_sweep(settings_for(toy_pair, tmp_path / "run", method="ties", alphas=[0.5], limit=4))
    assert result.evaluated == ["pre", "post", "alpha=0.5"]


def test_a_held_lock_stops_a_second_sweep(toy_pair, linear_sweep, tmp_path):
    folder = Path(shutil.copytree(linear_sweep.out, tmp_path / "run"))
    with open(folder / LOCK_FILE, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(InputError, match="another sweep is running"):
            run_sweep(settings_for(toy_pair, folder))


@pytest.mark.parametrize("changes", [{"limit": 16}, {"method": "ties", "alphas": [0.5]}], ids=["limit", "method"])
def test_rerun_with_other_settings_into_the_same_folder_fails(toy_pair, linear_sweep, tmp_path, changes):
    folder = Path(shutil.copytree(linear_sweep.out, tmp_path / "run"))
    before = {path: path.stat().st_mtime_ns for path in (folder / "points").iterdir()}
    with pytest.raises(InputError, match="other settings"):
        run_sweep(settings_for(toy_pair, folder, **changes))
    assert {path: path.stat().st_mtime_ns for path in (folder / "points").iterdir()} == before


@pytest.mark.parametrize("change", ["retrained", "resaved-as-one-file", "config"])
def test_a_resumed_sweep_never_reuses_points_of_weights_that_changed(toy_pair, linear_sweep, tmp_path, change):
    """The same --post path holding other weights (re-trained, re-downloaded) is another model: its points are
    not reused, whatever the path says (the identity holds index and header hashes, sizes and sampled data)."""
    post = Path(shutil.copytree(toy_pair.post_dir, tmp_path / "post"))
    pair = dataclasses.replace(toy_pair, post_dir=post)
    folder = Path(shutil.copytree(linear_sweep.out, tmp_path / "run"))
    for path in (folder / "points").iterdir():  # the points, as if evaluated on this copy of post
        point = json.loads(path.read_text())
        point["identity"] = settings_for(pair, folder).identity()
        path.write_text(json.dumps(point))
    shards = sorted(post.glob("*.safetensors"))
    if change == "retrained":
        for shard in shards:
            save_file(
                {name: tensor + 1e-3 for name, tensor in load_file(shard).items()}, shard, metadata={"format": "pt"}
            )
    elif change == "resaved-as-one-file":
        state = {name: tensor for shard in shards for name, tensor in load_file(shard).items()}
        for shard in shards:
            shard.unlink()
        (post / "model.safetensors.index.json").unlink()
        save_file(state, post / "model.safetensors", metadata={"format": "pt"})
    else:
        config = json.loads((post / "config.json").read_text())
        (post / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    before = {path: path.read_bytes() for path in (folder / "points").iterdir()}
    with pytest.raises(InputError, match=r"other settings \(post_content: "):
        run_sweep(settings_for(pair, folder))
    assert {path: path.read_bytes() for path in (folder / "points").iterdir()} == before


@pytest.mark.parametrize(
    "option, value, hint", [("metric", "accc", "did you mean 'acc'"), ("filter", "strict-match", "logged: none")]
)
def test_a_global_metric_or_filter_no_task_logs_stops_the_sweep_before_a_point_is_saved(
    toy_pair, tmp_path, option, value, hint
):
    with pytest.raises(InputError, match=rf"--{option} '{value}': no task in the evaluated tasks logs it .*{hint}"):
        run_sweep(settings_for(toy_pair, tmp_path / "run", alphas=[0.5], limit=4, **{option: [value]}))
    assert not (tmp_path / "run").exists()  # a failed first run takes its run folder back


def cli(*args, cwd):
    command = [str(Path(sys.executable).with_name("mergekit-lite")), "sweep", *map(str, args)]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=environment, timeout=300)


def test_cli_sweeps_from_a_config_file_with_flag_overrides_and_saves_the_best(toy_pair, linear_sweep, tmp_path):
    folder = tmp_path / "run"
    (folder / "points").mkdir(parents=True)
    for label in ("pre", "post"):  # the endpoints are already scored: the CLI resumes them
        shutil.copy(point_file(linear_sweep.out, label), point_file(folder, label))
    shutil.copy(linear_sweep.out / OUTPUT_MARKER, folder / OUTPUT_MARKER)  # a run folder of ours, as resumes need
    config = tmp_path / "sweep.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "pre": str(toy_pair.pre_dir),
                "post": str(toy_pair.post_dir),
                "alphas": [0.5, 0.9],
                "old_tasks": ",".join(toy_pair.old_tasks),
                "new_tasks": toy_pair.new_tasks,
                "include-path": str(toy_pair.task_dir),
                "out": str(tmp_path / "elsewhere"),
            }
        )
    )

    best = tmp_path / "best"
    done = cli(config, "--alphas", "0.25,0.5", "--out", folder, "--save-best", best, "--quiet", cwd=tmp_path)

    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((folder / "results.json").read_text())
    assert [p["alpha"] for p in results["points"]] == [0.25, 0.5]
    assert not (tmp_path / "elsewhere").exists()
    summary = done.stdout
    assert f"best  alpha={results['pick']['alpha']!r} (alpha of linear)" in summary
    assert f"pre   old {results['pre']['old']:.4f}  new {results['pre']['new']:.4f}" in summary
    assert f"forgetting recovered {results['recovered']:.1%}" in summary
    assert "evaluated 2 models, resumed 2" in summary
    provenance = yaml.safe_load((best / "mergekit_lite_config.yaml").read_text())
    assert provenance["parameters"]["alpha"] == results["pick"]["alpha"]
    assert list(best.glob("*.safetensors"))
    # its model card: the Hub's front matter naming both models, the pick and the report-split scores
    card = (best / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["base_model"] == [Path(toy_pair.pre_dir).name, Path(toy_pair.post_dir).name]
    assert front["base_model_relation"] == "merge" and "mergekit-lite" in front["tags"]
    assert f"alpha = {results['pick']['alpha']:g}" in card
    for point in (results["pre"], *results["points"]):
        low, high = point["intervals"]["harmonic_mean"]
        assert f"| {point['label']} | " in card and f"{point['harmonic_mean']:.4f} [{low:.4f}, {high:.4f}] |" in card
    assert AutoModelForCausalLM.from_pretrained(best).config.num_hidden_layers > 0


def test_ctrl_c_ends_a_sweep_at_once_leaving_only_whole_points(toy_pair, tmp_path):
    """SIGINT midway through a sweep (lm-eval or a merge running): exit 130 within seconds, saying how to resume,
    the lock released, no scratch merge left, every point file whole (resuming from them:
    test_rerun_evaluates_only_...)."""
    folder = tmp_path / "run"
    arguments = [
        "--pre",
        toy_pair.pre_dir,
        "--post",
        toy_pair.post_dir,
        "--old-tasks",
        ",".join(toy_pair.old_tasks),
        "--new-tasks",
        ",".join(toy_pair.new_tasks),
        "--include-path",
        toy_pair.task_dir,
        "--out",
        folder,
        "--quiet",
        "--alphas",
        "0:1:0.1",
    ]
    command = [str(Path(sys.executable).with_name("mergekit-lite")), "sweep", *map(str, arguments)]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(tmp_path / "stderr", "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, cwd=tmp_path, env=environment)
        deadline = time.monotonic() + 240
        saved = folder / "points"
        while len(list(saved.glob("*.json"))) < 2 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        sent = time.monotonic()
        assert process.wait(timeout=60) == 130
    assert time.monotonic() - sent < 10
    hint, interrupted = (tmp_path / "stderr").read_text().strip().splitlines()
    assert interrupted == "interrupted (SIGINT)" and "run the same command again to resume" in hint
    assert not (folder / MERGE_TEMP).exists()
    points = sorted((folder / "points").glob("*.json"))
    assert len(points) >= 2 and all(json.loads(point.read_text()) for point in points)
    with open(folder / LOCK_FILE) as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released: this would raise if held


def test_cli_bad_config_key_is_one_line_error(tmp_path):
    config = tmp_path / "sweep.yaml"
    config.write_text("pre: a\nlamda: 0.5\n")
    done = cli(config, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "unknown key 'lamda'" in done.stderr


def test_demo_summary_shows_the_split_and_the_intervals(linear_sweep):
    from mergekit_lite.demo import summary_lines, summary_markdown

    summary = summary_markdown({"linear": linear_sweep}, [])
    low, high = linear_sweep.best.intervals["harmonic_mean"]
    assert "selection split" in summary and "report split" in summary
    assert f"{linear_sweep.best.harmonic_mean:.3f} [{low:.3f}, {high:.3f}]" in summary
    assert any("picked on 50% of each task's docs" in line for line in summary_lines({"linear": linear_sweep}))


def test_sweep_example_config_is_valid(tmp_path):
    from mergekit_lite.sweep import settings_from_dict

    example = Path(__file__).resolve().parent.parent / "examples" / "sweep.yaml"
    settings = settings_from_dict({**load_sweep_file(example), "out": str(tmp_path / "run")})
    assert settings.scoring().rule("gsm8k").filter == "flexible-extract"
    assert (settings.selection, settings.aggregation) == ("docs", "paper")


def test_a_task_with_a_non_binary_metric_is_skipped_with_a_warning_not_thresholded():
    from mergekit_lite.evaluate.lm_harness import TaskScore
    from mergekit_lite.evaluate.outcomes import Scoring
    from mergekit_lite.sweep.scoring import score_task

    records = [
        {
            "doc_id": i,
            "doc_hash": f"h{i}",
            "arguments": [("Q", " a"), ("Q", " b")],
            "acc": value,
            "filter": "none",
            "metrics": ["acc"],
        }
        for i, value in enumerate([0.8, 0.1])
    ]
    with pytest.warns(UserWarning, match="'truthfulqa_mc2' skipped: metric 'acc' is not 0/1"):
        run = score_task("truthfulqa_mc2", "old", TaskScore("truthfulqa_mc2", records, {}), Scoring())
    assert run.outcomes is None and "not 0/1" in run.skipped
