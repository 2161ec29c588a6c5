"""Classes of hostile input, each with several variants, through the real CLI (in a subprocess
where an input could block, else through its click group in-process).

Every refusal is one line `error: ...` on stderr with exit code 2 (an audit's REJECTED verdict: exit 1), and the
working folder (inputs, and any folder a user keeps there) hashes the same before and after: nothing was
removed, replaced or half-written. FIFOs stand for every kind of file that blocks when opened; each run has a
timeout, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from test_safety import CLI, ENV, cli, lm_eval_output, one_error_line, run, tree_hash
from tiny_models import save_tiny_llama, tiny_llama

from mergekit_lite.errors import InputError
from mergekit_lite.io.outputs import OUTPUT_MARKER
from mergekit_lite.sweep.result import pareto_front, pick
from mergekit_lite.sweep.scoring import PointResult, Scores, TaskRun

TARGET = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A user's working folder: pre/ and post/ (tiny Llamas), a LoRA adapter made on pre, texts and notes."""
    root = tmp_path_factory.mktemp("hostile")
    save_tiny_llama(0, root / "pre")
    save_tiny_llama(1, root / "post")
    peft_model = get_peft_model(
        tiny_llama(0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    peft_model.save_pretrained(root / "lora")
    (root / "texts.txt").write_text("the cat sat\nthe dog ran\n")
    (root / "notes.txt").write_text("a file of the user's")
    return root


@pytest.fixture
def fresh(work, tmp_path) -> Path:
    return Path(shutil.copytree(work, tmp_path / "work", symlinks=True))


def refused(folder: Path, *args, patterns=(), code: int = 2, timeout: float | None = None) -> str:
    """Run the CLI in `folder`; one error line matching `patterns`, and the folder exactly as it was.

    With a `timeout` (an input that could block) in a subprocess the timeout can end; else in this process
    through the CLI's click group (the console script's error handling, without a torch import per run; any
    warning raised, so the one-line check also covers what a fresh process would print)."""
    before = tree_hash(folder)
    result = run(*args, cwd=folder, timeout=timeout) if timeout is not None else cli(*args, cwd=folder)
    line = one_error_line(result, code, *patterns)
    assert tree_hash(folder) == before
    return line


def lerp(*extra) -> list:
    return ["merge", "--method", "linear", "--base", "pre", "--model", "post", "--alpha", "0.5", "-q", *extra]


def edit_tensor(folder: Path, name: str, edit) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = folder / index[name]
    state = load_file(shard)
    state[name] = edit(state[name])
    save_file(state, shard, metadata={"format": "pt"})


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


# ------------------------------------------------------------------- 1. --overwrite replaces only our outputs


def add_notes(out: Path) -> str:
    (out / "notes.md").write_text("mine")
    return r"\(notes\.md\)"


def change_config(out: Path) -> str:
    edit_json(out / "config.json", my_comment="kept here")
    return r"\(config\.json\)"


def add_subfolder(out: Path) -> str:
    (out / "data").mkdir()
    (out / "data" / "train.jsonl").write_text("{}\n")
    return r"data/train\.jsonl"


def add_link(out: Path) -> str:
    (out / "elsewhere").symlink_to(out.parent / "notes.txt")
    return r"elsewhere"


def legacy_marker(out: Path) -> str:
    """An output of an older version (a marker without the list of files): none of its files can be told ours."""
    (out / OUTPUT_MARKER).write_text("written by mergekit-lite; --overwrite may replace this folder\n")
    return r"config\.json, generation_config\.json, mergekit_lite_config\.yaml, model\.safetensors"


@pytest.mark.parametrize("spoil", [add_notes, change_config, add_subfolder, add_link, legacy_marker])
def test_overwrite_refuses_a_merge_output_holding_anything_else(fresh, spoil):
    """A published merge downloaded next to a user's notes (or changed by them) is not replaced; its own files are
    named; an untouched output of ours still is replaced."""
    assert cli(*lerp("--out", "merged"), cwd=fresh).returncode == 0
    pattern = spoil(fresh / "merged")
    refused(
        fresh,
        *lerp("--out", "merged", "--overwrite"),
        patterns=[r"^error: merged: holds files mergekit-lite did not write there", pattern],
    )


def test_overwrite_replaces_an_untouched_output_of_merge_and_of_extract(fresh):
    extract = ["extract", "--base", "pre", "--model", "post", "--rank", "2", "--out", "adapter"]
    for command in (lerp("--out", "merged"), extract):
        assert cli(*command, cwd=fresh).returncode == 0
        again = cli(*command, "--overwrite", cwd=fresh)
        assert again.returncode == 0, again.stderr
    add_notes(fresh / "adapter")
    refused(
        fresh,
        *extract,
        "--overwrite",
        patterns=[r"adapter: holds files mergekit-lite did not write there \(notes\.md\)"],
    )


# ------------------------------------------------------------------------------- 2. nothing blocks on a file


def blocking_file(kind: str, path: Path) -> Path:
    """A FIFO, a UNIX socket, or a character device standing where a file is named."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.close()
    else:
        return Path("/dev/zero")
    return path


HANG_CASES = {
    "merge-config": lambda f: ["merge", f, "--out", "m"],
    "recall-texts": lambda f: [
        "merge",
        "--method",
        "recall",
        "--base",
        "pre",
        "--model",
        "post",
        "--recall-texts",
        f,
        "--out",
        "m",
    ],
    "train-data": lambda f: ["audit", "lora", "--base", "pre", "--train-data", f, "--holdout", "texts.txt"],
    "holdout": lambda f: ["audit", "lora", "--base", "pre", "--train-data", "texts.txt", "--holdout", f],
    "sweep-config": lambda f: ["sweep", f, "--out", "runs"],
    "forgetting-samples": lambda f: ["forgetting", f, f],
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
@pytest.mark.parametrize("case", list(HANG_CASES))
def test_a_fifo_socket_or_device_named_as_an_input_file_is_refused_without_blocking(fresh, case, kind):
    special = blocking_file(kind, fresh / "special.jsonl")
    name = str(special) if kind == "device" else special.name
    refused(fresh, *HANG_CASES[case](name), timeout=60, patterns=[r"not a regular file|not an lm-eval samples file"])


@pytest.mark.slow
def test_recall_weights_file_fifo_is_refused(fresh):
    os.mkfifo(fresh / "weights.json")
    (fresh / "recall.yaml").write_text(
        "method: recall\nbase: pre\nmodels:\n  - model: post\nrecall:\n  weights_file: weights.json\n"
    )
    refused(
        fresh,
        "merge",
        "recall.yaml",
        "--out",
        "m",
        timeout=60,
        patterns=[r"weights\.json: not a regular file \(a FIFO, socket or device\); give a weights file"],
    )


# --------------------------------------------------------------------- 3. one line instead of a traceback


def mergekit_linear(weights) -> str:
    models = "".join(
        f"  - model: {model}\n    parameters: {{weight: {weight}}}\n"
        for model, weight in zip(("pre", "post", "lora"), weights, strict=False)  # as many names as weights given
    )
    return f"merge_method: linear\nmodels:\n{models}"


@pytest.mark.parametrize(
    "args, config",
    [
        (["--method", "linear", "--base", "pre", "--model", "post:-1"], None),
        (["--method", "linear", "--model", "pre:2", "--model", "post:-2"], None),
        ([], mergekit_linear([1, -1])),
        ([], mergekit_linear([2.5, -2.5])),
        (
            [],
            "method: multislerp\nmodels:\n  - model: pre\n    parameters: {weight: 1}\n"
            "  - model: post\n    parameters: {weight: -1}\n",
        ),
    ],
    ids=["flags-with-base", "flags", "mergekit-yaml", "mergekit-yaml-fractions", "multislerp"],
)
def test_weights_summing_to_zero_are_one_line(fresh, args, config):
    if config:
        (fresh / "zero.yaml").write_text(config)
        args = ["zero.yaml", *args]
    refused(fresh, "merge", *args, "--out", "m", patterns=[r"weights .* sum to zero"])


@pytest.mark.parametrize(
    "content, pattern",
    [
        (b"the cat\x00\x01\x02 sat\n", r"binary data, not text \(NUL byte at offset 7\)"),
        (b"caf\xe9 au lait\n", r"not UTF-8 text \(bad byte at offset 3\)"),
        (bytes(range(256)) * 4, r"binary data, not text"),
        (b"\xff\xfe" + "utf-16 text".encode("utf-16-le"), r"binary data|not UTF-8 text"),
    ],
    ids=["nul", "latin-1", "random-bytes", "utf-16"],
)
@pytest.mark.parametrize("where", ["recall-texts", "train-data", "holdout"])
def test_binary_or_non_utf8_text_files_are_one_line(fresh, content, pattern, where):
    (fresh / "bad.txt").write_bytes(content)
    refused(fresh, *HANG_CASES[where]("bad.txt"), patterns=[r"bad\.txt(:\d+)?: ", pattern])


@pytest.mark.parametrize(
    "method, bool_in", [("linear", "post"), ("ties", "post"), ("slerp", "pre"), ("task_arithmetic", "pre")]
)
def test_a_bool_tensor_where_others_store_floats_is_one_line(fresh, method, bool_in):
    edit_tensor(fresh / bool_in, TARGET, lambda tensor: tensor > 0)
    value = {"linear": ["--alpha", "0.5"], "slerp": ["--t", "0.5"]}.get(method, [])
    refused(
        fresh,
        "merge",
        "--method",
        method,
        "--base",
        "pre",
        "--model",
        "post",
        *value,
        "--out",
        "m",
        patterns=[rf"tensor {TARGET}: (bool in {bool_in} but float32|float32 in \S+ but bool in {bool_in})"],
    )


@pytest.mark.parametrize("side, value", [("post", float("nan")), ("pre", float("inf")), ("post", -float("inf"))])
def test_nan_or_inf_in_extract_inputs_is_one_line(fresh, side, value):
    def spoil(tensor):
        tensor[0, 0] = value
        return tensor

    edit_tensor(fresh / side, TARGET, spoil)
    refused(
        fresh,
        "extract",
        "--base",
        "pre",
        "--model",
        "post",
        "--out",
        "adapter",
        patterns=[rf"tensor {TARGET} in {side} has NaN or Inf values"],
    )


@pytest.mark.parametrize(
    "device, pattern",
    [
        ("bogus", r"device 'bogus' is not a torch device"),
        ("meta", r"device 'meta' is not supported"),
        ("cuda:99", r"device 'cuda:99' is not available here"),
    ],
)
def test_audit_behaviour_device_is_checked_before_any_work(fresh, device, pattern):
    refused(fresh, "audit", "lora", "--base", "pre", "--behaviour", "--device", device, patterns=[pattern])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a GPU")
def test_cuda_asked_of_a_cpu_only_torch_is_one_line(fresh):
    refused(
        fresh,
        "audit",
        "lora",
        "--base",
        "pre",
        "--behaviour",
        "--device",
        "cuda",
        patterns=[r"device 'cuda' is not available here"],
    )
    refused(fresh, *lerp("--device", "cuda", "--out", "m"), patterns=[r"device 'cuda' is not available here"])


# -------------------------------------------------------------------------------- 4. silently wrong, refused


@pytest.mark.parametrize("weights", [(0, 0), (1, -1), (0.5, -0.5)])
def test_nuslerp_weights_without_a_direction_are_refused(fresh, weights):
    models = "".join(
        f"  - model: {model}\n    parameters: {{weight: {weight}}}\n"
        for model, weight in zip(("pre", "post"), weights, strict=True)
    )
    (fresh / "nu.yaml").write_text(f"merge_method: nuslerp\nmodels:\n{models}")
    refused(fresh, "merge", "nu.yaml", "--out", "m", patterns=[r"nuslerp weights .* sum to zero"])


@pytest.mark.parametrize("alpha", [1e30, 1e38, -1e32])
def test_an_adapter_whose_update_overflows_is_rejected_and_never_merged(fresh, alpha):
    edit_json(fresh / "lora" / "adapter_config.json", lora_alpha=alpha)
    audit = cli("audit", "lora", "--base", "pre", "--json", cwd=fresh)
    assert audit.returncode == 1, audit.stderr
    report = json.loads(audit.stdout)["reports"][0]
    assert report["verdict"] == "REJECTED" and "overflows float32" in report["checks"][0]["detail"]
    refused(
        fresh,
        "merge",
        "--method",
        "task_arithmetic",
        "--base",
        "pre",
        "--model",
        "lora",
        "--out",
        "m",
        patterns=[r"adapter lora is REJECTED: format: the update scaling\*B@A overflows float32"],
    )


@pytest.mark.parametrize(
    "declared", ["unsloth/llama-3-8b-bnb-4bit", "TheBloke/Llama-2-7B-GPTQ", "./models/llama-awq", "org/tiny-llama-int4"]
)
def test_a_quantised_declared_base_fails(fresh, declared):
    """As the audit table in docs/audit.md says: REJECTED, whether or not the given base has a hub id to compare with."""
    edit_json(fresh / "lora" / "adapter_config.json", base_model_name_or_path=declared)
    audit = cli("audit", "lora", "--base", "pre", "--json", cwd=fresh)
    assert audit.returncode == 1, audit.stderr
    checks = {check["name"]: check for check in json.loads(audit.stdout)["reports"][0]["checks"]}
    assert checks["base-id"]["status"] == "fail" and "declares a quantised base" in checks["base-id"]["detail"]


@pytest.mark.parametrize("target", ["pre/config.json", "notes.txt", "texts.txt"])
def test_copy_files_from_a_file_is_refused(fresh, target):
    refused(
        fresh,
        *lerp("--copy-files-from", target, "--out", "m"),
        patterns=[rf"{target}: --copy-files-from takes a model folder"],
    )


@pytest.mark.parametrize(
    "text, key",
    [
        ("method: linear\nmethod: slerp\nbase: pre\nmodels:\n  - model: post\n", "method"),
        ("method: linear\nbase: pre\nmodels:\n  - model: post\nparameters:\n  alpha: 0.2\n  alpha: 0.9\n", "alpha"),
        (
            "merge_method: linear\nmodels:\n  - model: pre\n    parameters: {weight: 1, weight: 2}\n  - model: post\n",
            "weight",
        ),
        ("method: linear\nbase: pre\nbase: post\nmodels:\n  - model: post\n", "base"),
    ],
    ids=["top-level", "nested", "flow-mapping", "base"],
)
def test_a_yaml_key_given_twice_is_refused(fresh, text, key):
    (fresh / "twice.yaml").write_text(text)
    refused(
        fresh, "merge", "twice.yaml", "--out", "m", patterns=[rf"twice\.yaml: invalid YAML \(duplicate key '{key}'"]
    )
    refused(fresh, "sweep", "twice.yaml", "--out", "runs", patterns=[rf"duplicate key '{key}'"])


@pytest.mark.parametrize(
    "option, value, hint",
    [
        ("--metric", "accc", r"did you mean 'acc'"),
        ("--metric", "exact", r"logged: acc\)"),
        ("--filter", "nnone", r"did you mean 'none'"),
        ("--filter", "flexible-extract", r"logged: none\)"),
    ],
)
def test_a_global_metric_or_filter_no_task_logs_is_refused(tmp_path, option, value, hint):
    lm_eval_output(tmp_path / "pre", [1, 1, 0, 0])
    lm_eval_output(tmp_path / "post", [1, 0, 1, 0])
    refused(
        tmp_path,
        "forgetting",
        "pre",
        "post",
        option,
        value,
        patterns=[rf"{option} '{value}': no task in pre logs it", hint],
    )


# -------------------------------------------------------------------------------------- 5. wrong types


@pytest.mark.parametrize(
    "text, pattern",
    [
        (
            "method: linear\nbase: pre\nmodels:\n  - model: post\nparameters: {alpha: 0.5}\nout_shard_size: -5\n",
            r"bad size -5 \(must be positive\)",
        ),
        (
            "method: linear\nbase: pre\nmodels:\n  - model: post\nparameters: {alpha: 0.5}\nout_shard_size: 0\n",
            r"bad size 0 \(must be positive\)",
        ),
        (
            "method: linear\nbase: pre\nmodels:\n  - model: post\nparameters: {alpha: 0.5}\nout_shard_size: '-2GB'\n",
            r"bad size '-2GB'",
        ),
        (
            "merge_method: karcher\nmodels:\n  - model: pre\n  - model: post\nparameters: {max_iter: 2.5}\n",
            r"max_iter must be an integer, got 2\.5",
        ),
        (
            "merge_method: karcher\nmodels:\n  - model: pre\n  - model: post\nparameters: {max_iter: [3, 4.5]}\n",
            r"max_iter must be an integer, got 4\.5",
        ),
    ],
    ids=["negative-size", "zero-size", "negative-size-text", "float-max-iter", "float-in-gradient"],
)
def test_wrong_numbers_in_our_yaml_are_refused_where_read(fresh, text, pattern):
    (fresh / "bad.yaml").write_text(text)
    refused(fresh, "merge", "bad.yaml", "--out", "m", patterns=[pattern])


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["audit", "lora", "--base", "pre", "--min-delta", "nan"], r"--min-delta: expected a number, got 'nan'"),
        (["audit", "lora", "--base", "pre", "--max-kl", "NaN"], r"--max-kl: expected a number"),
        (["audit", "lora", "--base", "pre", "--min-similarity", "nan"], r"--min-similarity: expected a number"),
        (lerp("--lambda", "nan", "--out", "m"), r"--lambda: expected a number"),
        (
            ["sweep", "--pre", "pre", "--post", "post", "--confidence", "nan", "--out", "runs"],
            r"--confidence: expected",
        ),
        (["sweep", "--pre", "pre", "--post", "post", "--probe", "nan", "--out", "runs"], r"--probe: expected a number"),
    ],
    ids=["min-delta", "max-kl", "min-similarity", "lambda", "confidence", "probe"],
)
def test_nan_thresholds_are_refused(fresh, args, pattern):
    refused(fresh, *args, patterns=[pattern])


@pytest.mark.parametrize("spec", ["arc=2.5", "arc=1.0001", "arc=3.5e0"])
def test_choices_must_be_whole(tmp_path, spec):
    lm_eval_output(tmp_path / "pre", [1, 1, 0, 0])
    lm_eval_output(tmp_path / "post", [1, 0, 1, 0])
    refused(
        tmp_path,
        "forgetting",
        "pre",
        "post",
        "--choices",
        spec,
        patterns=[r"--choices arc=\S+: K must be a whole number of choices"],
    )


# ---------------------------------------------------------------------- 6. refusals come before torch loads

PROBE = """
import sys
from mergekit_lite.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as exit:
    print(f"exit={exit.code} torch={'torch' in sys.modules}")
"""


@pytest.mark.parametrize(
    "args",
    [
        ["merge", "--help"],
        ["sweep", "--help"],
        ["forgetting", "--help"],
        lerp("--alpha", "1.5", "--out", "m"),
        ["merge", "--method", "linear", "--base", "missing", "--model", "post", "--alpha", "0.5", "--out", "m"],
        lerp("--out", "pre"),
        lerp("--out", "notes.txt/m"),
        [
            "merge",
            "--method",
            "recall",
            "--base",
            "pre",
            "--model",
            "post",
            "--recall-texts",
            "missing.txt",
            "--out",
            "m",
        ],
        ["merge", "--method", "recall_lerp", "--base", "pre", "--model", "post", "--alpha", "0.5", "--out", "pre"],
        ["merge", "--method", "ema", "--decay", "0.5", "--model", "post", "--out", "m"],
        ["merge", "--method", "lines", "--base", "pre", "--model", "post", "--alpha", "nan", "--out", "m"],
        ["merge", "twice.yaml", "--out", "m"],
        ["merge", "special.yaml", "--out", "m"],
        lerp("--out-shard-size", "-1", "--out", "m"),
        [
            "sweep",
            "--pre",
            "pre",
            "--post",
            "post",
            "--alphas",
            "0:1:1e-12",
            "--old-tasks",
            "a",
            "--new-tasks",
            "b",
            "--out",
            "runs",
        ],
        ["sweep", "twice.yaml", "--out", "runs"],
        [
            "sweep",
            "--pre",
            "missing",
            "--post",
            "post",
            "--alphas",
            "0,1",
            "--old-tasks",
            "a",
            "--new-tasks",
            "b",
            "--out",
            "runs",
        ],
        [
            "sweep",
            "--pre",
            "pre",
            "--post",
            "post",
            "--alphas",
            "0,1",
            "--old-tasks",
            "a",
            "--new-tasks",
            "b",
            "--out",
            "theirs",
        ],
        ["forgetting", "missing", "pre"],
        ["forgetting", "special.yaml", "special.yaml"],
        ["forgetting", "pre", "post", "--samples", "s.jsonl", "--heatmap", "h.xyz"],
        [
            "sweep",
            "--pre",
            "pre",
            "--post",
            "post",
            "--method",
            "task_arithmetic",
            "--alphas",
            "0,1e39",
            "--old-tasks",
            "a",
            "--new-tasks",
            "b",
            "--out",
            "runs",
        ],
    ],
    ids=lambda args: " ".join(args[:3]),
)
@pytest.mark.slow
def test_help_and_refusals_never_import_torch(fresh, args):
    """merge, sweep and forgetting check arguments, configs and paths before torch is imported: `--help` and a
    refused run answer without it (checked in sys.modules, not timed)."""
    (fresh / "twice.yaml").write_text("method: linear\nmethod: slerp\n")
    os.mkfifo(fresh / "special.yaml")
    (fresh / "theirs").mkdir()  # a run folder of ours holding a user's file
    (fresh / "theirs" / OUTPUT_MARKER).write_text("a mergekit-lite run folder; reruns resume here\n")
    (fresh / "theirs" / "notes.md").write_text("mine")
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        cwd=fresh,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    code = "0" if "--help" in args else "2"
    assert result.stdout.strip().splitlines()[-1] == f"exit={code} torch=False", (result.stdout, result.stderr)


# ------------------------------------------------------------------------------------ the sweep's run folder


def sweep(*extra) -> list:
    return [
        "sweep",
        "--pre",
        "pre",
        "--post",
        "post",
        "--alphas",
        "0,1",
        "--old-tasks",
        "a",
        "--new-tasks",
        "b",
        "--out",
        "runs",
        *extra,
    ]


def run_folder(root: Path) -> Path:
    """A run folder of ours as a killed sweep leaves it: the marker, the lock, a point and a temporary file."""
    folder = root / "runs"
    (folder / "points").mkdir(parents=True)
    (folder / OUTPUT_MARKER).write_text("a mergekit-lite run folder; reruns resume here\n")
    (folder / ".sweep.lock").write_text("")
    (folder / "points" / "pre.json").write_text("{}")
    (folder / "points" / ".post.json.tmp-123.json").write_text("{")
    return folder


@pytest.mark.parametrize(
    "plant, pattern",
    [
        (lambda folder: (folder / "notes.md").write_text("mine"), r"\(notes\.md\)"),
        (lambda folder: (folder / "report.txt").write_text("mine"), r"\(report\.txt\)"),
        (lambda folder: (folder / "points" / "keep").mkdir(), r"\(points/keep/\)"),
        (lambda folder: os.mkfifo(folder / "points" / "alpha=0.5.json"), r"\(points/alpha=0\.5\.json\)"),
        (lambda folder: blocking_file("socket", folder / "points" / "s.json"), r"\(points/s\.json\)"),
        (lambda folder: (folder / "points" / "x.json").symlink_to(folder.parent / "notes.txt"), r"\(points/x\.json\)"),
    ],
    ids=["notes", "other-report", "folder-in-points", "fifo-point", "socket-point", "link-point"],
)
@pytest.mark.slow
def test_a_run_folder_holding_anything_else_is_refused_before_any_work(fresh, plant, pattern):
    """A run folder resumes only while it holds nothing but what a sweep writes: a user's file is never replaced
    by the report, and a FIFO among the points is never opened (it would block the resume for ever)."""
    plant(run_folder(fresh))
    refused(fresh, *sweep(), timeout=60, patterns=[r"^error: runs: holds files a run does not write", pattern])


@pytest.mark.parametrize(
    "device, pattern",
    [
        ("bogus", r"device 'bogus' is not a torch device"),
        ("meta", r"device 'meta' is not supported"),
        ("cuda:99", r"device 'cuda:99' is not available here"),
    ],
)
@pytest.mark.slow
def test_sweep_device_is_checked_before_any_work(fresh, toy_pair, device, pattern):
    """Real tasks: the sweep checks them (no torch needed) before the device (which loads torch)."""
    args = [
        "sweep",
        "--pre",
        "pre",
        "--post",
        "post",
        "--alphas",
        "0,1",
        "--old-tasks",
        toy_pair.old_tasks[0],
        "--new-tasks",
        toy_pair.new_tasks[0],
        "--include-path",
        str(toy_pair.task_dir),
        "--out",
        "runs",
    ]
    refused(fresh, *args, "--device", device, patterns=[pattern])
    assert not (fresh / "runs").exists()


@pytest.mark.parametrize("line", ["selection_fraction: .nan", "confidence: .NaN", "density: .inf"])
def test_nan_in_a_sweep_config_is_refused(fresh, line):
    (fresh / "sweep.yaml").write_text(f"pre: pre\npost: post\nalphas: '0,1'\nold_tasks: a\nnew_tasks: b\n{line}\n")
    refused(fresh, "sweep", "sweep.yaml", "--out", "runs", patterns=[rf"sweep\.yaml: {line.split(':')[0]}: "])


@pytest.mark.slow
def test_a_fifo_in_the_sweep_task_folder_is_refused_before_lm_eval_reads_it(fresh):
    (fresh / "tasks").mkdir()
    (fresh / "tasks" / "a.yaml").write_text("task: a\n")
    os.mkfifo(fresh / "tasks" / "b.yaml")
    refused(
        fresh,
        *sweep("--include-path", "tasks"),
        timeout=60,
        patterns=[r"tasks/b\.yaml: not a regular file inside tasks \(a FIFO, socket or device\)"],
    )


# ------------------------------------------------------------------------------- a run folder's checkpoints


def ema_run(*extra) -> list:
    return ["merge", "--method", "ema", "--decay", "0.5", "--model", "run", "--order", "step", "-q", *extra]


@pytest.fixture
def training_run(fresh) -> Path:
    """run/ with checkpoint-1 (pre) and checkpoint-2 (post), as transformers' Trainer lays a run out."""
    for step, model in ((1, "pre"), (2, "post")):
        shutil.copytree(fresh / model, fresh / "run" / f"checkpoint-{step}")
    return fresh / "run"


@pytest.mark.parametrize(
    "plant, pattern",
    [
        (lambda run: (run / "checkpoint-3").symlink_to(run.parent / "post"), r"checkpoint-3: a link out of run"),
        (lambda run: (run / "checkpoint-3").symlink_to("../post"), r"checkpoint-3: a link out of run"),
        (lambda run: (run / "checkpoint-3").symlink_to("/"), r"checkpoint-3: a link out of run"),
        (
            lambda run: (run / "checkpoint-3").symlink_to("checkpoint-9"),
            r"checkpoint-3: not a checkpoint folder \(a broken",
        ),
        (lambda run: (run / "checkpoint-3").write_text("weights?"), r"checkpoint-3: not a checkpoint folder"),
        (
            lambda run: (run / "checkpoint-3").symlink_to(run / "checkpoint-1" / "config.json"),
            r"checkpoint-3: not a checkpoint folder",
        ),
    ],
    ids=["absolute-link-out", "relative-link-out", "link-to-root", "broken-link", "file", "link-to-a-file"],
)
def test_a_checkpoint_that_links_out_or_is_no_folder_is_refused_never_dropped(fresh, training_run, plant, pattern):
    plant(training_run)
    refused(fresh, *ema_run("--out", "ema"), patterns=[pattern])


def test_a_checkpoint_linking_inside_the_run_folder_is_followed(fresh, training_run):
    """checkpoint-3 -> checkpoint-1 averages checkpoint-1 twice: the same bytes as naming the three in order."""
    (training_run / "checkpoint-3").symlink_to("checkpoint-1")
    assert cli(*ema_run("--out", "ema"), cwd=fresh).returncode == 0
    listed = [
        "merge",
        "--method",
        "ema",
        "--decay",
        "0.5",
        "-q",
        "--out",
        "listed",
        *[arg for step in (1, 2, 1) for arg in ("--model", f"run/checkpoint-{step}")],
    ]
    assert cli(*listed, cwd=fresh).returncode == 0
    weights = sorted(path.name for path in (fresh / "ema").glob("*.safetensors"))
    assert weights and all(
        (fresh / "ema" / name).read_bytes() == (fresh / "listed" / name).read_bytes() for name in weights
    )


@pytest.mark.parametrize(
    "out, pattern",
    [
        ("run/ema", r"run/ema: is inside the input run"),
        ("run/checkpoint-1/ema", r"is inside the input"),
        ("run", r"run: (is also an input|contains the input run/checkpoint-1)"),
        ("run/../run/x", r"is inside the input run"),
    ],
)
def test_the_output_may_not_sit_inside_the_run_folder(fresh, training_run, out, pattern):
    refused(fresh, *ema_run("--out", out), patterns=[pattern])


# ----------------------------------------------------------------------------------------------- model cards


def card_tokens(card: str) -> list:
    """The card's body as markdown-it (CommonMark + GFM tables) reads it, front matter left out."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table").parse(card.split("---\n", 2)[2])


def inline_children(tokens) -> list:
    return [child for token in tokens if token.type == "inline" for child in token.children]


@pytest.mark.parametrize("flag, value", [("--copy-files-from", "pre"), ("--base", "pre"), ("--model", "post")])
def test_a_card_names_models_without_local_paths(fresh, flag, value):
    args = {
        "--copy-files-from": lerp("--copy-files-from", str(fresh / "pre")),
        "--base": ["merge", "--method", "linear", "--base", str(fresh / "pre"), "--model", "post", "--alpha", "0.5"],
        "--model": ["merge", "--method", "linear", "--base", "pre", "--model", str(fresh / "post"), "--alpha", "0.5"],
    }[flag]
    assert cli(*args, "--out", "m", cwd=fresh).returncode == 0
    card = (fresh / "m" / "README.md").read_text()
    assert str(fresh) not in card and str(fresh.parent) not in card
    assert f"{flag.lstrip('-').replace('-', '_')}: {value}" in card or f"- {value}" in card, card


@pytest.mark.slow
def test_a_card_names_the_recall_texts_by_file_name(toy_pair, tmp_path):
    texts = tmp_path / "secret place" / "typical.txt"
    texts.parent.mkdir()
    shutil.copy(toy_pair.typical_texts, texts)
    result = cli(
        "merge",
        "--method",
        "recall_lerp",
        "--base",
        toy_pair.pre_dir,
        "--model",
        toy_pair.post_dir,
        "--alpha",
        "0.5",
        "--recall-texts",
        texts,
        "-q",
        "--out",
        tmp_path / "m",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    card = (tmp_path / "m" / "README.md").read_text()
    assert "texts: typical.txt" in card
    assert "secret place" not in card and str(Path(toy_pair.pre_dir).parent) not in card


HOSTILE_NAMES = [
    "a`b",
    "x```\n# injected",
    "````",
    "`",
    "|a|b|",
    "![pixel](http:evil)",
    "<img src=x onerror=alert(1)>",
    "[link](javascript:x)",
    "line\n\n## heading",
    "tab\there",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_folder_name_stays_inside_the_block_it_lands_in(fresh, name):
    """Read back by a CommonMark parser: the card's own headings only, no link, image or HTML, one code block
    holding the whole configuration, and the name shown as written (control characters as escapes)."""
    (fresh / "post").rename(fresh / name)
    (fresh / "pre" / "README.md").write_text(f"---\nlicense: {json.dumps(name)}\n---\n")
    result = cli(
        "merge", "--method", "linear", "--base", "pre", "--model", name, "--alpha", "0.5", "--out", "m", cwd=fresh
    )
    assert result.returncode == 0, result.stderr
    card = (fresh / "m" / "README.md").read_text()
    tokens = card_tokens(card)
    headings = [tokens[index + 1].content for index, token in enumerate(tokens) if token.type == "heading_open"]
    assert headings == ["merge made with mergekit-lite", "Parameters", "Licenses", "Merge method", "Configuration"]
    kinds = {token.type for token in tokens} | {child.type for child in inline_children(tokens)}
    assert not kinds & {"link_open", "image", "html_inline", "html_block"}, kinds
    blocks = [token for token in tokens if token.type in ("fence", "code_block")]
    assert len(blocks) == 1 and blocks[0].info == "yaml" and blocks[0].content.rstrip().endswith("tokenizer: null")
    shown = name.encode("unicode_escape").decode()
    assert shown in [child.content for child in inline_children(tokens) if child.type == "code_inline"]
    licenses = next(
        tokens[index + 4]
        for index, token in enumerate(tokens)
        if token.type == "heading_open" and tokens[index + 1].content == "Licenses"
    )
    assert "".join(child.content for child in licenses.children) == f"The inputs' cards declare: {shown}."
    assert yaml.safe_load(card.split("---\n")[1])["base_model"] == ["pre", name]


# ------------------------------------------------------------------------------------- scores of a broken model


@pytest.mark.parametrize(
    "extra, pattern",
    [
        (["--method", "task_arithmetic", "--alphas", "0,1e39"], r"alphas: 1e\+39 overflows float32"),
        (["--method", "task_arithmetic", "--alphas", "-1e39,0"], r"alphas: -1e\+39 overflows float32"),
        (
            ["--method", "task_arithmetic", "--alphas", "0,1e5", "--eval-dtype", "fp16"],
            r"alphas: 100000\.0 overflows float16",
        ),
        (["--method", "lines", "--alphas", "0,1", "--beta", "1e39"], r"beta: 1e\+39 overflows float32"),
        (["--method", "lines", "--alphas", "0,1", "--betas", "0,4e38"], r"betas: 4e\+38 overflows float32"),
    ],
    ids=["alpha", "negative-alpha", "fp16", "beta", "betas"],
)
def test_coefficients_that_overflow_the_dtype_are_refused_up_front(fresh, extra, pattern):
    refused(
        fresh,
        "sweep",
        "--pre",
        "pre",
        "--post",
        "post",
        "--old-tasks",
        "a",
        "--new-tasks",
        "b",
        "--out",
        "runs",
        *extra,
        patterns=[pattern],
    )
    assert not (fresh / "runs").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, extra",
    [("task_arithmetic", {"alphas": [0.5, 1e18]}), ("lines", {"alphas": [0.5], "betas": [0.0, 1e18]})],
    ids=["task-arithmetic", "lines"],
)
def test_a_point_with_non_finite_logits_is_marked_and_never_the_pick(toy_pair, tmp_path, method, extra):
    """Weights finite, every logit NaN: lm-eval scores it (argmax of NaN is the first choice) as if it answered.
    The point is marked in results.json and report.md, and the pick is another point."""
    from mergekit_lite.sweep import SweepSettings, run_sweep

    options = {"limit": 12, "bootstrap": 50, **extra}
    settings = SweepSettings(
        toy_pair.pre_dir,
        toy_pair.post_dir,
        method,
        options.pop("alphas"),
        toy_pair.old_tasks,
        toy_pair.new_tasks,
        toy_pair.task_dir,
        tmp_path / "run",
        **options,
    )
    result = run_sweep(settings, progress=False)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    broken = [point for point in results["points"] if point["nonfinite_logits"]]
    assert [point.get("beta", point["alpha"]) for point in broken] == [1e18]
    assert not results["pre"]["nonfinite_logits"] and not results["post"]["nonfinite_logits"]
    assert result.best.alpha == 0.5 and not result.best.nonfinite and 1e18 not in results["pareto"]
    assert not any(point.nonfinite for point in result.better), "a broken model is never named as beating the pick"
    report = (tmp_path / "run" / "report.md").read_text()
    assert "Non-finite logits (NaN or infinite while scoring" in report and "never picked" in report
    saved = json.loads(next((tmp_path / "run" / "points").glob("*1e+18*")).read_text())
    assert all(task["nonfinite_logits"] for task in saved["tasks"]), "a resumed sweep must know it too"


def test_a_sweep_where_every_merge_gives_non_finite_logits_has_no_pick():
    def point(alpha, score, nonfinite=False):
        tasks = [TaskRun("a", "old", None, "not scored here", nonfinite=nonfinite)]
        return PointResult(f"alpha={alpha:g}", alpha, tasks, Scores(score, score, score), Scores(score, score, score))

    broken = [point(1e37, 0.9, True), point(1e38, 0.9, True)]
    with pytest.raises(
        InputError, match=r"every merged model gave NaN or infinite logits \(alpha=1e\+37, alpha=1e\+38"
    ):
        pick(broken)
    assert pick([*broken, point(0.5, 0.1)])[0].alpha == 0.5
    assert pareto_front([*broken, point(0.5, 0.1)]) == [0.5]


# --------------------------------------------------------------------------------- all-or-nothing outputs


@pytest.fixture
def maps(tmp_path) -> Path:
    """lm-eval sample logs of three checkpoints of one run (pre, mid, post) and a user's notes beside them."""
    for name, accuracies in (("pre", [1, 1, 0, 0]), ("mid", [1, 0, 1, 0]), ("post", [0, 0, 1, 1])):
        lm_eval_output(tmp_path / name, accuracies)
    (tmp_path / "notes.txt").write_text("a file of the user's")
    return tmp_path


def forgetting(*extra) -> list:
    return ["forgetting", "pre", "mid", "post", "--group", "old=arc", *extra]


ALL_OUTPUTS = ["--samples", "s.jsonl", "--replay", "r.jsonl", "--heatmap", "h.png"]


def test_sweep_replay_into_a_missing_folder_is_refused_before_any_work(fresh):
    refused(fresh, *sweep("--replay", "nodir/r.jsonl"), patterns=[r"nodir/r\.jsonl: nodir is not an existing folder"])
    assert not (fresh / "runs").exists()


@pytest.mark.parametrize(
    "outputs, pattern",
    [
        (["--samples", "s.jsonl", "--replay", "r.jsonl", "--heatmap", "nodir/h.png"], r"nodir/h\.png: nodir is not an"),
        (["--samples", "nodir/s.jsonl", "--heatmap", "h.png"], r"nodir/s\.jsonl: nodir is not an existing folder"),
        (["--samples", "s.jsonl", "--replay", "notes.txt/r.jsonl"], r"notes\.txt is not an existing folder"),
        (
            ["--samples", "s.jsonl", "--replay", "r.jsonl", "--heatmap", "h.xyz"],
            r"h\.xyz: cannot tell the format from "
            r"\.xyz; end the name with one of .*\.png",
        ),
        (["--samples", "s.jsonl", "--heatmap", "h"], r"h: cannot tell the format from a name without a suffix"),
        (["--samples", "s.jsonl", "--heatmap", "h.pgf"], r"h\.pgf: cannot tell the format"),
        (
            ["--samples", "s.jsonl", "--replay", "notes.txt"],
            r"notes\.txt: already exists and is not a file mergekit-lite",
        ),
        (["--samples", "s.jsonl", "--replay", "s.jsonl"], r"--samples, --replay must name different files"),
    ],
    ids=[
        "heatmap-nodir",
        "samples-nodir",
        "under-a-file",
        "heatmap-xyz",
        "heatmap-no-suffix",
        "heatmap-pgf",
        "existing",
        "same-file",
    ],
)
def test_forgetting_outputs_are_checked_before_anything_is_written(maps, outputs, pattern):
    refused(maps, *forgetting(*outputs), patterns=[pattern])


def test_forgetting_outputs_appear_together_or_not_at_all_on_ctrl_c(maps):
    """SIGINT once the first output is written (to its temporary file) and the heat map is being drawn: exit 130,
    and no output, whole or partial, is left."""
    before = tree_hash(maps)
    process = subprocess.Popen(
        [str(CLI), *forgetting(*ALL_OUTPUTS)],
        cwd=maps,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while process.poll() is None and not any(maps.glob(".s.jsonl.tmp-*")):
            time.sleep(0.001)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert tree_hash(maps) == before


def test_forgetting_overwrite_replaces_only_its_own_unchanged_files(maps):
    assert cli(*forgetting(*ALL_OUTPUTS), cwd=maps).returncode == 0
    written = tree_hash(maps)
    refused(
        maps,
        *forgetting(*ALL_OUTPUTS),
        patterns=[
            r"s\.jsonl: already exists \(mergekit-lite wrote it; pass "
            r"--overwrite to replace it\)"
        ],
    )
    again = cli(*forgetting(*ALL_OUTPUTS, "--overwrite"), cwd=maps)
    assert again.returncode == 0, again.stderr
    assert tree_hash(maps) == written, "the same command writes the same files"
    with open(maps / "r.jsonl", "a") as replay:
        replay.write('{"prompt": "mine", "completion": "kept"}\n')
    refused(
        maps,
        *forgetting(*ALL_OUTPUTS, "--overwrite"),
        patterns=[r"r\.jsonl: already exists and is not a file mergekit-lite wrote \(or it was changed since\)"],
    )


@pytest.mark.parametrize(
    "plant",
    [
        lambda root: (root / "s.jsonl").write_text("mine\n"),
        lambda root: (root / "s.jsonl").symlink_to(root / "notes.txt"),
        lambda root: (root / "s.jsonl").mkdir(),
        lambda root: os.mkfifo(root / "s.jsonl"),
        lambda root: (
            (root / "s.jsonl").write_text("mine\n"),
            (root / ".s.jsonl.mergekit-lite-output").write_text('{"sha256": "0"}'),
        ),
        lambda root: (
            (root / "s.jsonl").write_text("mine\n"),
            (root / ".s.jsonl.mergekit-lite-output").symlink_to(root / "notes.txt"),
        ),
    ],
    ids=["file", "link", "folder", "fifo", "forged-record", "linked-record"],
)
def test_forgetting_overwrite_never_replaces_what_it_did_not_write(maps, plant):
    plant(maps)
    refused(
        maps,
        *forgetting("--samples", "s.jsonl", "--overwrite"),
        timeout=60,
        patterns=[r"s\.jsonl: already exists and is not a file mergekit-lite wrote|File 's\.jsonl' is a directory"],
    )


# ------------------------------------------------------------------------------ values that can never act


@pytest.mark.parametrize(
    "alert, pattern",
    [
        ("old:F_true>inf", r"'inf' is not a number \(write a decimal"),
        ("old:F_true<-inf", r"'-inf' is not a number \(write a decimal"),
        ("old:F_true>nan", r"'nan' is not a number \(write a decimal"),
        ("old:F_true>0_1", r"'0_1' is not a number \(write a decimal"),
        ("old:F_true>1e999", r"F_true is a share in \[0, 1\], so >1e999 can never be crossed"),
        ("old:F_true>2", r"so >2 can never be crossed; give a threshold in \[0, 1\)"),
        ("old:BT_max>1", r"so >1 can never be crossed"),
        ("old:F_true<0", r"so <0 can never be crossed; give a threshold in \(0, 1\]"),
        ("old:F_true<-0.5", r"so <-0\.5 can never be crossed"),
        ("old:F_true>-0.5", r"so >-0\.5 is crossed by every value"),
        ("old:F_true<1.5", r"so <1\.5 is crossed by every value"),
    ],
)
def test_an_alert_that_can_never_act_is_refused(maps, alert, pattern):
    refused(maps, *forgetting("--alert", alert), patterns=[rf"--alert '{re.escape(alert)}': ", pattern])


def test_a_real_threshold_still_alerts(maps):
    result = cli(*forgetting("--alert", "old:F>0.2", "--alert", "old:acc_post<1"), cwd=maps)
    assert result.returncode == 3 and "alert: checkpoint 2" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "extra, pattern",
    [
        (["--method", "lines", "--beta", "0.5", "--betas", "0,1"], r"beta and betas both set beta"),
        (["--method", "ties", "--density", "0.5", "--densities", "0.2,0.8"], r"density and densities both set density"),
        (["--method", "dare_linear", "--drop", "0.5", "--drops", "0.2,0.8"], r"drop and drops both set drop"),
    ],
    ids=["beta", "density", "drop"],
)
def test_a_fixed_value_beside_its_grid_is_refused(fresh, extra, pattern):
    refused(fresh, *sweep(*extra), patterns=[pattern])
    (fresh / "grid.yaml").write_text(f"{extra[4].lstrip('-')}: {extra[5]!r}\n")
    refused(fresh, *sweep("grid.yaml", *extra[:4]), patterns=[pattern])


def test_forgetting_replay_format_without_replay_is_refused(maps):
    refused(maps, *forgetting("--replay-format", "messages"), patterns=[r"--replay-format shapes --replay's file"])
    refused(
        maps,
        *forgetting("--replay-format", "prompt-completion", "--samples", "s.jsonl"),
        patterns=[r"give --replay FILE\.jsonl"],
    )


# ----------------------------------------------------------------------------------- the dry run's rates cache


def rates_entry(**changes) -> dict:
    """A cache entry as a measurement writes it (values of a real 2-core machine), with `changes`."""
    methods = {"linear": 1.5, "ties": 20.0}
    entry = {
        "startup_s": 3.2,
        "startup_rss": 400_000_000,
        "read_bytes_per_s": 2e9,
        "write_bytes_per_s": 4e8,
        "math_ns_per_element": dict(methods),
        "math_s_per_step": {"linear": 0.0, "ties": 0.001},
        "memory_bytes_per_element": {"linear": 0.0, "ties": 8.0},
        "memory_peak_bytes": dict(methods),
        "statistics_peak_bytes": {"ties": 1e6},
        "measured_at": "2026-01-01 00:00:00",
        "load": 0.4,
    }
    for key, value in changes.items():
        if "." in key:
            table, method = key.split(".")
            entry[table][method] = value
        else:
            entry[key] = value
    return entry


def cache_text(**changes) -> str:
    return json.dumps({"a machine": rates_entry(**changes)}).replace("Infinity", "1e999")


@pytest.mark.parametrize(
    "text, reason",
    [
        (cache_text(read_bytes_per_s=0), r"read_bytes_per_s: input should be greater than 0"),
        (cache_text(write_bytes_per_s=-68357.0), r"write_bytes_per_s: input should be greater than 0"),
        (cache_text(**{"math_ns_per_element.linear": float("nan")}), r"math_ns_per_element\.linear: .*finite"),
        (cache_text(startup_s=float("inf")), r"startup_s: input should be"),
        (cache_text(read_bytes_per_s=1e308), r"read_bytes_per_s: input should be less than"),
        (cache_text(startup_rss="400 MB"), r"startup_rss: input should be a valid integer"),
        (cache_text(load=None), r"load: input should be a valid number"),
        (cache_text(**{"memory_peak_bytes.ties": -1}), r"memory_peak_bytes\.ties: input should be greater than"),
        (cache_text(extra_key=1), r"extra_key: extra inputs are not permitted"),
        (cache_text()[:-20], r"not JSON"),
        ("[1, 2, 3]", r"the file: input should be an object"),
        ("{" * 100_000, r"not JSON"),
        (" " * (2 << 20) + "{}", r"larger than 1024 KiB"),
    ],
)
def test_a_rates_cache_holding_what_no_measurement_gives_is_measured_again(tmp_path, text, reason):
    """Read as the dry run reads it: refused with the reason its note prints, nothing around touched."""
    from mergekit_lite.merge import cost

    (tmp_path / "rates.json").write_text(text)
    before = tree_hash(tmp_path)
    rates, problem = cost.read_cache(tmp_path / "rates.json")
    assert rates == {} and problem is not None and __import__("re").search(reason, problem), problem
    assert tree_hash(tmp_path) == before


def link_to_notes(folder: Path) -> Path:
    (folder / "notes.json").write_text(cache_text())  # a valid cache's content: still never read through a link
    (folder / "rates.json").symlink_to(folder / "notes.json")
    return folder / "notes.json"


def a_folder(folder: Path) -> Path:
    (folder / "rates.json").mkdir()
    (folder / "rates.json" / "inside").write_text("a user's file")
    return folder / "rates.json" / "inside"


def a_fifo(folder: Path) -> Path:
    os.mkfifo(folder / "rates.json")
    return folder / "rates.json"


def a_dangling_link(folder: Path) -> Path:
    (folder / "rates.json").symlink_to(folder / "nowhere.json")
    return folder / "rates.json"


@pytest.mark.parametrize(
    "plant, reason",
    [
        (link_to_notes, "not a file of ours"),
        (a_folder, "not a file of ours"),
        (a_fifo, "not a file of ours"),
        (a_dangling_link, "not a file of ours"),
    ],
)
def test_a_rates_cache_that_is_no_regular_file_is_never_read(tmp_path, plant, reason):
    from mergekit_lite.merge import cost

    plant(tmp_path)
    before = tree_hash(tmp_path)
    assert cost.read_cache(tmp_path / "rates.json") == ({}, reason)
    assert tree_hash(tmp_path) == before


def test_a_valid_rates_cache_is_read(tmp_path):
    from mergekit_lite.merge import cost

    (tmp_path / "rates.json").write_text(cache_text())
    rates, problem = cost.read_cache(tmp_path / "rates.json")
    assert problem is None and rates["a machine"].read_bytes_per_s == 2e9


@pytest.mark.slow
@pytest.mark.parametrize("plant", ["link", "nan"])
def test_the_dry_run_replaces_an_unusable_rates_cache_with_a_note(fresh, tmp_path, monkeypatch, plant):
    """Through the CLI: a link to a user's file (holding a valid cache) is replaced by a measured cache, its target
    unchanged and not merged in; this machine's own entry holding NaN is measured again. Every file around hashes
    the same, the link's target included."""
    from mergekit_lite.merge import cost

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("MERGEKIT_LITE_CACHE", str(cache))
    if plant == "link":
        link_to_notes(cache)
    else:
        (cache / "rates.json").write_text(
            json.dumps({cost.machine_key(): rates_entry(**{"math_ns_per_element.linear": float("nan")})})
        )
    around = tree_hash(fresh), (tree_hash(cache) if plant == "link" else None)
    result = cli(
        "merge",
        "--method",
        "linear",
        "--base",
        "pre",
        "--model",
        "post",
        "--alpha",
        "0.5",
        "--out",
        "m",
        "--dry-run",
        cwd=fresh,
    )
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: rates cache")]
    assert len(notes) == 1 and notes[0].endswith("; measuring this machine again"), result.stderr
    assert "wall nan" not in result.stdout and "estimate on this machine: wall " in result.stdout
    assert tree_hash(fresh) == around[0]
    if plant == "link":
        assert tree_hash(cache)["notes.json"] == around[1]["notes.json"]
        assert not (cache / "rates.json").is_symlink()
    entries = json.loads((cache / "rates.json").read_text())
    assert list(entries) == [cost.machine_key()]  # nothing of the link's target merged in
    assert cost.read_cache(cache / "rates.json")[1] is None
