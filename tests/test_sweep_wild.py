"""The sweep as practitioners run it, off the happy path: grids whose STOP is off the step, a save-best folder in the
wrong place, tasks that reach both groups through an lm-eval group, too few docs, a post with another vocabulary,
bf16 checkpoints, hub ids from an offline cache, a LoRA adapter as post, shared options in a comparison and a
mistyped YAML key. Every refusal is one line, before the grid runs, and leaves no run folder behind."""

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
from test_hub_audit import lay_out
from test_safety import cli, one_error_line
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_lite.audited import run_merge
from mergekit_lite.errors import InputError
from mergekit_lite.io.sources import open_inputs
from mergekit_lite.sweep import SweepSettings, load_sweep_file, method_settings, run_sweep
from mergekit_lite.sweep.models import ModelLoader, ResidentPair
from mergekit_lite.sweep.report import limit_text
from mergekit_lite.sweep.settings import parse_alphas
from mergekit_lite.sweep.store import point_file

pytestmark = pytest.mark.slow


def pair_args(pair, out, *extra) -> list:
    return [
        "sweep",
        "--pre",
        pair.pre_dir,
        "--post",
        pair.post_dir,
        "--include-path",
        pair.task_dir,
        "--old-tasks",
        ",".join(pair.old_tasks),
        "--new-tasks",
        ",".join(pair.new_tasks),
        "--out",
        out,
        "--quiet",
        *extra,
    ]


def test_a_range_must_end_on_its_stop():
    """STOP is documented as included: 0:1:0.3 would silently end at 0.9 and drop post's end of the grid."""
    with pytest.raises(InputError, match=r"'0:1:0.3' does not reach STOP 1 \(its last value is 0.9"):
        parse_alphas("0:1:0.3")
    assert parse_alphas("0:0.9:0.3")[-1] == 0.9 and parse_alphas("-1:1:0.5") == [-1.0, -0.5, 0.0, 0.5, 1.0]
    assert parse_alphas("0.1:0.9:0.2")[-1] == 0.9  # float steps that land on STOP up to rounding


@pytest.mark.parametrize(
    "where, message",
    [
        ("run/best", "must lie outside the run folder"),
        ("taken", "exists and is not the model this run folder's sweep saved there"),
    ],
)
def test_save_best_is_a_new_folder_outside_the_run_folder(toy_pair, tmp_path, where, message):
    """Inside the run folder it would stop every resume (a run folder holds only its own files); an existing
    folder is never replaced, and the message names no --overwrite (sweep has none)."""
    (tmp_path / "taken").mkdir()
    done = cli(*pair_args(toy_pair, tmp_path / "run", "--alphas", "0.5", "--save-best", tmp_path / where))
    assert "--overwrite" not in one_error_line(done, 2, message)
    assert not (tmp_path / "run").exists() and not any((tmp_path / "taken").iterdir())


def test_a_refusal_before_the_first_point_leaves_no_run_folder(toy_pair, tmp_path):
    """An unknown task (found when lm-eval indexes the tasks) or a metric no task logs (found once pre is scored)
    is refused after the run folder was made: it is taken back, and an empty folder the user made is emptied
    again but kept."""
    done = cli(*pair_args(toy_pair, tmp_path / "run", "--alphas", "0.5", "--old-tasks", "no_such_task"))
    one_error_line(done, 2, "unknown lm-eval task")
    assert not (tmp_path / "run").exists()
    (tmp_path / "mine").mkdir()
    done = cli(*pair_args(toy_pair, tmp_path / "mine", "--alphas", "0.5", "--limit", "4", "--metric", "accc"))
    one_error_line(done, 2, "did you mean 'acc'")
    assert (tmp_path / "mine").is_dir() and not any((tmp_path / "mine").iterdir())


def tiny_settings(pair, out, **changes) -> SweepSettings:
    options = {"limit": 4, "bootstrap": 0, **changes}
    return SweepSettings(
        pair.pre_dir,
        pair.post_dir,
        "linear",
        options.pop("alphas", [0.5]),
        options.pop("old_tasks", pair.old_tasks),
        pair.new_tasks,
        options.pop("include_path", pair.task_dir),
        out,
        **options,
    )


def test_a_task_in_both_groups_through_an_lm_eval_group_is_refused_before_any_point(toy_pair, tmp_path):
    """`--old-tasks GROUP` where the lm-eval group also holds a new task: refused after pre's evaluation, before its
    point is saved (not at the end of the whole grid, in a numpy broadcast error)."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for file in Path(toy_pair.task_dir).glob("*.yaml"):
        (tasks / file.name).write_text(file.read_text())
    (tasks / "both.yaml").write_text(
        yaml.safe_dump({"group": "both", "task": [*toy_pair.old_tasks, *toy_pair.new_tasks]})
    )
    with pytest.raises(InputError, match=f"task '{toy_pair.new_tasks[0]}' is both an old and a new task"):
        run_sweep(tiny_settings(toy_pair, tmp_path / "run", old_tasks=["both"], include_path=tasks))
    assert not (tmp_path / "run").exists()


def test_too_few_docs_to_split_is_said_after_pre_not_after_the_grid(toy_pair, tmp_path):
    with pytest.raises(InputError, match="1 doc.s. cannot be split"):
        run_sweep(tiny_settings(toy_pair, tmp_path / "run", limit=1, alphas=[0.0, 0.5, 1.0]))
    assert not (tmp_path / "run").exists()


def test_ctrl_c_before_the_first_point_leaves_no_run_folder(toy_pair, tmp_path):
    folder = tmp_path / "run"
    command = [
        str(Path(sys.executable).with_name("mergekit-lite")),
        *map(str, pair_args(toy_pair, folder, "--alphas", "0:1:0.5")),
    ]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=environment,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not folder.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 130
    assert process.stderr.read().strip() == "interrupted (SIGINT)"
    assert not folder.exists()


def save_as(source: Path, folder: Path, dtype=None, extra_tokens: int = 0) -> Path:
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if extra_tokens:
        tokenizer.add_tokens([f"extra{index}" for index in range(extra_tokens)])
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_post_with_another_vocabulary_is_refused_before_the_run_folder(toy_pair, tmp_path):
    """The sweep merges tensor by tensor: refused from the headers, not after pre is evaluated and torch fails."""
    post = save_as(toy_pair.post_dir, tmp_path / "post", extra_tokens=3)
    done = cli(
        "sweep",
        "--pre",
        toy_pair.pre_dir,
        "--post",
        post,
        "--alphas",
        "0.5",
        "--old-tasks",
        toy_pair.old_tasks[0],
        "--new-tasks",
        toy_pair.new_tasks[0],
        "--include-path",
        toy_pair.task_dir,
        "--out",
        tmp_path / "run",
    )
    one_error_line(done, 2, r"embed_tokens.weight: shape \[\d+, \d+\] in post", "--tokenizer-source base")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("method, alpha", [("linear", 0.3), ("ties", 0.7), ("slerp", 0.4)])
def test_the_model_scored_is_the_model_save_best_writes_for_bf16_checkpoints(toy_pair, tmp_path, method, alpha):
    """The in-memory merge is rounded to the checkpoints' bf16 as the streamed merge is: every parameter of the
    evaluated model equals the merge written to disk and loaded back (most of them differed before)."""
    pre = save_as(toy_pair.pre_dir, tmp_path / "pre", torch.bfloat16)
    post = save_as(toy_pair.post_dir, tmp_path / "post", torch.float32)  # mixed: the base's bf16 is stored
    settings = SweepSettings(
        str(pre),
        str(post),
        method,
        [alpha],
        ["a"],
        ["b"],
        None,
        str(tmp_path / "run"),
        density=0.5 if method == "ties" else None,
    )
    config = settings.merge_config(alpha)
    loader = ModelLoader(settings.pre, torch.float32, "cpu")
    sources = open_inputs([settings.pre, settings.post], settings.pre, allow_pickle=False)
    resident = ResidentPair(loader, settings, sources, config)
    resident.write(config)
    run_merge(config, tmp_path / "merged")
    written = dict(loader.from_folder(tmp_path / "merged").named_parameters())
    for name, parameter in resident.model.named_parameters():
        assert torch.equal(parameter, written[name]), name
    for source in sources:
        source.close()


def test_hub_ids_sweep_from_an_offline_cache(toy_pair, linear_sweep, tmp_path, monkeypatch):
    """`--pre org/pre --post org/post` with HF_HUB_OFFLINE=1 reads the cache's snapshots (as merge does): the same
    per-doc outcomes as the sweep of the folders, the report and the saved model's card naming the hub ids."""
    cache = tmp_path / "cache"
    lay_out(cache, "toy-org/pre", Path(toy_pair.pre_dir))
    lay_out(cache, "toy-org/post", Path(toy_pair.post_dir))
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    out, best = tmp_path / "run", tmp_path / "best"
    result = run_sweep(
        SweepSettings(
            "toy-org/pre",
            "toy-org/post",
            "linear",
            [0.5],
            toy_pair.old_tasks,
            toy_pair.new_tasks,
            str(toy_pair.task_dir),
            str(out),
            limit=16,
            bootstrap=0,
            save_best=str(best),
        )
    )
    for label in ("pre", "post", "alpha=0.5"):
        ours = json.loads(point_file(out, label).read_text())["tasks"]
        folders = {
            task["task"]: task["correct"]
            for task in json.loads(point_file(linear_sweep.out, label).read_text())["tasks"]
        }
        for task in ours:
            assert task["correct"] == {key: folders[task["task"]][key] for key in task["correct"]}
    report = (out / "report.md").read_text()
    assert "- pre: toy-org/pre (`" in report and "- post: toy-org/post (`" in report
    front = yaml.safe_load((best / "README.md").read_text().split("---\n")[1])
    assert front["base_model"] == ["toy-org/pre", "toy-org/post"] and result.best.alpha == 0.5


def test_limit_beyond_the_docs_names_the_tasks_that_have_fewer(toy_pair, linear_sweep):
    """`--limit 1000` on 64-doc tasks: the report says how many docs each task had (the task files' lines)."""
    lines = {
        task: len((Path(toy_pair.task_dir) / f"{task}.jsonl").read_text().splitlines())
        for task in (*toy_pair.old_tasks, *toy_pair.new_tasks)
    }
    text = limit_text(1000, linear_sweep.splits)
    assert text == "1000 (fewer docs: " + ", ".join(f"{task} has {count}" for task, count in lines.items()) + ")"
    assert limit_text(min(lines.values()), linear_sweep.splits) == str(min(lines.values()))


def test_a_shared_option_goes_to_the_methods_that_take_it(toy_pair, tmp_path):
    data = {
        "pre": toy_pair.pre_dir,
        "post": toy_pair.post_dir,
        "alphas": [0.5],
        "old_tasks": toy_pair.old_tasks,
        "new_tasks": toy_pair.new_tasks,
        "include_path": toy_pair.task_dir,
        "out": str(tmp_path / "run"),
        "density": 0.5,
        "densities": None,
    }
    linear, ties = method_settings(data, ["linear", "ties"])
    assert (linear.density, ties.density) == (None, 0.5)
    with pytest.raises(InputError, match=r"density: none of the methods \(linear, task_arithmetic\) takes density"):
        method_settings(data, ["linear", "task_arithmetic"])


def test_a_mistyped_yaml_key_names_the_one_meant(tmp_path):
    config = tmp_path / "sweep.yaml"
    config.write_text("pre: a\nold-task: [x]\n")
    with pytest.raises(InputError, match=r"unknown key 'old-task' \(did you mean 'old_tasks'\?\)"):
        load_sweep_file(config)


def test_a_lora_adapter_as_post_is_audited_then_swept_as_the_fine_tune(toy_pair, linear_sweep, tmp_path):
    """`--post ADAPTER`: the fine-tune extracted at full rank (a PEFT adapter) is audited against pre, then swept,
    each point scoring doc for doc as the fine-tune's own sweep; a no-op adapter is REJECTED before anything is
    evaluated, in one line with no --force offered (sweep has none), and leaves no run folder."""
    from mergekit_lite.merge.extract import extract_lora

    adapter, out = tmp_path / "adapter", tmp_path / "run"
    extract_lora(toy_pair.pre_dir, toy_pair.post_dir, str(adapter), rank=4096)
    run_sweep(
        SweepSettings(
            toy_pair.pre_dir,
            str(adapter),
            "linear",
            [0.5],
            toy_pair.old_tasks,
            toy_pair.new_tasks,
            str(toy_pair.task_dir),
            str(out),
            limit=16,
            bootstrap=0,
        )
    )
    for label in ("pre", "post", "alpha=0.5"):
        ours = json.loads(point_file(out, label).read_text())["tasks"]
        folders = {
            task["task"]: task["correct"]
            for task in json.loads(point_file(linear_sweep.out, label).read_text())["tasks"]
        }
        for task in ours:
            assert task["correct"] == {key: folders[task["task"]][key] for key in task["correct"]}, (
                label,
                task["task"],
            )
    no_op = tmp_path / "no-op"
    extract_lora(toy_pair.pre_dir, toy_pair.pre_dir, str(no_op), rank=4)
    args = pair_args(toy_pair, tmp_path / "refused", "--alphas", "0.5")
    args[args.index("--post") + 1] = no_op
    done = cli(*args)
    assert "--force" not in one_error_line(done, 2, r"adapter \S+no-op is REJECTED: ")
    assert not (tmp_path / "refused").exists()
