"""Hostile input on the surfaces of chat templates, lm-eval settings, the forgetting matrix, drift and sweep grids,
through the real CLI: each refusal is one line `error: ...` naming the input, exit code 2, written before any model
is scored, and the user's folders (inputs, the secret a link points to) hash the same before and after: nothing
was written, and nothing outside the paths named was read (the secret never reaches the output; a FIFO outside
would have blocked whatever opened it).

Classes: a file of a model or task folder that links out of it (every side file transformers, PEFT and lm-eval
open by name); user errors that were tracebacks (seeds, -inf log-likelihoods, demonstrations vs docs, chat
templates that are not templates, mistyped model arguments); non-finite weights (drift, sweep); malformed key=value
settings; grid values no forward pass survives.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from test_forgetting_matrix import post_forgetting, pre_correct, write_run
from test_safety import one_error_line, run, tree_hash

from mergekit_lite.cli.main import main
from mergekit_lite.evaluate.lm_eval_settings import HFLM_ARGS, MODEL_ARG_TYPES

SECRET = "hunter2"
# a chat template the toy tokenizer can encode, which the secret file holds too (so following the link would work)
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def invoke(*args, cwd: Path) -> subprocess.CompletedProcess:
    """`mergekit-lite ARGS` in `cwd` through the CLI's click group in this process (its one-line errors and exit
    codes), stdout and stderr apart."""
    argv = list(map(str, args))
    cwd_before = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(main, argv)
    finally:
        os.chdir(cwd_before)
    return subprocess.CompletedProcess(argv, result.exit_code, result.stdout, result.stderr)


@pytest.fixture
def room(toy_pair, tmp_path) -> Path:
    """A user's working folder (pre, post, tasks: the toy pair's) and, outside it, a secret that holds a valid chat
    template and a password."""
    work = tmp_path / "work"
    for name, source in (("pre", toy_pair.pre_dir), ("post", toy_pair.post_dir), ("tasks", toy_pair.task_dir)):
        shutil.copytree(source, work / name)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.jinja").write_text(f"{TEMPLATE}{{# password={SECRET} #}}")
    return work


def refused(room: Path, *args, patterns=(), timeout: float | None = None) -> str:
    """One error line matching `patterns`, exit 2, the working folder and the outside one exactly as they were,
    the secret nowhere in what the command printed."""
    folders = [room, room.parent / "outside"]
    before = [tree_hash(folder) for folder in folders]
    result = run(*args, cwd=room, timeout=timeout) if timeout else invoke(*args, cwd=room)
    line = one_error_line(result, 2, *patterns)
    assert SECRET not in result.stdout + result.stderr
    assert [tree_hash(folder) for folder in folders] == before
    return line


def sweep(*extra) -> list:
    """A sweep of the room's pair at alpha 0.5 (an --alphas in `extra` replaces it: the last one given counts)."""
    return [
        "sweep",
        "--pre",
        "pre",
        "--post",
        "post",
        "--old-tasks",
        "toy_old",
        "--new-tasks",
        "toy_new",
        "--include-path",
        "tasks",
        "--limit",
        "4",
        "--alphas",
        "0.5",
        "--out",
        "run",
        "-q",
        *extra,
    ]


def merge(*extra) -> list:
    return ["merge", "--method", "linear", "--base", "pre", "--model", "post", "--alpha", "0.5", "--out", "m", "-q"] + [
        *extra
    ]


def link_out(room: Path, relative: str) -> str:
    """Replace (or add) `relative` in the working folder with a link to the secret outside; its pattern."""
    path = room / relative
    path.parent.mkdir(exist_ok=True)
    if path.exists():
        path.unlink()
    path.symlink_to(room.parent / "outside" / "secret.jinja")
    return rf"{relative.replace('.', chr(92) + '.')}: not a regular file inside \S+ \(a link out of the folder"


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


# ------------------------------------------------------------------------ 1. reads stay inside the paths named


def test_a_chat_template_linking_out_is_refused_by_sweep_and_merge(room):
    """The case that rendered the secret into every prompt of a sweep, and made merge skip the tokenizer files."""
    pattern = link_out(room, "pre/chat_template.jinja")
    refused(room, *sweep("--apply-chat-template"), patterns=[pattern])
    refused(room, *merge(), patterns=[pattern])


@pytest.mark.parametrize(
    "relative",
    [
        "pre/tokenizer.json",
        "pre/tokenizer_config.json",
        "pre/generation_config.json",
        "pre/special_tokens_map.json",
        "pre/README.md",
        "pre/additional_chat_templates/tool_use.jinja",
        "post/chat_template.jinja",
        "post/tokenizer_config.json",
    ],
)
def test_every_side_file_linking_out_is_refused_by_every_command_reading_the_folder(room, relative):
    """Siblings: every file transformers, PEFT or our own readers open by name, in either input, for every command
    that reads a model folder (merge, sweep, drift, extract)."""
    pattern = link_out(room, relative)
    refused(room, *merge(), patterns=[pattern])
    refused(room, *sweep(), patterns=[pattern])
    refused(room, "drift", "pre", "post", "--json", patterns=[pattern])
    refused(room, "extract", "--base", "pre", "--model", "post", "--rank", "2", "--out", "a", patterns=[pattern])


def test_a_linked_out_folder_and_copy_files_from_are_refused(room):
    (room / "pre" / "additional_chat_templates").symlink_to(room.parent / "outside", target_is_directory=True)
    refused(room, *merge(), patterns=[r"pre/additional_chat_templates: a link out of pre"])
    (room / "pre" / "additional_chat_templates").unlink()
    shutil.copytree(room / "post", room / "donor")
    pattern = link_out(room, "donor/tokenizer.json")
    refused(room, *merge("--copy-files-from", "donor"), patterns=[pattern])


def test_task_files_linking_out_or_including_a_file_outside_are_refused(room):
    """lm-eval reads every YAML under --include-path and every file its `include:` names."""
    outside = room.parent / "outside"
    (outside / "base.yaml").write_text("output_type: multiple_choice\n")
    config = yaml.safe_load((room / "tasks" / "toy_old.yaml").read_text())
    (room / "tasks" / "toy_old.yaml").write_text(yaml.safe_dump({**config, "include": "../../outside/base.yaml"}))
    refused(room, *sweep(), patterns=[r"tasks/toy_old\.yaml: include: '\.\./\.\./outside/base\.yaml' is not a regular"])
    (room / "tasks" / "toy_old.yaml").write_text(yaml.safe_dump(config))
    (room / "tasks" / "extra.yaml").symlink_to(outside / "base.yaml")
    refused(room, *sweep(), patterns=[r"tasks/extra\.yaml: not a regular file inside tasks \(a link out"])


def test_a_link_to_a_fifo_outside_is_refused_without_opening_it(room):
    """Had anything opened the link's target, it would block on the FIFO: the command ends, refused, at once."""
    os.mkfifo(room.parent / "outside" / "pipe")
    (room / "pre" / "chat_template.jinja").symlink_to(room.parent / "outside" / "pipe")
    refused(room, *merge(), timeout=60, patterns=[r"pre/chat_template\.jinja: not a regular file inside pre"])


# ---------------------------------------------------------------------- 2. user errors that were tracebacks


def test_negative_or_huge_seeds_are_refused_as_flags(room):
    for args in (
        ["forgetting", "pre", "post", "--matrix", "out", "--matrix-seed", "-1"],
        sweep("--seed", "-1"),
        sweep("--seed", str(2**64)),
        ["demo", "--out", "demo", "--seed", "-1"],
    ):
        flag = "--matrix-seed" if "--matrix-seed" in args else "--seed"
        refused(room, *args, patterns=[rf"Invalid value for '{flag}': -?\d+ is not in the range 0<=x<="])


@pytest.mark.parametrize("infinity", ["-inf", "inf"])
def test_an_infinite_log_likelihood_is_refused_by_the_logprob_matrix(tmp_path, infinity):
    """NaN was refused already (read as not logged); an infinite gold log-likelihood would reach the SVD."""
    pre = write_run(tmp_path / "pre", pre_correct())
    posts = [write_run(tmp_path / f"ft{i}", post_forgetting(range(i, i + 5))) for i in range(3)]
    samples = next(posts[1].glob("samples_*.jsonl"))
    lines = samples.read_text().splitlines()
    record = json.loads(lines[7])
    record["filtered_resps"][0][0] = infinity
    lines[7] = json.dumps(record)
    samples.write_text("\n".join(lines) + "\n")
    line = refused(
        tmp_path, "forgetting", "pre", "ft0", "ft1", "ft2", "--matrix", "out", "--value", "logprob",
        patterns=[rf"ft1: task 'old' doc '\S+': the gold answer's log-likelihood is {infinity}"],
    )  # fmt: skip
    assert "--value outcome" in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--num-fewshot", "--realign-shots"])
def test_more_demonstrations_than_docs_are_refused_before_pre_is_scored(room, flag):
    """The toy tasks hold 64 docs each: 65 demonstrations cannot be drawn (lm-eval's "Sample larger than
    population", once pre and post had been scored)."""
    refused(room, *sweep(flag, "65"), patterns=[rf"{flag} 65: task 'toy_\w+' has 64 docs to draw demonstrations"])
    assert not (room / "run").exists()


@pytest.mark.parametrize(
    "template, pattern",
    [
        (5, r"expected a Jinja template \(text\), got int 5"),
        ("{% for m in messages %}", r"not a valid Jinja template \(Unexpected end of template"),
        ({"default": ["x"]}, r"\(template 'default'\): expected a Jinja template \(text\), got list"),
    ],
    ids=["number", "syntax", "named"],
)
def test_a_chat_template_that_is_no_template_is_refused_up_front(room, template, pattern):
    """Sibling: merge would carry it into the output's tokenizer config, where it breaks the merged model."""
    edit_json(room / "post" / "tokenizer_config.json", chat_template=template)
    refused(
        room, *sweep("--apply-chat-template"), patterns=[r"^error: --apply-chat-template: the chat template", pattern]
    )
    refused(room, *merge(), patterns=[r"post/tokenizer_config\.json: chat_template", pattern])


@pytest.mark.parametrize(
    "option, value, pattern",
    [
        ("--model-args", "max_length=abc", r"model_args: max_length='abc' is not a whole number >= 1"),
        ("--model-args", "max_length=0", r"model_args: max_length=0 is not a whole number >= 1"),
        ("--model-args", "truncation=maybe", r"model_args: truncation='maybe' is not True or False"),
        ("--model-args", "max_batch_size=2.5", r"model_args: max_batch_size=2\.5 is not a whole number >= 1"),
        ("--gen-kwargs", "temperature=hot", r"gen_kwargs: temperature='hot' is not a number"),
        ("--gen-kwargs", "max_gen_toks=ten", r"gen_kwargs: max_gen_toks='ten' is not a whole number"),
    ],
)
def test_mistyped_model_and_generation_arguments_are_refused_before_any_model_is_read(room, option, value, pattern):
    refused(room, *sweep(option, value), patterns=[pattern])


def test_the_model_argument_types_are_those_hflm_declares():
    """Our table of what HFLM takes against lm-eval's own signature (the outside reference it stands for)."""
    import typing

    from lm_eval.models.huggingface import HFLM

    hints = typing.get_type_hints(HFLM.__init__)
    for name in HFLM_ARGS:
        declared = typing.get_args(hints[name]) or (hints[name],)
        ours = MODEL_ARG_TYPES[name] if isinstance(MODEL_ARG_TYPES[name], tuple) else (MODEL_ARG_TYPES[name],)
        assert set(ours) <= set(declared), (name, declared, ours)


# ------------------------------------------------------------------------------------ 3. non-finite weights


def poison(folder: Path, value: float) -> str:
    """One entry of one tensor of a model folder set to `value`; the tensor's name."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(name for name in index if name.endswith("q_proj.weight"))
    state = load_file(folder / index[name])
    state[name][0, 0] = value
    save_file(state, folder / index[name], metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_drift_refuses_non_finite_weights_or_reports_them_as_null(room, value):
    name = poison(room / "post", value)
    pattern = rf"tensor {name} in post/\S+\.safetensors has NaN or Inf values \(pass --allow-nonfinite"
    refused(room, "drift", "pre", "post", "--json", patterns=[pattern])
    result = invoke("drift", "pre", "post", "--json", "--allow-nonfinite", cwd=room)
    assert result.returncode == 0, result.stderr

    def no_constant(constant):
        raise AssertionError(f"{constant} in JSON output")

    report = json.loads(result.stdout, parse_constant=no_constant)  # strict JSON: null, never NaN
    assert report["tensors"][name]["relative_drift"] is None and report["relative_drift"] is None
    layer = int(name.split(".")[2])
    assert report["layers"][layer]["relative_drift"] is None and report["layers"][layer]["modules"]["q"] is None
    other = report["layers"][1 - layer]["relative_drift"]
    assert isinstance(other, float) and np.isfinite(other)
    assert result.stderr.startswith("warning: 1 tensor(s) hold NaN or Inf values") and name in result.stderr


def test_a_sweep_refuses_non_finite_weights_before_any_point_is_scored(room):
    """Sibling: a sweep over a post with NaN weights scored it and exited 0."""
    name = poison(room / "post", float("nan"))
    refused(room, *sweep(), patterns=[rf"tensor {name} in post/\S+ has NaN or Inf values \(a sweep needs finite"])
    assert not (room / "run").exists()


# ------------------------------------------------------------------------------- 4. malformed key=value items


@pytest.mark.parametrize(
    "option, value, pattern",
    [
        ("--gen-kwargs", "temperature", r"gen_kwargs: 'temperature' is not NAME=VALUE \(no '='\)"),
        ("--gen-kwargs", "=1", r"gen_kwargs: '=1' has no NAME before its '='"),
        ("--gen-kwargs", "temperature=0,temperature=1", r"gen_kwargs: 'temperature' is given twice"),
        ("--model-args", "max_length", r"model_args: 'max_length' is not NAME=VALUE \(no '='\)"),
        ("--model-args", "max_length=", r"model_args: 'max_length=' gives max_length no value"),
        ("--model-args", " =64", r"model_args: '=64' has no NAME before its '='"),
    ],
)
def test_malformed_settings_are_refused_naming_the_item(room, option, value, pattern):
    refused(room, *sweep(option, value), patterns=[pattern])


def test_malformed_vllm_arguments_go_through_the_same_validator(room):
    """Sibling: --vllm-args has its own names but the same syntax."""
    for value, pattern in (
        ("tensor_parallel_size", r"--vllm-args: 'tensor_parallel_size' is not NAME=VALUE"),
        ("=2", r"--vllm-args: '=2' has no NAME"),
        ("seed=1,seed=2", r"--vllm-args: 'seed' is given twice"),
    ):
        refused(room, *sweep("--backend", "vllm", "--vllm-args", value), patterns=[pattern])


# ----------------------------------------------------------------------------------- 5. grids checked up front


@pytest.mark.parametrize(
    "extra, pattern",
    [
        (
            ["--method", "lines", "--alphas", "0.5", "--betas", "1e38"],
            r"betas: 1e\+38 overflows float32 in the forward",
        ),
        (["--method", "lines", "--alphas", "0.5", "--beta", "1e20"], r"beta: 1e\+20 overflows float32 in the forward"),
        (["--method", "task_arithmetic", "--alphas", "0.5,1e38"], r"alphas: 1e\+38 overflows float32 in the forward"),
        (
            ["--method", "task_arithmetic", "--alphas", "0,300", "--eval-dtype", "fp16"],
            r"alphas: 300\.0 overflows float16",
        ),
        (
            ["--method", "lines", "--alphas", "1e19", "--betas", "1e19"],
            r"alphas \+ betas: 2e\+19 overflows float32 in the forward",
        ),
    ],
    ids=["lines-betas", "lines-beta", "task-arithmetic", "fp16", "lines-last-layer"],
)
def test_grid_values_no_forward_pass_survives_are_refused_before_any_evaluation(room, extra, pattern):
    refused(room, *sweep(*extra), patterns=[pattern])
    assert not (room / "run").exists()


def test_a_point_with_non_finite_logits_is_named_on_stderr(room):
    """1e18 passes the check (the weights and most products stay finite) yet the toy's logits are NaN there: the
    sweep ends with a pick, and says on stderr, as report.md does, which model was broken."""
    result = invoke(*sweep("--method", "task_arithmetic", "--alphas", "0.5,1e18"), cwd=room)
    assert result.returncode == 0, result.stderr
    assert "warning: 1 model(s) gave NaN or infinite logits (alpha=1e+18)" in result.stderr
    assert "Non-finite logits" in (room / "run" / "report.md").read_text()
