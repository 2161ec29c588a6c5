"""A sweep scores the prompts lm-eval's own CLI builds with the same evaluation settings (few-shot, chat template,
system instruction), keeps points of other settings apart, refuses unknown tasks and a missing chat template before
any model is read, says when the pick does not hold up or is pre or post itself, and reruns over its own outputs."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.lm_eval_settings import LmEvalSettings
from mergekit_lite.sweep import SweepSettings, load_sweep_file, run_sweep, settings_from_dict
from mergekit_lite.sweep.compare import compare, comparison_json, comparison_markdown, comparison_summary
from mergekit_lite.sweep.scoring import split_docs
from mergekit_lite.sweep.store import point_file

# a chat template the toy tokenizer can encode (its words and unknown tokens): role, then content, one turn a line
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} \n{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
SYSTEM = "Answer with one word."
CHAT_FLAGS = ["--num-fewshot", "2", "--apply-chat-template", "--fewshot-as-multiturn", "--system-instruction", SYSTEM]
LIMIT = 8


def cli(*args, cwd) -> subprocess.CompletedProcess:
    command = [str(Path(sys.executable).with_name("mergekit-lite")), "sweep", *map(str, args)]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=environment, timeout=600)


def pair_arguments(pre, post, pair, out) -> list:
    return [
        "--pre",
        pre,
        "--post",
        post,
        "--old-tasks",
        ",".join(pair.old_tasks),
        "--new-tasks",
        ",".join(pair.new_tasks),
        "--include-path",
        pair.task_dir,
        "--out",
        out,
        "--quiet",
    ]


def with_chat_template(model: Path, folder: Path) -> Path:
    """A copy of a toy model whose tokenizer has a chat template, as an instruct model's has."""
    shutil.copytree(model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


def test_lm_eval_settings_are_checked_and_named_before_any_model_is_read(tmp_path):
    common = dict(
        pre="pre",
        post="post",
        method="linear",
        alphas=[0.5],
        old_tasks=["a"],
        new_tasks=["b"],
        include_path=None,
        out=str(tmp_path / "run"),
    )
    with pytest.raises(InputError, match="--fewshot-as-multiturn needs --apply-chat-template"):
        settings_from_dict({**common, "fewshot_as_multiturn": True})
    with pytest.raises(InputError, match="model_args: 'pretrained' is not one a sweep passes on"):
        settings_from_dict({**common, "model_args": "pretrained=other"})
    with pytest.raises(InputError, match="--model-args applies to --backend hf"):
        settings_from_dict({**common, "model_args": "max_length=64", "backend": "vllm"})
    with pytest.raises(InputError, match="num_fewshot must be"):
        settings_from_dict({**common, "num_fewshot": -1})
    for bad in (1.5, 0, -0.5):
        with pytest.raises(InputError, match="limit must be a whole number of docs >= 1 or a share"):
            settings_from_dict({**common, "limit": bad})
    assert settings_from_dict({**common, "limit": 0.25}).limit == 0.25
    assert settings_from_dict({**common, "limit": 8.0}).limit == 8
    # lm-eval's CLI turns few-shot turns into a conversation whenever a chat template is applied, unless told not to
    assert LmEvalSettings(apply_chat_template=True).multiturn
    assert not LmEvalSettings(apply_chat_template=True, fewshot_as_multiturn=False).multiturn
    # the YAML takes the same settings; they are part of a point's identity only when given (older folders resume)
    config = tmp_path / "sweep.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "num-fewshot": 5,
                "apply_chat_template": True,
                "system_instruction": SYSTEM,
                "gen_kwargs": "max_gen_toks=64",
                "model_args": "max_length=2048",
                "limit": 0.1,
            }
        )
    )
    settings = settings_from_dict({**common, **load_sweep_file(config)})
    assert settings.lm_eval == LmEvalSettings(5, True, None, SYSTEM, "max_gen_toks=64", "max_length=2048")
    assert settings.lm_eval.hflm_args() == {"max_length": 2048} and settings.limit == 0.1
    assert settings.to_dict()["lm_eval"]["num_fewshot"] == 5
    config.write_text("num_fewshot: '5'\n")
    with pytest.raises(InputError, match="num_fewshot"):
        load_sweep_file(config)


@pytest.mark.slow
def test_refusals_before_any_model_is_read(toy_pair, tmp_path):
    """Unknown tasks, a task missing from --include-path, and a chat template asked of a tokenizer without one:
    one line, exit 2, while pre's weights are not even a safetensors file (the same command with real tasks fails on
    them, so they would be read next)."""
    pre = Path(shutil.copytree(toy_pair.pre_dir, tmp_path / "pre"))
    for weights in pre.glob("*.safetensors"):
        weights.write_bytes(b"not weights")
    empty = tmp_path / "no-tasks"
    empty.mkdir()
    base = ["--alphas", "0.5", "--quiet"]
    common = ["--pre", pre, "--post", toy_pair.post_dir, *base]
    tasks = ["--old-tasks", "toy_old", "--new-tasks", "toy_new"]
    cases = {
        "unknown lm-eval task(s) no_such_task (not built in, not in --include-path": [
            *common,
            "--old-tasks",
            "no_such_task",
            "--new-tasks",
            "toy_new",
            "--include-path",
            toy_pair.task_dir,
        ],
        f"unknown lm-eval task(s) toy_old, toy_new (not built in, not in --include-path {empty})": [
            *common,
            *tasks,
            "--include-path",
            empty,
        ],
        "--apply-chat-template: the tokenizer in": [
            *common,
            *tasks,
            "--include-path",
            toy_pair.task_dir,
            "--apply-chat-template",
        ],
    }
    for index, (message, arguments) in enumerate(cases.items()):
        done = cli(*arguments, "--out", tmp_path / f"run{index}", cwd=tmp_path)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
        assert "has no chat template" in done.stderr or "chat" not in message
        assert not (tmp_path / f"run{index}").exists()
    done = cli(*common, *tasks, "--include-path", toy_pair.task_dir, "--out", tmp_path / "control", cwd=tmp_path)
    assert done.returncode == 2 and "safetensors" in done.stderr.lower() or "header" in done.stderr.lower(), done.stderr


@pytest.fixture(scope="module")
def chat_sweep(toy_pair, tmp_path_factory):
    """The toy pair with chat templates, swept at one alpha with few-shot chat prompts and a system instruction,
    and lm-eval's own CLI run on pre with the same flags (--log_samples)."""
    from lm_eval.__main__ import cli_evaluate
    from lm_eval_tasks import lm_eval_arguments, samples_folder

    root = tmp_path_factory.mktemp("chat")
    pre = with_chat_template(toy_pair.pre_dir, root / "pre")
    post = with_chat_template(toy_pair.post_dir, root / "post")
    arguments = [
        *pair_arguments(pre, post, toy_pair, root / "run"),
        "--alphas",
        "0.5",
        "--limit",
        LIMIT,
        "--selection",
        "none",
        "--bootstrap",
        "0",
        *CHAT_FLAGS,
    ]
    done = cli(*arguments, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    tasks = ",".join(toy_pair.old_tasks + toy_pair.new_tasks)
    lm_eval_flags = [
        "--limit",
        str(LIMIT),
        "--num_fewshot",
        "2",
        "--apply_chat_template",
        "--fewshot_as_multiturn",
        "--system_instruction",
        SYSTEM,
    ]
    saved_argv = sys.argv
    sys.argv = ["lm_eval", *lm_eval_arguments(pre, tasks, toy_pair.task_dir, root / "lm_eval", *lm_eval_flags)]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved_argv
    return root, arguments, done, samples_folder(root / "lm_eval")


@pytest.mark.slow
def test_the_prompts_scored_are_those_lm_evals_cli_builds_with_the_same_flags(chat_sweep):
    root, _, done, lm_eval_folder = chat_sweep
    pre = json.loads(point_file(root / "run", "pre").read_text())
    for task in pre["tasks"]:
        [log] = lm_eval_folder.glob(f"samples_{task['task']}_*.jsonl")
        records = {record["doc_id"]: record for record in map(json.loads, log.read_text().splitlines())}
        prompts = {task["doc_ids"][key]: text["prompt"] for key, text in task["texts"].items()}
        correct = {task["doc_ids"][key]: value for key, value in task["correct"].items()}
        assert sorted(prompts) == sorted(records) == list(range(LIMIT))
        for doc_id, record in records.items():
            contexts = {request["arg_0"] for request in record["arguments"].values()}
            assert contexts == {prompts[doc_id]}, doc_id
            assert correct[doc_id] == bool(record["acc"]), doc_id
        assert prompts[0].startswith(f"system : {SYSTEM} \nuser : ") and prompts[0].count("assistant : ") == 3
    results = json.loads((root / "run" / "results.json").read_text())
    assert results["settings"]["lm_eval"] == {
        "num_fewshot": 2,
        "apply_chat_template": True,
        "fewshot_as_multiturn": True,
        "system_instruction": SYSTEM,
        "gen_kwargs": None,
        "model_args": None,
    }
    expected = f"--num_fewshot 2, --apply_chat_template, --fewshot_as_multiturn, --system_instruction {SYSTEM!r}"
    assert f"- lm-eval settings: {expected}" in (root / "run" / "report.md").read_text()


@pytest.mark.slow
def test_a_rerun_resumes_and_other_settings_are_refused(chat_sweep):
    root, arguments, _, _ = chat_sweep
    points = {path: path.stat().st_mtime_ns for path in (root / "run" / "points").iterdir()}
    done = cli(*arguments, cwd=root)
    assert done.returncode == 0 and "evaluated 0 models, resumed 3" in done.stdout, done.stderr[-2000:]
    for other in (["--num-fewshot", "1"], ["--no-fewshot-as-multiturn"], ["--system-instruction", "Be brief."]):
        changed = [*arguments[: -len(CHAT_FLAGS)], *CHAT_FLAGS, *other]
        done = cli(*changed, cwd=root)
        assert done.returncode == 2 and "holds a sweep with other settings (lm_eval:" in done.stderr, done.stderr
    assert arguments[-len(CHAT_FLAGS) :] == CHAT_FLAGS
    done = cli(*arguments[: -len(CHAT_FLAGS)], cwd=root)  # lm-eval's defaults now
    assert done.returncode == 2 and "other settings (lm_eval:" in done.stderr, done.stderr
    assert {path: path.stat().st_mtime_ns for path in (root / "run" / "points").iterdir()} == points


def set_outcomes(folder: Path, label: str, fractions: tuple[float, float, float, float], seed: int = 0) -> None:
    """Rewrite a saved point's outcomes: the first share of each task's selection docs (old task, new task) and of
    its report docs (old, new) correct, the rest wrong."""
    path = point_file(folder, label)
    data = json.loads(path.read_text())
    for task in data["tasks"]:
        selection, report = split_docs(task["correct"], seed, 0.5)
        share = (
            dict(zip(("old", "new"), fractions[:2], strict=True)),
            dict(zip(("old", "new"), fractions[2:], strict=True)),
        )
        for keys, wanted in zip((selection, report), share, strict=True):
            for index, key in enumerate(keys):
                task["correct"][key] = index < round(wanted[task["group"]] * len(keys))
    path.write_text(json.dumps(data) + "\n")


@pytest.mark.slow
def test_the_pick_says_when_another_alpha_beats_it_and_what_it_keeps(toy_pair, linear_sweep, tmp_path):
    """A sweep whose saved points are built to show it: alpha 0.25 wins the selection docs, 0.5 wins the report
    docs by far. stdout and report.md name 0.5 in a warning; new skill kept is (new - new_pre) / (new_post - new_pre)
    beside forgetting recovered."""
    from test_sweep import settings_for

    from mergekit_lite.cli.sweep import summary

    folder = Path(shutil.copytree(linear_sweep.out, tmp_path / "run"))
    for label, fractions in {
        "pre": (1, 0, 1, 0),
        "post": (0, 1, 0, 1),
        "alpha=0.0": (1, 0, 1, 0),
        "alpha=0.25": (1, 1, 0.5, 0.25),
        "alpha=0.5": (0.9, 0.9, 1, 1),
        "alpha=0.75": (0, 1, 0, 1),
        "alpha=1.0": (0, 1, 0, 1),
    }.items():
        set_outcomes(folder, label, fractions)
    result = run_sweep(settings_for(toy_pair, folder))
    text = summary(result)
    results = json.loads((folder / "results.json").read_text())
    report = (folder / "report.md").read_text()

    assert result.evaluated == [] and results["pick"]["alpha"] == 0.25 and results["better"] == ["alpha=0.5"]
    low, high = next(p for p in results["points"] if p["alpha"] == 0.5)["intervals"]["diff_to_pick"]
    assert low > 0
    warning = (
        f"on the report split alpha=0.5 (HM - pick [{low:+.3f}, {high:+.3f}]) beats the pick with an interval "
        "above zero"
    )
    assert f"warning: {warning}" in text and f"**Warning: {warning}" in report
    kept = (results["pick"]["new"] - results["pre"]["new"]) / (results["post"]["new"] - results["pre"]["new"])
    recovered = (results["pick"]["old"] - results["post"]["old"]) / (results["pre"]["old"] - results["post"]["old"])
    assert results["kept"] == pytest.approx(kept) and results["recovered"] == pytest.approx(recovered)
    assert f"forgetting recovered {recovered:.1%}, new skill kept {kept:.1%}" in text
    assert f"Forgetting recovered {recovered:.1%}, new skill kept {kept:.1%}." in report
    assert "| 0.5 |" in report and "**beats the pick**" in report

    from mergekit_lite.demo import summary_lines, summary_markdown

    assert any(f"linear warning: {warning}" in line for line in summary_lines({"linear": result}))
    assert f"| {recovered:.1%} | {kept:.1%} |" in summary_markdown({"linear": result}, [])
    comparison = compare({"linear": result}, "linear", tmp_path, 0)
    markdown = comparison_markdown(comparison, comparison_json(comparison))
    assert f"- linear: forgetting recovered {recovered:.1%}, new skill kept {kept:.1%}." in markdown
    assert f"- **linear: warning: {warning}" in markdown
    assert f"linear warning: {warning}" in comparison_summary(comparison)
    assert comparison_json(comparison)["methods"][0]["better"] == ["alpha=0.5"]


@pytest.mark.slow
def test_a_pick_that_is_pre_itself_says_so_instead_of_a_recovery(toy_pair, linear_sweep, tmp_path):
    from test_sweep import settings_for

    from mergekit_lite.cli.sweep import summary

    folder = Path(shutil.copytree(linear_sweep.out, tmp_path / "run"))
    for label, fractions in {
        "pre": (1, 0.5, 1, 0.5),
        "post": (0.5, 1, 0.5, 1),
        "alpha=0.0": (1, 0.5, 1, 0.5),
        "alpha=0.25": (0.5, 0.5, 0.5, 0.5),
        "alpha=0.5": (0.5, 0.5, 0.5, 0.5),
        "alpha=0.75": (0.5, 0.5, 0.5, 0.5),
        "alpha=1.0": (0.5, 1, 0.5, 1),
    }.items():
        set_outcomes(folder, label, fractions)
    result = run_sweep(settings_for(toy_pair, folder))
    text = summary(result)
    results = json.loads((folder / "results.json").read_text())

    assert results["pick"]["alpha"] == 0.0 and results["pick_is"] == "pre"
    assert results["recovered"] is None and results["kept"] is None
    sentence = "the pick is pre itself (linear at alpha=0.0): no merge beat pre on the selection split"
    assert sentence in text and "forgetting recovered" not in text
    assert "The" + sentence[3:] in (folder / "report.md").read_text()
    from mergekit_lite.demo import summary_markdown

    assert "| the pick is pre itself | the pick is pre itself |" in summary_markdown({"linear": result}, [])


@pytest.mark.slow
def test_the_same_command_with_replay_and_save_best_runs_again(toy_pair, linear_sweep, tmp_path):
    """Run twice, the second run resumes every point and writes its replay file and model folder again; a file or
    folder it did not write is still refused."""
    folder = Path(shutil.copytree(linear_sweep.out, tmp_path / "run"))
    replay, best = tmp_path / "replay.jsonl", tmp_path / "best"
    arguments = [
        *pair_arguments(toy_pair.pre_dir, toy_pair.post_dir, toy_pair, folder),
        "--alphas",
        "0:1:0.25",
        "--replay",
        replay,
        "--save-best",
        best,
    ]
    for _attempt in range(2):
        done = cli(*arguments, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "resumed 7" in done.stdout and f"as a model folder: {best}" in done.stdout
        assert replay.is_file() and list(best.glob("*.safetensors"))
    written = json.loads((folder / "outputs.json").read_text())
    assert set(written) == {"replay", "save_best"}
    replay.write_text(replay.read_text() + "\n")  # changed since: not the file the sweep wrote
    done = cli(*arguments, cwd=tmp_path)
    assert done.returncode == 2 and "already exists and is not a file mergekit-lite wrote" in done.stderr
    replay.unlink()
    (best / "notes.txt").write_text("mine")
    done = cli(*arguments, cwd=tmp_path)
    assert done.returncode == 2 and "holds files mergekit-lite did not write" in done.stderr, done.stderr
    assert (best / "notes.txt").read_text() == "mine"


def test_a_tokenizer_that_encodes_a_prompt_to_nothing_is_one_line(toy_pair, tmp_path):
    """A tokenizer whose normalizer removes every letter encodes the toy prompts to no tokens: lm-eval's bare
    assertion becomes one line naming the cause, and the run folder is taken back."""
    pre = Path(shutil.copytree(toy_pair.pre_dir, tmp_path / "pre"))
    tokenizer = json.loads((pre / "tokenizer.json").read_text())
    tokenizer["normalizer"] = {"type": "Replace", "pattern": {"Regex": "[a-z]"}, "content": ""}
    (pre / "tokenizer.json").write_text(json.dumps(tokenizer))
    settings = SweepSettings(
        pre,
        toy_pair.post_dir,
        "linear",
        [0.5],
        toy_pair.old_tasks,
        toy_pair.new_tasks,
        toy_pair.task_dir,
        tmp_path / "run",
        limit=4,
        selection="none",
    )
    with pytest.raises(InputError, match="the tokenizer encodes a prompt or an answer to no tokens"):
        run_sweep(settings)
    assert not (tmp_path / "run").exists()


def test_settings_pass_through_asdict_as_ray_actors_rebuild_them(toy_pair, tmp_path):
    from dataclasses import asdict

    settings = settings_from_dict(
        dict(
            pre=str(toy_pair.pre_dir),
            post=str(toy_pair.post_dir),
            method="linear",
            alphas=[0.5],
            old_tasks=["a"],
            new_tasks=["b"],
            out=str(tmp_path / "run"),
            num_fewshot=3,
            apply_chat_template="tool_use",
        )
    )
    assert SweepSettings(**asdict(settings)) == settings
    assert settings.identity()["lm_eval"] == {"num_fewshot": 3, "apply_chat_template": "tool_use"}
    assert "lm_eval" not in settings_from_dict({**asdict(settings), "lm_eval": None}).identity()


@pytest.mark.slow
def test_lm_evals_chat_outputs_are_reused_under_the_same_flags_and_refused_under_others(chat_sweep, toy_pair):
    """--pre-results on lm-eval's own CLI run with the sweep's chat flags: taken, scoring pre as the sweep did;
    without the system instruction, with another template or without the template, refused naming that."""
    from mergekit_lite.sweep.reuse import reused_endpoints

    root, _, _, lm_eval_folder = chat_sweep
    data = {
        "pre": str(root / "pre"),
        "post": str(root / "post"),
        "method": "linear",
        "alphas": [0.5],
        "old_tasks": toy_pair.old_tasks,
        "new_tasks": toy_pair.new_tasks,
        "include_path": str(toy_pair.task_dir),
        "out": str(root / "elsewhere"),
        "limit": LIMIT,
        "pre_results": str(lm_eval_folder),
        "num_fewshot": 2,
        "apply_chat_template": True,
        "fewshot_as_multiturn": True,
        "system_instruction": SYSTEM,
    }
    [reused] = reused_endpoints(settings_from_dict(data)).values()
    evaluated = json.loads(point_file(root / "run", "pre").read_text())["tasks"]
    assert {run.task: run.outcomes.correct for run in reused} == {task["task"]: task["correct"] for task in evaluated}
    for changes, named in (
        ({"system_instruction": None}, "system_instruction"),
        ({"apply_chat_template": None, "fewshot_as_multiturn": None}, "apply_chat_template True (this sweep: False)"),
        ({"fewshot_as_multiturn": False}, "fewshot_as_multiturn True (this sweep: False)"),
    ):
        with pytest.raises(InputError, match=re.escape(named)):
            reused_endpoints(
                settings_from_dict({key: value for key, value in {**data, **changes}.items() if value is not None})
            )
    other = with_chat_template(toy_pair.pre_dir, root / "other-template")
    template = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**template, "chat_template": CHAT_TEMPLATE + " "}))
    with pytest.raises(InputError, match="chat template sha256"):
        reused_endpoints(settings_from_dict({**data, "pre": str(other)}))
    assert not (root / "elsewhere").exists()
