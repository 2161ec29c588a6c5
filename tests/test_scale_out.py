"""Scale-out: Ray-parallel sweep points, lm-eval's vLLM arguments, the golden-section search and probe scoring."""

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.backends import (
    VllmOptions,
    parse_vllm_options,
    vllm_model_args,
)
from mergekit_lite.sweep import SweepSettings, run_sweep
from mergekit_lite.sweep.distributed import worker_count, worker_resources
from mergekit_lite.sweep.search import estimate_accuracy, evaluations_saved, golden_section, probe_plan
from mergekit_lite.sweep.store import POINTS_DIR

pytestmark = pytest.mark.slow

CLI = Path(sys.executable).parent / "mergekit-lite"


# --- vLLM arguments --------------------------------------------------------------------------------


def test_vllm_model_args_match_lm_evals_vllm_signature():
    """Every argument we build is a parameter of lm-eval's own VLLM model class, or one it forwards to
    vllm.LLM through **kwargs (gpu_memory_utilization). Read from its source: importing it needs vllm."""
    import ast
    import importlib.util

    source = Path(importlib.util.find_spec("lm_eval.models").submodule_search_locations[0]) / "vllm_causallms.py"
    vllm_class = next(
        node
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.ClassDef) and node.name == "VLLM"
    )
    init = next(node for node in vllm_class.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    accepted = {arg.arg for arg in init.args.args + init.args.kwonlyargs}
    options = parse_vllm_options(
        "tensor_parallel_size=2,data_parallel_size=2,gpu_memory_utilization=0.8,max_model_len=4096,dtype=bfloat16"
    )
    args = vllm_model_args("/runs/x/.merging", "/models/post", options)
    assert set(args) - accepted == {"gpu_memory_utilization"} and init.args.kwarg is not None
    assert args == {
        "pretrained": "/runs/x/.merging",
        "tokenizer": "/models/post",
        "dtype": "bfloat16",
        "tensor_parallel_size": 2,
        "data_parallel_size": 2,
        "gpu_memory_utilization": 0.8,
        "batch_size": "auto",
        "seed": 1234,
        "max_model_len": 4096,
    }
    assert options.gpus == 4
    assert "max_model_len" not in vllm_model_args("m", "t", VllmOptions())


@pytest.mark.parametrize(
    "text, message",
    [
        ("tensor_parallel_size=0", "tensor_parallel_size must be a whole number >= 1"),
        ("gpu_memory_utilization=1.5", "gpu_memory_utilization must be in (0, 1]"),
        ("dtype=int8", "dtype must be one of"),
        ("tp=2", "'tp' is not one of"),
        ("tensor_parallel_size=two", "is not a number"),
    ],
)
def test_bad_vllm_args_are_one_line_errors(text, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_vllm_options(text)


def test_every_sweep_setting_can_come_from_a_sweep_file_and_bad_vllm_args_fail_before_any_model(tmp_path):
    from mergekit_lite.sweep import load_sweep_file
    from mergekit_lite.sweep.settings import SETTINGS_KEYS, SweepFile

    assert set(SweepFile.model_fields) == {*SETTINGS_KEYS, "methods"}  # methods: several sweeps (sweep.compare)
    config = tmp_path / "sweep.yaml"
    config.write_text("backend: vllm\nvllm-args: tensor_parallel_size=2,gpu_memory_utilization=0.85\n")
    assert load_sweep_file(config) == {
        "backend": "vllm",
        "vllm_args": "tensor_parallel_size=2,gpu_memory_utilization=0.85",
    }
    with pytest.raises(InputError, match="tensor_parallel_size must be a whole number"):
        SweepSettings(
            "pre",
            "post",
            "linear",
            [0.5],
            ["a"],
            ["b"],
            None,
            str(tmp_path / "out"),
            backend="vllm",
            vllm_args="tensor_parallel_size=0",
        )
    with pytest.raises(InputError, match="--vllm-args applies to --backend vllm"):
        SweepSettings(
            "pre", "post", "linear", [0.5], ["a"], ["b"], None, str(tmp_path / "out"), vllm_args="dtype=bfloat16"
        )


# --- Ray resources ---------------------------------------------------------------------------------


def test_workers_fill_the_cluster_but_not_beyond_the_points():
    gpu = worker_resources("cuda", gpus_per_point=2)
    assert gpu == {"num_gpus": 2, "num_cpus": 1}
    assert worker_count(11, gpu, {"GPU": 8.0, "CPU": 64.0}) == 4
    assert worker_count(3, worker_resources("cpu"), {"CPU": 16.0}) == 3
    with pytest.raises(InputError, match="no room for one sweep worker"):
        worker_count(5, gpu, {"CPU": 16.0})


# --- golden-section search -------------------------------------------------------------------------


@pytest.mark.parametrize("peak", range(0, 21, 3))
def test_golden_section_finds_the_peak_of_a_unimodal_curve_with_fewer_evaluations(peak):
    curve = [1 - abs(i - peak) / 25 for i in range(21)]
    calls = []
    trace = golden_section(21, lambda i: calls.append(i) or curve[i])
    assert trace.best == peak
    assert len(calls) == len(set(calls)) == len(trace.evaluated) <= 11


def test_golden_section_stops_when_the_bracket_is_flat_within_noise():
    curve = [0.8 - 0.0004 * (i - 17) ** 2 for i in range(41)]  # a broad top: within 0.02 from index 10 to 24
    flat = golden_section(41, curve.__getitem__, indistinguishable=lambda i, j: abs(curve[i] - curve[j]) < 0.02)
    exact = golden_section(41, curve.__getitem__)
    assert exact.best == 17
    assert len(flat.evaluated) < len(exact.evaluated)
    assert abs(curve[flat.best] - curve[exact.best]) < 0.05
    assert "indistinguishable" in flat.reason


def test_golden_search_sweep_evaluates_fewer_points_and_a_grid_run_resumes_from_them(toy_pair, tmp_path):
    """On the toy pair: the golden search evaluates a subset of the grid; its pick is the grid's pick or one
    the grid cannot tell from it; the full grid in the same folder resumes the searched points."""
    out = tmp_path / "run"
    grid = [round(i / 8, 3) for i in range(9)]

    def sweep(search):
        return run_sweep(
            SweepSettings(
                toy_pair.pre_dir,
                toy_pair.post_dir,
                "linear",
                grid,
                toy_pair.old_tasks,
                toy_pair.new_tasks,
                toy_pair.task_dir,
                str(out),
                limit=32,
                search=search,
            )
        )

    golden = sweep("golden")
    searched = [point.alpha for point in golden.points]
    assert 3 <= len(searched) < len(grid) and set(searched) <= set(grid)
    assert golden.best.selection.harmonic_mean == max(point.selection.harmonic_mean for point in golden.points)
    results = json.loads((out / "results.json").read_text())
    assert results["search"]["method"] == "golden" and results["search"]["evaluated"] == searched
    assert "golden section" in (out / "report.md").read_text()
    full = sweep("grid")
    assert len(full.evaluated) == len(grid) - len(searched)
    assert golden.best.alpha in [full.best.alpha, *full.ties, *full.indistinguishable]


# --- probe mode ------------------------------------------------------------------------------------


def test_probe_estimate_is_exact_when_every_sample_is_scored_and_unbiased_otherwise():
    rng = random.Random(0)
    pre = {f"d{i}": rng.random() < 0.6 for i in range(400)}
    post = {k: (not v) if rng.random() < 0.2 else v for k, v in pre.items()}
    merged = {
        k: (post[k] if rng.random() < 0.5 else pre[k])
        if pre[k] != post[k]
        else ((not pre[k]) if rng.random() < 0.05 else pre[k])
        for k in pre
    }
    truth = sum(merged.values()) / len(merged)
    full = probe_plan(pre, post, rate=1.0, seed=0)
    assert estimate_accuracy(full, merged) == (pytest.approx(truth), 0.0)
    estimates = []
    for seed in range(200):
        plan = probe_plan(pre, post, rate=0.2, seed=seed)
        estimate, error = estimate_accuracy(plan, merged)
        assert 0 < error < 0.05
        estimates.append((estimate, error))
    mean = sum(e for e, _ in estimates) / len(estimates)
    assert mean == pytest.approx(truth, abs=0.003)
    covered = sum(abs(e - truth) <= 1.96 * s for e, s in estimates) / len(estimates)
    assert covered >= 0.85
    probed, full_count = evaluations_saved([probe_plan(pre, post, rate=0.2, seed=0)], n_points=11)
    assert probed < 0.5 * full_count


def test_probe_plan_is_seeded_and_keeps_every_disagreement():
    pre = {i: i % 3 == 0 for i in range(60)}
    post = {i: i % 2 == 0 for i in range(60)}
    a, b = probe_plan(pre, post, 0.25, seed=7), probe_plan(pre, post, 0.25, seed=7)
    assert a == b and a != probe_plan(pre, post, 0.25, seed=8)
    assert set(a.disagree) == {i for i in pre if pre[i] != post[i]}
    assert not set(a.agree_sampled) & set(a.disagree)


def probe_sweep(pair, out: Path, **options):
    return run_sweep(
        SweepSettings(
            pair.pre_dir,
            pair.post_dir,
            "linear",
            GRID,
            pair.old_tasks,
            pair.new_tasks,
            pair.task_dir,
            str(out),
            limit=32,
            **options,
        )
    )


GRID = [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.fixture(scope="module")
def grid_sweep(toy_pair, tmp_path_factory):
    return probe_sweep(toy_pair, tmp_path_factory.mktemp("grid") / "run")


def test_probe_sweep_scores_the_docs_asked_for_and_estimates_exactly_at_rate_one(toy_pair, grid_sweep, tmp_path):
    """lm-eval's `samples` renumbers the docs it is given; the probe outcomes, mapped back, equal the full grid's
    on the same docs, and scoring every doc (rate 1) reproduces the grid's selection scores exactly."""
    result = probe_sweep(toy_pair, tmp_path / "run", probe=1.0)
    grid = {point.alpha: point for point in grid_sweep.points}
    for alpha, estimate in result.probe.estimates.items():
        assert (estimate.old, estimate.new, estimate.harmonic_mean) == pytest.approx(
            (grid[alpha].selection.old, grid[alpha].selection.new, grid[alpha].selection.harmonic_mean), abs=1e-12
        )
        assert estimate.harmonic_mean_se == 0.0
    assert result.best.alpha == grid_sweep.best.alpha
    assert result.best.report == grid[result.best.alpha].report  # the pick scored on every doc, as in the grid


def test_probe_sweep_saves_evaluations_and_picks_what_the_grid_cannot_tell_apart(toy_pair, grid_sweep, tmp_path):
    out = tmp_path / "run"
    result = probe_sweep(toy_pair, out, probe=0.2)
    grid = {point.alpha: point for point in grid_sweep.points}
    for path in sorted((out / "probes").glob("*.json")):
        saved = json.loads(path.read_text())
        full = {run.task: run.outcomes.correct for run in grid[saved["alpha"]].tasks}
        for task in saved["tasks"]:
            assert task["correct"] and all(full[task["task"]][key] == value for key, value in task["correct"].items())
    assert result.best.alpha in [grid_sweep.best.alpha, *grid_sweep.ties, *grid_sweep.indistinguishable]
    assert [point.alpha for point in result.points] == [result.best.alpha]
    results = json.loads((out / "results.json").read_text())
    assert results["probe"]["pick"] == result.best.alpha
    assert results["probe"]["sample_evaluations"] < results["probe"]["grid_sample_evaluations"]
    assert len(results["probe"]["estimates"]) == len(GRID)
    assert "## Probe estimates" in (out / "report.md").read_text()
    # beside "indistinguishable by the estimates": the probe docs that would separate the pick from the runner-up
    separation = result.probe.separation
    estimates = {row["alpha"]: row for row in results["probe"]["estimates"]}
    rival = max(
        (alpha for alpha in estimates if alpha != result.best.alpha), key=lambda a: estimates[a]["harmonic_mean"]
    )
    assert separation.rival == f"alpha={rival!r}" and separation.docs_now == results["probe"]["samples_per_probe"]
    assert separation.difference == estimates[result.best.alpha]["harmonic_mean"] - estimates[rival]["harmonic_mean"]
    assert results["probe"]["docs_to_separate"] == separation.to_json()
    assert separation.text() in (out / "report.md").read_text()
    again = probe_sweep(toy_pair, out, probe=0.2)
    assert again.evaluated == [] and again.best.alpha == result.best.alpha  # probes and the pick resumed
    with pytest.raises(InputError, match="other settings"):
        probe_sweep(toy_pair, out, probe=0.5)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"probe": 0}, "probe must be a share in"),
        ({"probe": 1.5}, "probe must be a share in"),
        ({"probe": 0.1, "ray": "local"}, "--probe evaluates its points in this process"),
    ],
)
def test_bad_probe_settings_fail_before_any_model(tmp_path, options, message):
    with pytest.raises(InputError, match=message):
        SweepSettings("pre", "post", "linear", [0.5], ["a"], ["b"], None, str(tmp_path / "out"), **options)


# --- Ray end to end --------------------------------------------------------------------------------

ALPHAS = [0.0, 0.5, 1.0]


def scores(folder: Path) -> dict:
    return {
        path.name: [(t["task"], t["correct"]) for t in json.loads(path.read_text())["tasks"]]
        for path in sorted((folder / POINTS_DIR).glob("*.json"))
    }


@pytest.fixture(scope="module")
def local_points(toy_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "run"
    run_sweep(
        SweepSettings(
            toy_pair.pre_dir,
            toy_pair.post_dir,
            "linear",
            ALPHAS,
            toy_pair.old_tasks,
            toy_pair.new_tasks,
            toy_pair.task_dir,
            str(out),
            limit=16,
        )
    )
    return scores(out)


def wait_for_session_to_end(session: int, timeout: float = 60) -> None:
    """Until no live process of `session` is left. Ray starts its workers in their own process groups of the
    driver's session: they outlive a killed driver's group for a few seconds and may still save points."""
    import psutil

    def alive() -> list[int]:
        found = []
        for pid in psutil.pids():
            try:
                if os.getsid(pid) == session and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    found.append(pid)
            except (OSError, psutil.Error):  # ended meanwhile
                pass
        return found

    deadline = time.monotonic() + timeout
    while alive():
        assert time.monotonic() < deadline, f"processes of the killed sweep still running: {alive()}"
        time.sleep(0.2)


def sweep_command(pair, out: Path) -> list[str]:
    return [
        str(CLI),
        "sweep",
        "--pre",
        str(pair.pre_dir),
        "--post",
        str(pair.post_dir),
        "--alphas",
        ",".join(map(str, ALPHAS)),
        "--old-tasks",
        ",".join(pair.old_tasks),
        "--new-tasks",
        ",".join(pair.new_tasks),
        "--include-path",
        str(pair.task_dir),
        "--limit",
        "16",
        "--out",
        str(out),
        "--ray",
        "-q",
    ]


def test_ray_sweep_gives_the_same_points_and_resumes_after_a_kill(toy_pair, local_points, tmp_path):
    """On a local 2-CPU Ray cluster: the points equal the local sweep's; a run killed midway (driver and
    workers) leaves finished points, and the rerun evaluates only the rest."""
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'mergekit-lite[ray]'")
    out = tmp_path / "ray-run"
    first = subprocess.Popen(
        sweep_command(toy_pair, out), start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not list((out / POINTS_DIR).glob("*.json")):
        time.sleep(0.5)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    wait_for_session_to_end(first.pid)  # nothing of the first run can save a point after this
    finished_before = len(list((out / POINTS_DIR).glob("*.json")))
    assert 1 <= finished_before
    second = subprocess.run(sweep_command(toy_pair, out), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    resumed = int(second.stdout.split("resumed ")[1].split(";")[0])
    assert resumed == finished_before
    assert scores(out) == local_points
    assert math.isfinite(json.loads((out / "results.json").read_text())["pick"]["harmonic_mean"])
