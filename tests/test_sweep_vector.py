"""The per-layer-group / per-module search (sweep.vector, sweep.vector_search): the slots each tensor takes, the merge
against a float64 reimplementation and against mergekit running the written YAML, a toy whose forgetting sits in
chosen layers (the search must put them back to pre and beat the scalar pick on the report split), a toy without
such structure (the report must say the vector did not beat one coefficient), the same vector run twice, a run
stopped or killed mid-search resuming from its Optuna storage, cheap-first trials pruned on probe docs, batches on
Ray giving a serial run's vector, and the comparison of several methods showing each one's vector."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mergekit_lite.errors import InputError
from mergekit_lite.merge.config import resolve
from mergekit_lite.sweep import SweepSettings, run_sweep
from mergekit_lite.sweep.vector import MERGEKIT_FILE, VECTORS_DIR, vector_space
from mergekit_lite.toy import build_toy_pair

ALPHAS = [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.fixture(scope="session")
def layered_pair(tmp_path_factory):
    """Four decoder layers: layers 2-3 learn the new skill beside the old one, then layers 0-1 alone learn wrong old
    answers (the forgetting sits in layers 0-1 by construction)."""
    from conftest import once_per_run

    return once_per_run(
        tmp_path_factory,
        "layered_pair",
        lambda folder: build_toy_pair(folder, seed=0, n_layers=4, post_layers=[2, 3], forget_layers=[0, 1]),
    )


def settings_for(pair, out, **changes) -> SweepSettings:
    return SweepSettings(
        pair.pre_dir,
        pair.post_dir,
        changes.pop("method", "linear"),
        ALPHAS,
        pair.old_tasks,
        pair.new_tasks,
        pair.task_dir,
        out,
        limit=None,
        **changes,
    )


def expected_slot(name: str, groups: int, n_layers: int, modules: tuple[str, ...]) -> str:
    """The slot the docs give a tensor of a Llama checkpoint, written from names alone."""
    parts = name.split(".")
    if "layers" in parts:
        layer = int(parts[parts.index("layers") + 1])
        group = layer * groups // n_layers + 1
        kind = "attn" if "self_attn" in parts else "mlp" if "mlp" in parts else "other"
    else:
        group = 1 if "embed_tokens" in name else groups
        kind = "other"
    if not modules:
        return f"g{group}"
    return f"g{group}.{kind if kind in modules else 'other'}"


def test_every_tensor_resolves_to_its_slot(layered_pair, tmp_path):
    settings = settings_for(layered_pair, tmp_path / "run", groups=2, modules="attn,mlp")
    space = vector_space(settings)
    assert space.slots == ["g1.attn", "g1.mlp", "g1.other", "g2.attn", "g2.mlp", "g2.other"]
    values = [0.1 * (index + 1) for index in range(len(space.slots))]
    spec = space.spec(values)
    names = list(load_file(str(next(layered_pair.pre_dir.glob("*.safetensors")))))
    for name in names:
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else None
        # mergekit's placement of tensors outside the layers (t = 0) must give the same value as ours
        for compat in (False, True):
            got = resolve("alpha", spec, name, layer, space.n_layers, mergekit_compat=compat)
            want = values[space.slots.index(expected_slot(name, 2, 4, ("attn", "mlp")))]
            assert got == pytest.approx(want, abs=1e-12), (name, compat)


def test_vector_settings_are_checked_before_any_model_is_read(layered_pair, toy_pair, tmp_path):
    with pytest.raises(InputError, match="unknown module type 'atn'.*attn"):
        settings_for(layered_pair, tmp_path, groups=2, modules="atn")
    with pytest.raises(InputError, match="per-layer schedule"):
        settings_for(layered_pair, tmp_path, method="lines", groups=2)
    with pytest.raises(InputError, match="give one of them"):
        settings_for(layered_pair, tmp_path, trials=4)
    with pytest.raises(InputError, match="groups 1 is the scalar sweep"):
        settings_for(layered_pair, tmp_path, groups=1)
    with pytest.raises(InputError, match="give one of them"):
        settings_for(layered_pair, tmp_path, vector_prune=0.1)
    with pytest.raises(InputError, match=r"vector_prune must be a share of docs in \(0, 1\], got 0"):
        settings_for(layered_pair, tmp_path, groups=2, vector_prune=0)
    with pytest.raises(InputError, match="trial_batch must be a whole number >= 1, got 0"):
        settings_for(layered_pair, tmp_path, groups=2, trial_batch=0)
    with pytest.raises(InputError, match="attn and q both hold q"):
        vector_space(settings_for(layered_pair, tmp_path, modules="attn,q"))
    with pytest.raises(InputError, match="3 groups.*2 layers"):
        vector_space(settings_for(toy_pair, tmp_path, groups=3))


@pytest.mark.slow
def test_saved_vector_is_the_float64_merge_and_mergekit_reproduces_it(layered_pair, tmp_path):
    """--save-best writes the vector's merge: every tensor (1 - a) pre + a post with its slot's a, computed here in
    float64; mergekit running the written mergekit.yaml gives the same model."""
    from mergekit_reference import run_mergekit

    settings = settings_for(layered_pair, tmp_path / "run", groups=2, modules="attn,mlp", trials=3)
    settings.save_best = str(tmp_path / "best")
    result = run_sweep(settings)
    coefficients = result.vector["pick"]["coefficients"] if result.vector["chosen"] else None
    space = vector_space(settings)
    pre = {}
    for path in layered_pair.pre_dir.glob("*.safetensors"):
        pre.update(load_file(str(path)))
    post = {}
    for path in layered_pair.post_dir.glob("*.safetensors"):
        post.update(load_file(str(path)))
    saved = {}
    for path in Path(settings.save_best).glob("*.safetensors"):
        saved.update(load_file(str(path)))
    for name, tensor in pre.items():
        slot = expected_slot(name, 2, 4, ("attn", "mlp"))
        alpha = coefficients[slot] if coefficients else result.best.alpha
        want = (1 - alpha) * tensor.double() + alpha * post[name].double()
        assert torch.allclose(saved.get(name, tensor).double(), want, atol=1e-6), name
    assert space.slots == list(result.vector["pick"]["coefficients"])
    card = (Path(settings.save_best) / "README.md").read_text()
    assert "Coefficients per layer group" in card and "g1.attn" in card
    config = yaml.safe_load((tmp_path / "run" / MERGEKIT_FILE).read_text())
    assert config["merge_method"] == "linear"
    theirs = run_mergekit(tmp_path / "run" / MERGEKIT_FILE, tmp_path / "mergekit-out")
    merged = {}
    for path in Path(theirs).glob("*.safetensors"):
        merged.update(load_file(str(path)))
    for name, tensor in merged.items():
        assert torch.allclose(tensor.double(), saved.get(name, pre[name]).double(), atol=1e-6), name


@pytest.mark.slow
def test_search_puts_the_forgetting_layers_back_to_pre_and_beats_the_scalar_pick(layered_pair, tmp_path):
    result = run_sweep(settings_for(layered_pair, tmp_path / "run", groups=4, vector_search="revert", trials=16))
    vector = result.vector
    assert vector["chosen"] and vector["beat_scalar"]
    # layers 0-1 (groups 1-2) forgot: back to pre; layers 2-3 learnt the new skill keeping the old: post's
    assert vector["pick"]["coefficients"] == {"g1": 0.0, "g2": 0.0, "g3": 1.0, "g4": 1.0}
    assert vector["intervals"]["harmonic_mean"][0] > 0
    assert vector["pick"]["harmonic_mean"] > vector["scalar"]["harmonic_mean"]
    saved = json.loads((tmp_path / "run" / "results.json").read_text())["vector"]
    assert saved["pick"] == vector["pick"]
    assert saved["search"]["evaluated"] == len(list((tmp_path / "run" / VECTORS_DIR).glob("*.json")))
    report = (tmp_path / "run" / "report.md").read_text()
    assert "The vector beat the scalar pick on the report split" in report
    assert f"{saved['search']['docs_per_trial']} docs a trial" in report


@pytest.mark.slow
def test_a_pair_without_layer_structure_reports_that_the_vector_did_not_beat_one_coefficient(toy_pair, tmp_path):
    """The shared toy trains every layer on the new skill: splitting its two layers gives the search capacity
    the report docs do not reward."""
    result = run_sweep(settings_for(toy_pair, tmp_path / "run", groups=2, trials=8))
    vector = result.vector
    assert not vector["beat_scalar"]
    low, high = vector["intervals"]["harmonic_mean"]
    assert low <= 0
    report = (tmp_path / "run" / "report.md").read_text()
    assert "did not beat one coefficient" in report or "no vector beat the scalar pick" in report
    separation = vector["docs_to_separate"]  # the docs-needed estimate of the vector against the scalar pick
    assert (
        separation["rival"] == result.best.label and separation["difference"] == vector["difference"]["harmonic_mean"]
    )
    if "cannot tell them apart" in vector["verdict"]:
        assert "report docs would separate the vector from the scalar pick" in vector["verdict"] or (
            "not estimable" in vector["verdict"]
        )


def cli_command(pair, out: Path, trials: int, *extra: str) -> list[str]:
    return [
        str(Path(sys.executable).with_name("mergekit-lite")),
        "sweep",
        "--pre",
        str(pair.pre_dir),
        "--post",
        str(pair.post_dir),
        "--alphas",
        "0:1:0.25",
        "--old-tasks",
        ",".join(pair.old_tasks),
        "--new-tasks",
        ",".join(pair.new_tasks),
        "--include-path",
        str(pair.task_dir),
        "--groups",
        "2",
        "--trials",
        str(trials),
        "--out",
        str(out),
        "--quiet",
        *extra,
    ]


def interrupted(command: list[str], out: Path, finished: int, signum: int, log: Path, folder: str = VECTORS_DIR) -> int:
    """Run the CLI until `finished` trials are saved in out/`folder`, then send `signum`; its exit status."""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=environment)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(list((out / folder).glob("vector_*.json"))) < finished:
            assert process.poll() is None, log.read_text()[-2000:]
            time.sleep(0.05)
        os.kill(process.pid, signum)
        return process.wait()


@pytest.mark.slow
def test_same_command_twice_gives_the_same_vector_and_a_killed_run_resumes(layered_pair, tmp_path):
    """Two fresh runs of one command give the same trials; a third, stopped by Ctrl-C (SIGINT) while its search
    runs, rerun and killed (SIGKILL), then run again, evaluates only the trials not finished and ends with the
    same trials and pick."""
    trials = 10
    first = run_sweep(settings_for(layered_pair, tmp_path / "first", groups=2, trials=trials)).vector
    second = run_sweep(settings_for(layered_pair, tmp_path / "second", groups=2, trials=trials)).vector
    assert first["trials"] == second["trials"] and first["pick"] == second["pick"]

    out = tmp_path / "killed"
    command = cli_command(layered_pair, out, trials)
    assert interrupted(command, out, 2, signal.SIGINT, tmp_path / "stderr") == 130
    assert "error" not in (tmp_path / "stderr").read_text().lower()
    after_interrupt = len(list((out / VECTORS_DIR).glob("*.json")))
    assert interrupted(command, out, after_interrupt + 2, signal.SIGKILL, tmp_path / "stderr") == -signal.SIGKILL
    finished = len(list((out / VECTORS_DIR).glob("*.json")))
    assert after_interrupt < finished < trials
    resumed = run_sweep(settings_for(layered_pair, out, groups=2, trials=trials)).vector
    assert resumed["search"]["evaluated"] == trials - finished
    assert resumed["trials"] == first["trials"] and resumed["pick"] == first["pick"]


@pytest.mark.slow
def test_cheap_first_trials_are_pruned_on_probe_docs_and_a_killed_run_resumes_them(layered_pair, tmp_path):
    """--vector-prune: every trial scored first on probe docs; those Optuna's median pruner stops cost one probe
    evaluation, the others a probe and every doc; the report, results.json and the run's counts say so. A run
    killed mid-search and run again ends with the same trials, evaluating only what was not saved."""
    trials, changes = 10, {"groups": 2, "trials": 10, "vector_prune": 0.2}
    first = run_sweep(settings_for(layered_pair, tmp_path / "first", **changes)).vector
    search, rows = first["search"], first["trials"]
    probe_docs, every_doc = search["prune"]["probe_docs"], search["docs_per_trial"]
    pruned = [row for row in rows if row["pruned"]]
    assert 1 <= len(pruned) == search["prune"]["pruned"] and len(rows) == trials
    assert all(row["number"] >= 4 and row["selection_harmonic_mean"] is None for row in pruned)  # startups kept
    for row in rows:
        assert row["probe_harmonic_mean"] is not None
        assert (row["docs"], row["evaluations"]) == ((probe_docs, 1) if row["pruned"] else (probe_docs + every_doc, 2))
    assert search["docs"] == sum(row["docs"] for row in rows)
    assert search["evaluations"] == 2 * trials - len(pruned) == search["evaluated"] + search["prune"]["probed"]
    assert first["pick"]["label"] in {row["label"] for row in rows if not row["pruned"]}
    # a pruned trial's probe estimate lies below the median of the finished trials' estimates before it
    for row in pruned:
        before = sorted(
            other["probe_harmonic_mean"] for other in rows if other["number"] < row["number"] and not other["pruned"]
        )
        middle = len(before) // 2
        median = before[middle] if len(before) % 2 else (before[middle - 1] + before[middle]) / 2
        assert row["probe_harmonic_mean"] < median
    saved = json.loads((tmp_path / "first" / "results.json").read_text())["vector"]
    assert saved["trials"] == rows
    report = (tmp_path / "first" / "report.md").read_text()
    assert f"each scored first on {probe_docs} probe docs" in report and f"{len(pruned)} pruned" in report
    assert report.count("| pruned |") == len(pruned)

    out = tmp_path / "killed"
    command = cli_command(layered_pair, out, trials, "--vector-prune", "0.2")
    assert interrupted(command, out, 6, signal.SIGKILL, tmp_path / "stderr", "probes") == -signal.SIGKILL
    probes = len(list((out / "probes").glob("*.json")))
    assert 6 <= probes < trials
    fulls = len(list((out / VECTORS_DIR).glob("*.json")))
    resumed = run_sweep(settings_for(layered_pair, out, **changes)).vector
    assert resumed["trials"] == rows and resumed["pick"] == first["pick"]
    assert resumed["search"]["prune"]["probed"] == trials - probes
    assert resumed["search"]["evaluated"] == trials - len(pruned) - fulls


@pytest.mark.slow
def test_trials_on_ray_give_the_vector_of_a_serial_run_with_the_same_batch(layered_pair, tmp_path):
    """On a local Ray cluster: batches of two trials asked of Optuna and scored on two actors give the trials and
    pick a serial run with the same batch gives, cheap first included."""
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'mergekit-lite[ray]'")
    changes = {"groups": 2, "trials": 6, "vector_prune": 0.2, "trial_batch": 2}
    serial = run_sweep(settings_for(layered_pair, tmp_path / "serial", **changes)).vector
    parallel = run_sweep(settings_for(layered_pair, tmp_path / "ray", ray="local", **changes)).vector
    assert parallel["search"]["ray"] and parallel["search"]["batch"] == 2
    assert parallel["trials"] == serial["trials"] and parallel["pick"] == serial["pick"]
    report = (tmp_path / "ray" / "report.md").read_text()
    assert "asked 2 at a time and scored in parallel on Ray" in report


@pytest.mark.slow
def test_comparison_shows_each_methods_vector_beside_its_scalar_pick(layered_pair, tmp_path):
    """Several methods with --groups: comparison.json and comparison.md give each method's vector beside its scalar
    pick, with the paired interval of the difference its own sweep computed."""
    from mergekit_lite.sweep import method_settings, run_comparison

    data = {
        "pre": layered_pair.pre_dir,
        "post": layered_pair.post_dir,
        "alphas": ALPHAS,
        "old_tasks": layered_pair.old_tasks,
        "new_tasks": layered_pair.new_tasks,
        "include_path": layered_pair.task_dir,
        "out": str(tmp_path / "run"),
        "limit": None,
        "groups": 2,
        "trials": 3,
    }
    comparison = run_comparison(method_settings(data, ["linear", "task_arithmetic"]), baseline="linear")
    saved = json.loads((tmp_path / "run" / "comparison.json").read_text())
    markdown = (tmp_path / "run" / "comparison.md").read_text()
    assert "| method | scalar pick: harmonic mean | vector | harmonic mean | vector - scalar | |" in markdown
    for entry in saved["methods"]:
        own = json.loads((tmp_path / "run" / entry["method"] / "results.json").read_text())["vector"]
        vector = entry["vector"]
        assert vector["coefficients"] == own["pick"]["coefficients"]
        assert vector["harmonic_mean"] == own["pick"]["harmonic_mean"]
        assert vector["intervals"] == own["intervals"] and len(vector["intervals"]["harmonic_mean"]) == 2
        low, high = vector["intervals"]["harmonic_mean"]
        difference = vector["difference"]["harmonic_mean"]
        pick = comparison.sweeps[entry["method"]].best
        assert difference == pytest.approx(own["pick"]["harmonic_mean"] - pick.harmonic_mean)
        coefficients = ", ".join(f"{slot} {value:.2f}" for slot, value in vector["coefficients"].items())
        method = entry["method"]
        row = next(line for line in markdown.splitlines() if coefficients in line and f"[{method}]" in line)
        assert f"{difference:+.3f} [{low:+.3f}, {high:+.3f}]" in row
        assert f": {pick.harmonic_mean:.3f}" in row
