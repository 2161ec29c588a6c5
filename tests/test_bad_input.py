"""What users can throw at `mergekit-lite merge`, through the CLI's click group in this process (which handles
errors exactly as the console script does), and in a real process where the process matters (signals, a full
a kill midway, click's own usage error).

Every bad input must end in one line on stderr (`error: ...` naming the file / tensor / key), exit code 2,
no traceback, and no output folder that looks complete: the output does not exist and no
`.OUT.partial-PID` temp folder is left (except after SIGKILL, where the next run removes it).
"""

from __future__ import annotations

import errno
import json
import math
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
from safetensors.torch import load_file, save_file
from test_safety import cli
from tiny_models import save_random_pair, save_tiny_llama

from mergekit_lite.io import outputs
from mergekit_lite.merge.engine import all_finite
from mergekit_lite.merge.methods.tensor_math import lerp

CLI = Path(sys.executable).parent / "mergekit-lite"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
TARGET = "model.layers.1.self_attn.q_proj.weight"  # the tensor the cases break


# ----------------------------------------------------------------------------------------------- helpers


def run_cli(*args, timeout: float = 180) -> subprocess.CompletedProcess:
    """`mergekit-lite merge ARGS` in a real process (the rest run in this one through `cli`)."""
    return subprocess.run(
        [str(CLI), "merge", *map(str, args)], capture_output=True, text=True, env=ENV, timeout=timeout
    )


def partials(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.partial-*"))


def assert_clean_error(result: subprocess.CompletedProcess, out: Path, patterns=()) -> str:
    """Exit 2, one `error:` line on stderr matching every pattern, no traceback, nothing left at `out`."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for pattern in patterns:
        assert re.search(pattern, lines[0]), (pattern, lines[0])
    assert not out.exists(), f"{out} was left behind"
    assert partials(out) == [], f"temp folders left: {partials(out)}"
    return lines[0]


def weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def shard_of(folder: Path, name: str) -> Path:
    return folder / weight_map(folder)[name]


def load_state(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for shard in sorted(set(weight_map(folder).values())):
        state.update(load_file(folder / shard))
    return state


def save_single(folder: Path, state: dict[str, torch.Tensor], config_from: Path) -> Path:
    """A one-file model folder (model.safetensors + config.json)."""
    folder.mkdir(parents=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(config_from / "config.json", folder / "config.json")
    return folder


def edit_tensor(folder: Path, name: str, edit) -> None:
    """Rewrite the shard holding `name` with edit(tensor) in its place (the index stays valid)."""
    shard = shard_of(folder, name)
    tensors = load_file(shard)
    tensors[name] = edit(tensors[name].clone())
    save_file(tensors, shard, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"base": save_tiny_llama(0, root / "base"), "other": save_tiny_llama(1, root / "other")}


def variant(models, tmp_path: Path, name: str = "bad") -> Path:
    """A private copy of `other` to break."""
    return Path(shutil.copytree(models["other"], tmp_path / name))


def lerp_args(base, model) -> list:
    return ["--method", "linear", "--base", base, "--model", model, "--alpha", "0.5"]


# ------------------------------------------------------------------------------------------- the cases
# Each builder gets (models, tmp_path) and returns the merge arguments (without --out);
# the patterns must all occur in the one error line.


def missing_tensor(models, tmp):
    state = load_state(models["other"])
    del state[TARGET]
    return lerp_args(models["base"], save_single(tmp / "bad", state, models["other"]))


def extra_tensor(models, tmp):
    state = load_state(models["other"])
    state["model.layers.1.extra.weight"] = torch.zeros(4)
    return lerp_args(models["base"], save_single(tmp / "bad", state, models["other"]))


def shape_mismatch(models, tmp):
    state = load_state(models["other"])
    state[TARGET] = torch.zeros(16, 32)
    return lerp_args(models["base"], save_single(tmp / "bad", state, models["other"]))


def other_config(**changes):
    def build(models, tmp):
        bad = variant(models, tmp)
        config = json.loads((bad / "config.json").read_text())
        config.update(changes)
        (bad / "config.json").write_text(json.dumps(config))
        return lerp_args(models["base"], bad)

    return build


def truncated_shard(models, tmp):
    bad = variant(models, tmp)
    shard = shard_of(bad, TARGET)
    os.truncate(shard, shard.stat().st_size - 100)
    return lerp_args(models["base"], bad)


def header_length_garbage(models, tmp):
    bad = variant(models, tmp)
    with open(shard_of(bad, TARGET), "r+b") as handle:
        handle.write((2**60).to_bytes(8, "little"))
    return lerp_args(models["base"], bad)


def header_json_garbage(models, tmp):
    bad = variant(models, tmp)
    with open(shard_of(bad, TARGET), "r+b") as handle:
        handle.seek(8)
        handle.write(b"\xff\xfe not json")
    return lerp_args(models["base"], bad)


def index_names_missing_shard(models, tmp):
    bad = variant(models, tmp)
    shard_of(bad, TARGET).unlink()
    return lerp_args(models["base"], bad)


def index_wrong_shard(models, tmp):
    bad = variant(models, tmp)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    right = index["weight_map"][TARGET]
    index["weight_map"][TARGET] = next(s for s in index["weight_map"].values() if s != right)
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    return lerp_args(models["base"], bad)


def empty_folder(models, tmp):
    (tmp / "bad").mkdir()
    return lerp_args(models["base"], tmp / "bad")


def adapter_in_a_subfolder(models, tmp):
    """PEFT saves an adapter not named "default" in a subfolder of the folder given to save_pretrained."""
    (tmp / "bad" / "math").mkdir(parents=True)
    (tmp / "bad" / "math" / "adapter_config.json").write_text("{}")
    return lerp_args(models["base"], tmp / "bad")


def no_such_folder(models, tmp):
    return lerp_args(models["base"], tmp / "nowhere")


def only_pickle(models, tmp):
    return lerp_args(models["base"], pickle_model(models, tmp))


def pickle_model(models, tmp) -> Path:
    folder = tmp / "pickled"
    folder.mkdir()
    torch.save(load_state(models["other"]), folder / "pytorch_model.bin")
    shutil.copy(models["other"] / "config.json", folder / "config.json")
    return folder


def nan_model(models, tmp):
    bad = variant(models, tmp)
    edit_tensor(bad, TARGET, lambda t: t.flatten().index_fill_(0, torch.tensor([3]), float("nan")).reshape(t.shape))
    return bad


def inf_model(models, tmp):
    bad = variant(models, tmp)
    edit_tensor(bad, TARGET, lambda t: t.fill_(float("-inf")))
    return bad


def nan_in_input(models, tmp):
    return lerp_args(models["base"], nan_model(models, tmp))


def inf_in_base(models, tmp):
    return lerp_args(inf_model(models, tmp), models["base"])


def nan_for_ties(models, tmp):
    """TIES may trim the NaN entry away, so the inputs themselves must be checked, not only the result."""
    return ["--method", "ties", "--base", models["base"], "--model", nan_model(models, tmp), "--density", "0.5"]


def nan_for_dare(models, tmp):
    """DARE drops by multiplying, so a dropped NaN is NaN: only the result is checked, and it names the input."""
    return ["--method", "dare_ties", "--base", models["base"], "--model", nan_model(models, tmp), "--drop", "0.9"]


def inf_in_base_for_dare_linear(models, tmp):
    return ["--method", "dare_linear", "--base", inf_model(models, tmp), "--model", models["base"], "--drop", "0.9"]


def identical_inputs_overflowing_float16(models, tmp):
    """Identical inputs are copied, not merged; the copy's cast to float16 overflows and must still be refused."""
    huge = variant(models, tmp)
    edit_tensor(huge, TARGET, lambda t: t.fill_(1e6))
    return ["--method", "linear", "--model", huge, "--model", shutil.copytree(huge, tmp / "twin"), "--dtype", "float16"]


def flags(*extra):
    return lambda models, tmp: ["--base", models["base"], "--model", models["other"], *extra]


def yaml_config(text):
    def build(models, tmp):
        path = tmp / "merge.yaml"
        path.write_text(text.format(base=models["base"], other=models["other"]))
        return [path]

    return build


def newline_in_path(models, tmp):
    return lerp_args(models["base"], tmp / "no\nsuch")


def newline_in_tensor_name(models, tmp):
    state = load_state(models["other"])
    state["model.layers.1.extra\nweight"] = torch.zeros(4)
    return lerp_args(models["base"], save_single(tmp / "bad", state, models["other"]))


ADAPTER_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
ADAPTER_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


def hand_adapter(config_text=None, weights=None, **changes):
    """A LoRA adapter on the tiny Llama's layer-0 q_proj, written by hand: its config (changed, or this text)
    and its weights (these bytes, or plain factors)."""

    def build(models, tmp):
        folder = tmp / "adapter"
        folder.mkdir()
        text = config_text if config_text is not None else json.dumps({**ADAPTER_CONFIG, **changes})
        (folder / "adapter_config.json").write_text(text)
        if weights is None:
            generator = torch.Generator().manual_seed(0)
            save_file(
                {
                    ADAPTER_KEY.format("A"): torch.randn(4, 32, generator=generator),
                    ADAPTER_KEY.format("B"): torch.randn(32, 4, generator=generator),
                },
                folder / "adapter_model.safetensors",
            )
        else:
            (folder / "adapter_model.safetensors").write_bytes(weights)
        return lerp_args(models["base"], folder)

    return build


def safetensors_bytes(header: bytes, data: bytes) -> bytes:
    return len(header).to_bytes(8, "little") + header + data


SECRET_HEADER = safetensors_bytes(
    json.dumps(
        {ADAPTER_KEY.format("A"): {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "note": "password=hunter2"}
    ).encode(),
    bytes(4),
)


VALID_HEAD = "method: linear\nbase: {base}\nmodels:\n  - model: {other}\n"

ERROR_CASES = [
    pytest.param(missing_tensor, [r"/bad: missing tensor " + re.escape(TARGET)], id="missing-tensor"),
    pytest.param(extra_tensor, [r"/bad: extra tensor model\.layers\.1\.extra\.weight"], id="extra-tensor"),
    pytest.param(
        shape_mismatch,
        [r"tensor " + re.escape(TARGET) + r": shape \[16, 32\] in \S+/bad but \[32, 32\]"],
        id="shape-mismatch",
    ),
    pytest.param(
        other_config(architectures=["MistralForCausalLM"], model_type="mistral"),
        [r"different architectures: \S+/base .*llama.*, \S+/bad .*mistral"],
        id="different-model-type",
    ),
    pytest.param(
        other_config(architectures=["LlamaForSequenceClassification"]),
        [r"different architectures: \S+/base .*LlamaForCausalLM.*, \S+/bad .*LlamaForSequenceClassification"],
        id="different-architectures",
    ),
    pytest.param(
        truncated_shard, [r"/bad/model-\d+-of-\d+\.safetensors: truncated file \(tensor "], id="truncated-shard"
    ),
    pytest.param(
        header_length_garbage,
        [r"/bad/model-\d+-of-\d+\.safetensors: corrupted safetensors header"],
        id="header-length-garbage",
    ),
    pytest.param(
        header_json_garbage,
        [r"/bad/model-\d+-of-\d+\.safetensors: corrupted safetensors header"],
        id="header-json-garbage",
    ),
    pytest.param(
        index_names_missing_shard,
        [
            r"/bad/model\.safetensors\.index\.json: names shard model-\d+-of-\d+"
            r"\.safetensors, which is missing"
        ],
        id="index-missing-shard",
    ),
    pytest.param(
        index_wrong_shard,
        [
            r"index\.json: places tensor " + re.escape(TARGET) + r" in model-\d+-of-\d+"
            r"\.safetensors, which does not hold it"
        ],
        id="index-wrong-shard",
    ),
    pytest.param(empty_folder, [r"/bad: no weights found \(expected [^)]*\)$"], id="empty-folder"),
    pytest.param(
        adapter_in_a_subfolder,
        [r"/bad: no weights found .*; its subfolders hold \S+/bad/math: name one"],
        id="adapter-in-a-subfolder",
    ),
    pytest.param(no_such_folder, [r"/nowhere: no such file or folder"], id="no-such-folder"),
    pytest.param(
        only_pickle, [r"/pickled: only pickle weights \(pytorch_model\.bin\)", "--allow-pickle"], id="pickle-refused"
    ),
    pytest.param(
        nan_in_input,
        [
            r"tensor " + re.escape(TARGET) + r" in \S+/bad/model-\d+-of-\d+\.safetensors has NaN "
            r"or Inf values \(pass --allow-nonfinite"
        ],
        id="nan-in-model",
    ),
    pytest.param(
        inf_in_base,
        [
            r"tensor " + re.escape(TARGET) + r" in \S+/bad/model-\d+-of-\d+\.safetensors has NaN "
            r"or Inf values"
        ],
        id="inf-in-base",
    ),
    pytest.param(
        nan_for_ties,
        [
            r"tensor " + re.escape(TARGET) + r" in \S+/bad/model-\d+-of-\d+\.safetensors has NaN "
            r"or Inf values"
        ],
        id="nan-in-model-ties",
    ),
    pytest.param(
        nan_for_dare,
        [
            r"tensor " + re.escape(TARGET) + r" in \S+/bad/model-\d+-of-\d+\.safetensors has NaN "
            r"or Inf values"
        ],
        id="nan-in-model-dare",
    ),
    pytest.param(
        inf_in_base_for_dare_linear,
        [
            r"tensor " + re.escape(TARGET) + r" in \S+/bad/model-\d+-of-\d+\."
            r"safetensors has NaN or Inf values"
        ],
        id="inf-in-base-dare-linear",
    ),
    pytest.param(
        identical_inputs_overflowing_float16,
        [
            r"merged tensor " + re.escape(TARGET) + r" has NaN or Inf "
            r"values \(overflow in the merge or the output dtype float16"
        ],
        id="copied-tensor-overflows-float16",
    ),
    pytest.param(
        flags("--method", "linear", "--alpha", "1.5"),
        [r"alpha must be in \[0\.0, 1\.0\], got 1\.5"],
        id="alpha-above-1",
    ),
    pytest.param(flags("--method", "slerp", "--t", "2"), [r"t must be in \[0\.0, 1\.0\], got 2\.0"], id="t-above-1"),
    pytest.param(
        flags("--method", "ties", "--density", "0"), [r"density must be in \(0\.0, 1\.0\], got 0\.0"], id="density-zero"
    ),
    pytest.param(
        flags("--method", "dare_linear", "--drop", "1"), [r"drop must be in \[0\.0, 1\.0\), got 1\.0"], id="drop-one"
    ),
    pytest.param(
        flags("--method", "task_arithmetic", "--alpha", "0.5"),
        [r"parameter 'alpha' does not apply to method task_arithmetic"],
        id="parameter-of-other-method",
    ),
    pytest.param(
        yaml_config("method: frankenmerge\nbase: {base}\nmodels: [{other}]\n"),
        [r"unknown method 'frankenmerge' \(choose from linear, slerp"],
        id="yaml-unknown-method",
    ),
    pytest.param(
        yaml_config(VALID_HEAD + "alpah: 0.3\n"), [r"merge\.yaml: unknown key 'alpah'"], id="yaml-unknown-key"
    ),
    pytest.param(
        yaml_config(VALID_HEAD + "    wieght: 2\n"),
        [r"merge\.yaml: models\[0\]: unknown key 'wieght'"],
        id="yaml-unknown-model-key",
    ),
    pytest.param(
        yaml_config(VALID_HEAD + "parameters:\n  alpah: 0.3\n"),
        [r"parameter 'alpah' does not apply to method linear"],
        id="yaml-unknown-parameter",
    ),
    pytest.param(
        yaml_config(VALID_HEAD + "parameters:\n  weight: [{{filter: mlp, valeu: 1}}]\n"),
        [r"parameter weight: unknown key 'valeu'"],
        id="yaml-unknown-filter-key",
    ),
    pytest.param(
        yaml_config(VALID_HEAD + "skip: lm_head\n"),
        [r"merge\.yaml: skip: expected a list, got 'lm_head'"],
        id="yaml-wrong-type",
    ),
    pytest.param(
        yaml_config(VALID_HEAD + "parameters:\n  normalize: 'false'\n"),
        [r"normalize must be true or false, got 'false'"],
        id="yaml-quoted-boolean",
    ),
    pytest.param(yaml_config("method: linear\nmodels: [a, b\n"), [r"merge\.yaml: invalid YAML"], id="yaml-invalid"),
    pytest.param(yaml_config("- linear\n- {base}\n"), [r"merge\.yaml: expected a mapping"], id="yaml-not-a-mapping"),
    # control characters in a path or a tensor name are escaped: the error stays one line
    pytest.param(newline_in_path, [r"/no\\nsuch: no such file or folder"], id="newline-in-path"),
    pytest.param(
        newline_in_tensor_name, [r"/bad: extra tensor model\.layers\.1\.extra\\nweight"], id="newline-in-tensor-name"
    ),
    # adapter_config.json is read like every other JSON input, and the adapter's header like a model's
    pytest.param(
        hand_adapter(config_text=json.dumps(ADAPTER_CONFIG)[:-1] + ', "r": 8}'),
        [r"adapter/adapter_config\.json: invalid JSON \(duplicate key 'r'\)"],
        id="adapter-config-duplicate-key",
    ),
    pytest.param(
        hand_adapter(config_text='{"r": 4, "x": ' + "[" * 100000 + "]" * 100000 + "}"),
        [r"adapter/adapter_config\.json: nested too deeply"],
        id="adapter-config-too-deep",
    ),
    pytest.param(
        hand_adapter(lora_alpha=float("nan")),
        [r"adapter/adapter_config\.json: invalid JSON \(NaN"],
        id="adapter-config-nan",
    ),
    pytest.param(
        hand_adapter(rank_pattern={"[": 4}),
        [r"adapter/adapter_config\.json: rank_pattern: '\[' is not a regular expression"],
        id="adapter-rank-pattern-not-a-regex",
    ),
    pytest.param(
        hand_adapter(target_modules="["),
        [r"adapter/adapter_config\.json: target_modules: '\[' is not a regular expression"],
        id="adapter-target-modules-not-a-regex",
    ),
    pytest.param(
        hand_adapter(weights=SECRET_HEADER),
        [r"adapter/adapter_model\.safetensors: corrupted safetensors header", r"^(?!.*hunter2)"],
        id="adapter-header-never-echoed",
    ),
]


@pytest.fixture(scope="module")
def error_runs(models, tmp_path_factory, request) -> dict[str, object]:
    """The selected rows' merges, in this process (the console script's own exit codes, stderr and clean-up
    are tested through real processes below). Inputs are built here in order; a builder that fails is stored and
    re-raised by its own row."""
    selected = {
        item.callspec.id
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_bad_input_is_one_line_exit_2_and_leaves_nothing"
    }
    outcomes, environment = {}, dict(os.environ)
    try:
        for case in (case for case in ERROR_CASES if case.id in selected):
            folder = tmp_path_factory.mktemp(case.id)
            try:
                args, out = case.values[0](models, folder), folder / "merged"
            except Exception as error:  # reported by the row, not by the fixture
                outcomes[case.id] = error
                continue
            outcomes[case.id] = cli("merge", *args, "--out", out, "-q"), out
    finally:  # -q's quieting variables must not reach later tests' subprocesses (set up before restore_environment)
        os.environ.clear()
        os.environ.update(environment)
    return outcomes


@pytest.mark.parametrize("build, patterns", ERROR_CASES)
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(error_runs, request, build, patterns):
    outcome = error_runs[request.node.callspec.id]
    if isinstance(outcome, Exception):
        raise outcome
    result, out = outcome
    assert_clean_error(result, out, patterns)


@pytest.mark.parametrize(
    "args, pattern",
    [
        (
            ["--method", "frankenmerge"],
            r"^error: Invalid value for '--method'.*'frankenmerge' is not one of 'linear'.*"
            r"\(see 'mergekit-lite merge --help'\)$",
        ),
        (["--method", "linear", "--alpha", "abc"], r"^error: Invalid value for '--alpha': 'abc' is not a valid number"),
        (["--method", "linear", "--bogus"], r"^error: No such option '--bogus'.*\(see 'mergekit-lite merge --help'\)$"),
        (
            ["--method", "linear", "--model"],
            r"^error: Option '--model' requires an argument\.$",
        ),  # click names no usage
    ],
    ids=["method", "alpha", "option", "argument"],
)
def test_click_usage_errors_are_one_line_naming_the_help(models, tmp_path, args, pattern):
    """What click refuses itself (a choice, a type, an unknown option, a missing value): one line, exit 2, and
    the command's --help named where click would print its usage (where click knows the command)."""
    out = tmp_path / "merged"
    result = run_cli(*args[:2], "--base", models["base"], "--model", models["other"], "--out", out, *args[2:])
    assert_clean_error(result, out, [pattern])


# ------------------------------------------------------------------------------ accepted with an opt-in


@pytest.mark.slow
def test_mixed_dtypes_upcast_with_a_note(models, tmp_path, calibrated_rates):
    state = {name: tensor.to(torch.bfloat16) for name, tensor in load_state(models["other"]).items()}
    other_bf16 = save_single(tmp_path / "bf16", state, models["other"])
    out = tmp_path / "merged"
    dry = cli("merge", *lerp_args(models["base"], other_bf16), "--out", out, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "note: inputs mix dtypes (bfloat16, float32): upcast to float32 for the math" in dry.stdout
    assert f"measured {calibrated_rates} at load " in dry.stdout  # the run's rates, not measured again
    assert not out.exists()
    result = cli("merge", *lerp_args(models["base"], other_bf16), "--out", out, "-q")
    assert result.returncode == 0, result.stderr
    merged = (
        load_state(out) if (out / "model.safetensors.index.json").exists() else load_file(out / "model.safetensors")
    )
    expected = 0.5 * load_state(models["base"])[TARGET] + 0.5 * state[TARGET].float()
    assert merged[TARGET].dtype == torch.float32  # stored like the base
    torch.testing.assert_close(merged[TARGET], expected)


def test_pickle_weights_merge_with_allow_pickle(models, tmp_path):
    pickled = pickle_model(models, tmp_path)
    out = tmp_path / "merged"
    result = cli("merge", *lerp_args(models["base"], pickled), "--allow-pickle", "--out", out, "-q")
    assert result.returncode == 0, result.stderr
    merged, base, other = load_file(out / "model.safetensors"), load_state(models["base"]), load_state(models["other"])
    assert merged.keys() == base.keys()
    for name, tensor in merged.items():
        assert torch.equal(tensor, lerp(base[name], other[name], 0.5)), name


def test_nonfinite_merges_with_allow_nonfinite(models, tmp_path):
    out = tmp_path / "merged"
    result = cli(
        "merge", *lerp_args(models["base"], nan_model(models, tmp_path)), "--allow-nonfinite", "--out", out, "-q"
    )
    assert result.returncode == 0, result.stderr
    merged = load_file(out / "model.safetensors")[TARGET]
    assert merged.flatten()[3].isnan() and torch.isfinite(merged).sum() == merged.numel() - 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_finite_check_agrees_with_isfinite_on_every_16_bit_pattern(dtype):
    """The integer-view check against torch.isfinite: each of the 65536 patterns alone beside finite values."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(patterns.float())
    assert all_finite(patterns[finite]) and not all_finite(patterns)
    for bad in patterns[~finite]:
        for where in (0, 5, 9):
            tensor = patterns[finite][:10].clone()
            tensor[where] = bad
            assert not all_finite(tensor), (bad.view(torch.int16).item(), where)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, -math.nan, None])
def test_finite_check_agrees_with_isfinite_on_wide_and_float8_dtypes(dtype, bad):
    tensor = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(dtype)
    tensor[7] = -0.0
    if bad is not None:
        tensor[4000] = bad  # float8_e4m3fn has no Inf: it becomes NaN
    assert all_finite(tensor) == bool(torch.isfinite(tensor.float()).all())
    assert all_finite(tensor[3:9].t()) and all_finite(torch.empty(0, dtype=dtype)) and all_finite(torch.arange(3))


def test_zero_size_tensors_merge(models, tmp_path):
    """A tensor with a 0 dimension (valid safetensors) takes an empty block of the read ring: it is merged and
    written like any other, not an internal error when the block is given back."""
    pair = []
    for seed, name in enumerate(("a", "b")):
        state = {**load_state(models["base"] if seed == 0 else models["other"]), "model.empty": torch.zeros(0, 3)}
        pair.append(save_single(tmp_path / name, state, models["other"]))
    for method in ("linear", "ties"):
        out = tmp_path / method
        args = lerp_args(*pair) if method == "linear" else ["--method", "ties", "--base", pair[0], "--model", pair[1]]
        result = cli("merge", *args, "--out", out, "-q")
        assert result.returncode == 0, result.stderr
        merged = load_file(out / "model.safetensors")
        assert merged["model.empty"].shape == (0, 3)
        assert merged.keys() == load_file(pair[0] / "model.safetensors").keys()


# ------------------------------------------------------------------------------------------ the output


def test_existing_output_refused_without_overwrite_replaced_with_it(models, tmp_path):
    out = tmp_path / "merged"
    first = cli("merge", *lerp_args(models["base"], models["other"]), "--out", out, "-q")
    assert first.returncode == 0, first.stderr
    result = cli("merge", *lerp_args(models["base"], models["other"]), "--out", out, "-q")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"error: {out}: already exists (pass --overwrite to replace it)"
    assert partials(out) == []

    (out / "notes.txt").write_text("a file of the user's beside our output")
    result = cli("merge", *lerp_args(models["base"], models["other"]), "--out", out, "--overwrite", "-q")
    assert result.stderr.strip() == (
        f"error: {out}: holds files mergekit-lite did not write there (notes.txt); "
        "--overwrite replaces only a folder holding nothing but a mergekit-lite output, "
        "choose a new folder"
    )
    assert result.returncode == 2 and (out / "notes.txt").read_text().startswith("a file of the user's")
    (out / "notes.txt").unlink()
    result = cli("merge", *lerp_args(models["base"], models["other"]), "--out", out, "--overwrite", "-q")
    assert result.returncode == 0, result.stderr
    assert (out / "model.safetensors").is_file() and partials(out) == []


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs (the merged model is ~110 KB), or a skip where mounting is not allowed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.slow
def test_full_disk_is_one_line_and_leaves_nothing(models, tiny_disk, monkeypatch):
    """Refused before writing when the disk says it has no room; and when it says it has room it does not have
    (quotas, another writer), the write fails midway: one line either way, nothing left."""
    out = tiny_disk / "merged"
    result = cli("merge", *lerp_args(models["base"], models["other"]), "--out", out, "-q")
    assert_clean_error(result, out, [r"has 0\.\d MB free; nothing was written"])
    assert list(tiny_disk.iterdir()) == []
    monkeypatch.setattr(outputs, "free_space", lambda folder: 1 << 40)
    result = cli("merge", *lerp_args(models["base"], models["other"]), "--out", out, "-q")
    line = assert_clean_error(result, out, [r"No space left on device", r"merged\.partial-\d+/model\.safetensors"])
    assert list(tiny_disk.iterdir()) == [], line


def fill(disk: Path) -> None:
    """Leave (almost) no room on the tiny disk."""
    with open(disk / "filler", "wb", buffering=0) as handle:
        try:
            while handle.write(bytes(1024)):
                pass
        except OSError:
            pass


@pytest.mark.slow
def test_full_disk_for_run_folders_and_files_names_the_file_and_leaves_nothing(models, tiny_disk, toy_pair):
    """A sweep's run folder and a fingerprint file on a full disk: one line naming the file, and no empty
    marker, run folder or temp file left behind (an empty marker would make the folder look like ours)."""
    fill(tiny_disk)
    before = sorted(p.name for p in tiny_disk.iterdir())
    sweep = cli(
        "sweep",
        "--pre",
        models["base"],
        "--post",
        models["other"],
        "--alphas",
        "0,1",
        "--old-tasks",
        toy_pair.old_tasks[0],
        "--new-tasks",
        toy_pair.new_tasks[0],
        "--include-path",
        toy_pair.task_dir,
        "--out",
        tiny_disk / "run",
    )
    assert sweep.returncode == 2 and "Traceback" not in sweep.stderr, sweep.stderr
    assert sweep.stderr.strip() == f"error: No space left on device ({tiny_disk / 'run' / '.mergekit-lite-output'})"
    fingerprint = cli("audit", "fingerprint", models["base"], "--out", tiny_disk / "fp.json", "-q")
    assert fingerprint.returncode == 2 and "Traceback" not in fingerprint.stderr, fingerprint.stderr
    assert fingerprint.stderr == f"error: No space left on device ({tiny_disk / 'fp.json'})\n"
    assert sorted(p.name for p in tiny_disk.iterdir()) == before


def test_write_error_in_process_removes_temp_folder(models, tmp_path, monkeypatch):
    """The same fault without root: the writer fails on its third tensor; run_merge re-raises, leaves nothing."""
    from mergekit_lite.audited import run_merge
    from mergekit_lite.io.safetensors import ShardedWriter
    from mergekit_lite.merge.config import MergeConfig, ModelSpec

    real_write, calls = ShardedWriter.write, []

    def failing_write(self, name, tensor):
        calls.append(name)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, name, tensor)

    monkeypatch.setattr(ShardedWriter, "write", failing_write)
    config = MergeConfig(
        method="linear",
        base=str(models["base"]),
        models=[ModelSpec(str(models["other"]))],
        parameters={"alpha": 0.5},
        out_shard_size="20KB",
    )
    out = tmp_path / "merged"
    with pytest.raises(OSError, match="No space left"):
        run_merge(config, out)
    assert len(calls) == 3 and not out.exists() and partials(out) == []


# --------------------------------------------------------------------------------------- interruptions


@pytest.fixture(scope="module")
def big_pair(tmp_path_factory) -> tuple[Path, Path]:
    """Two ~200 MB single-file models of 200 tensors: a merge of them takes seconds, time to kill it midway."""
    return save_random_pair(tmp_path_factory.mktemp("big"), 200, (256, 1024))


def start_and_wait_for_partial(big_pair, out: Path, stderr_file: Path) -> tuple[subprocess.Popen, Path]:
    """Start a big merge and return once its temp folder holds a shard (the merge is midway)."""
    a, b = big_pair
    with open(stderr_file, "w") as stderr:
        process = subprocess.Popen(
            [str(CLI), "merge", *map(str, lerp_args(a, b)), "--out", str(out), "-q", "--out-shard-size", "2MB"],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=ENV,
        )
    partial = out.parent / f".{out.name}.partial-{process.pid}"
    deadline = time.monotonic() + 120
    while not (partial.is_dir() and any(partial.glob("*.safetensors"))):
        if process.poll() is not None:
            pytest.fail(
                f"merge ended (rc {process.returncode}) before it could be interrupted: {stderr_file.read_text()}"
            )
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("the merge never started writing")
        time.sleep(0.01)
    assert process.poll() is None, "the merge finished before the signal: make big_pair bigger"
    return process, partial


@pytest.mark.parametrize(
    "signum, returncode, message",
    [(signal.SIGTERM, 143, "interrupted (SIGTERM)"), (signal.SIGINT, 130, "interrupted (SIGINT)")],
    ids=["SIGTERM", "SIGINT"],
)
@pytest.mark.slow
def test_terminated_midway_removes_temp_folder(big_pair, tmp_path, signum, returncode, message):
    """Handled at the next tensor (never inside the writer thread's locks): ends within seconds, one line."""
    out = tmp_path / "merged"
    process, partial = start_and_wait_for_partial(big_pair, out, tmp_path / "stderr")
    process.send_signal(signum)
    started = time.monotonic()
    assert process.wait(timeout=60) == returncode
    assert time.monotonic() - started < 5
    assert (tmp_path / "stderr").read_text().strip() == message  # no traceback
    assert not out.exists() and not partial.exists() and partials(out) == []


@pytest.mark.slow
def test_sigkill_midway_leaves_only_a_partial_that_the_next_run_removes(models, big_pair, tmp_path):
    out = tmp_path / "merged"
    process, partial = start_and_wait_for_partial(big_pair, out, tmp_path / "stderr")
    process.kill()
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert not out.exists()
    assert partials(out) == [partial]  # named so no tool mistakes it for a model
    result = run_cli(*lerp_args(models["base"], models["other"]), "--out", out, "-q")
    assert result.returncode == 0, result.stderr
    assert (out / "model.safetensors").is_file() and partials(out) == []
