"""`merge`'s method flags come from the method registry alone: each setting is declared once (a `Parameter` of its
methods), and a parameter added to a method's declaration is a flag, a line of `merge --help` and a config key
without another edit."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mergekit_lite.cli import merge as merge_module
from mergekit_lite.cli import method_flags
from mergekit_lite.cli.main import main
from mergekit_lite.cli.merge import merge, merge_command
from mergekit_lite.cli.mergekit_flags import MergekitFlags
from mergekit_lite.errors import InputError
from mergekit_lite.merge import methods
from mergekit_lite.merge.methods.registry import Calibration, Method, Parameter, StepParameters
from mergekit_lite.merge.schema import config_from_dict
from tests.tiny_models import save_random_pair

# the command's own options, what no method declares: listed once, here
OWN_OPTIONS = {
    "config_file",
    "out_path",
    "out",
    "method",
    "base",
    "models",
    "order",
    "recall_texts",
    "recall_samples",
    "embed_rule",
    "seed",
    "dtype",
    "out_quant",
    "copy_files_from",
    "tokenizer_source",
    "mergekit_compat",
    "skip",
    "device",
    "allow_pickle",
    "allow_nonfinite",
    "force",
    "require_verified",
    "overwrite",
    "dry_run",
    "calibrate",
    "quiet",
}
MERGEKIT_OPTIONS = {field.name for field in fields(MergekitFlags)}


def declared_flags() -> set[str]:
    return {
        parameter.name
        for method in methods.REGISTRY.values()
        for parameter in method.parameters
        if not parameter.per_model_only
    }


def test_merge_options_are_the_registry_parameters_and_the_commands_own_once_each():
    """A method setting written into the command by hand (a second --density, or --lambda under another name)
    makes a name here that is no registry parameter, or one name twice."""
    names = [param.name for param in merge.params]
    assert len(names) == len(set(names))
    assert set(names) == OWN_OPTIONS | MERGEKIT_OPTIONS | declared_flags()
    assert not (OWN_OPTIONS | MERGEKIT_OPTIONS) & declared_flags()
    spellings = [opt for param in merge.params for opt in param.opts + param.secondary_opts]
    assert len(spellings) == len(set(spellings))
    for param in merge.params:
        if param.name in declared_flags():  # no default copied: a flag not given leaves the method's own
            assert param.default is None and param.opts == [method_flags.flag_name(param.name)], param.name


def test_every_parameter_the_merge_flags_miss_is_per_model_only():
    every = {parameter.name for method in methods.REGISTRY.values() for parameter in method.parameters}
    missed = every - declared_flags()
    assert missed == {"weight"}  # given with its model: --model PATH:WEIGHT


def test_each_flags_help_shows_every_takers_default_bounds_and_meaning():
    options = {param.name: param for param in merge.params}
    for method in methods.REGISTRY.values():
        for parameter in method.parameters:
            if parameter.per_model_only:
                continue
            text = options[parameter.name].help
            assert method.name in text and parameter.help in text, (method.name, parameter.name)
            if parameter.low is not None:
                assert parameter.bounds_text() in text, (method.name, parameter.name)
            default = method.default(parameter.name, False)
            if default is not None:
                assert method_flags.shown(default) in text, (method.name, parameter.name)
    # one default for every taker: said once; several: said per method, mergekit's where it differs
    assert options["density"].help.endswith("(default 0.5; mergekit's 1).")
    assert "default true for linear, ties, dare_ties, della; false for task_arithmetic" in options["normalize"].help
    assert "mergekit's false for dare_ties" in options["normalize"].help


def test_merge_help_says_what_each_method_takes():
    result = CliRunner().invoke(merge, ["--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    table = result.output.split("Methods, and the flags each takes:")[1].split("Options:")[0]
    entries = " ".join(table.split())  # entries wrap between flags
    assert "ties TIES: trimmed task vectors, elected signs, disjoint mean; takes --lambda, --model PATH:WEIGHT, " in (
        entries
    )
    for name, method in methods.REGISTRY.items():
        assert f"{name} {method.summary}; takes {', '.join(method_flags.method_flags(method))}" in entries


@dataclass(frozen=True)
class Gained(StepParameters):
    gain: float
    negate: bool


class GainForTest(Method):
    """A throwaway method: the one model times a gain, its sign flipped on request. Its parameters are declared
    here only."""

    name = "gain_for_test"
    summary = "one model times a gain"
    parameters = (
        Parameter("gain", "the factor on every entry", default=2.0, low=0.5, high=4.0, per_model=True),
        Parameter("negate", "flip the sign too", kind=bool, default=False),
    )
    elementwise = True
    calibration = Calibration({}, 1, with_base=False)

    def step_parameters(self, config, value, depth):
        return Gained(value("gain", 0), value("negate"))

    def chunk_combiner(self, parameters, tensors, statistics, seed, tensor_name, first_element):
        sign = -1.0 if parameters.negate else 1.0
        return lambda chunk, out: chunk[0].to(torch.float32) * (sign * parameters.gain)


@pytest.fixture
def gain_method(monkeypatch):
    monkeypatch.setitem(methods.REGISTRY, GainForTest.name, GainForTest())


def test_a_parameter_declared_only_in_its_method_is_a_flag_with_its_help(gain_method):
    command = merge_command()
    options = {param.name: param for param in command.params}
    assert options["gain"].opts == ["--gain"] and options["negate"].secondary_opts == ["--no-negate"]
    assert options["gain"].help == "gain_for_test: the factor on every entry, in [0.5, 4.0] (default 2)."
    assert options["negate"].help == "gain_for_test: flip the sign too (default false)."
    result = CliRunner().invoke(command, ["--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "gain_for_test     one model times a gain; takes --gain, --negate" in result.output
    assert "--gain NUMBER" in result.output and "--negate / --no-negate" in result.output
    assert "gain_for_test" not in {param.name for param in merge.params}  # the module's command is as imported


def test_a_parameter_declared_only_in_its_method_reaches_the_merge_from_its_flag(gain_method, tmp_path):
    model, _ = save_random_pair(tmp_path, 2, (4, 8))
    command = merge_command()
    args = ["--method", "gain_for_test", "--model", str(model), "-q", "--no-write-model-card"]
    result = CliRunner().invoke(command, [*args, "--gain", "3", "--negate", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    merged, read = load_file(tmp_path / "out" / "model.safetensors"), load_file(model / "model.safetensors")
    assert merged.keys() == read.keys()
    for name, tensor in read.items():
        assert torch.equal(merged[name], tensor * -3.0), name
    refused = CliRunner().invoke(command, [*args, "--gain", "5", "--out", str(tmp_path / "refused")])
    assert isinstance(refused.exception, InputError)
    assert str(refused.exception) == "gain must be in [0.5, 4.0], got 5.0"
    assert not (tmp_path / "refused").exists()


def test_a_parameter_declared_only_in_its_method_is_a_config_key(gain_method):
    config = config_from_dict(
        {"method": "gain_for_test", "models": [{"model": "a", "parameters": {"gain": 1.5}}], "parameters": {}}
    )
    assert config.parameter("gain", 0) == 1.5 and config.parameter("negate") is False  # its declared default
    with pytest.raises(InputError, match=r"gain must be in \[0\.5, 4\.0\], got 0\.1"):
        config_from_dict({"method": "gain_for_test", "models": ["a"], "parameters": {"gain": 0.1}})
    with pytest.raises(InputError, match="'negate' cannot be set per model"):
        config_from_dict({"method": "gain_for_test", "models": [{"model": "a", "parameters": {"negate": True}}]})
    # mergekit's schema reads a boolean given as 1 as mergekit does, for this method's boolean too
    mergekit = config_from_dict(
        {"merge_method": "gain_for_test", "models": [{"model": "a"}], "parameters": {"negate": 1}}
    )
    assert mergekit.parameter("negate") is True


DOCS = Path(__file__).resolve().parent.parent / "docs" / "adding-a-method.md"


def documented_methods() -> dict[str, Method]:
    """The methods of docs/adding-a-method.md's module: its first block, then the second one below it."""
    namespace: dict = {}
    for block in DOCS.read_text().split("```python\n")[1:3]:
        exec(compile(block.split("```", 1)[0], "median.py", "exec"), namespace)
    return {declared.name: declared for declared in namespace["METHODS"]}


def test_the_documented_knob_is_a_flag_a_config_key_and_one_refusal(monkeypatch, tmp_path):
    """What the page says its `quantile` method's `q` becomes, through `mergekit-lite merge` itself."""
    monkeypatch.setitem(methods.REGISTRY, "quantile", documented_methods()["quantile"])
    monkeypatch.setattr(merge_module, "merge", merge_command())
    page = " ".join(DOCS.read_text().split())
    help_text = {param.name: param for param in merge_module.merge.params}["q"].help
    assert f"whose help reads `{help_text}`" in page
    shown = CliRunner().invoke(main, ["merge", "--help"], terminal_width=200)
    entry = "quantile the entrywise quantile of the inputs; takes --q"
    assert entry in " ".join(shown.output.split()) and f"`{entry}`" in page

    generator = torch.Generator().manual_seed(0)
    inputs = []
    for name in "abc":
        (tmp_path / name).mkdir()
        save_file({"w": torch.randn(6, 5, generator=generator)}, tmp_path / name / "model.safetensors")
        inputs += ["--model", str(tmp_path / name)]
    args = ["merge", "--method", "quantile", *inputs, "-q", "--no-write-model-card"]
    result = CliRunner().invoke(main, [*args, "--q", "0.25", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    read = [load_file(tmp_path / name / "model.safetensors")["w"] for name in "abc"]
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["w"], torch.stack(read).quantile(0.25, dim=0))

    refused = CliRunner().invoke(main, [*args, "--q", "1.5", "--out", str(tmp_path / "refused")])
    assert refused.exit_code == 2 and refused.output.strip() == "error: q must be in [0.0, 1.0], got 1.5"
    assert "`error: q must be in [0.0, 1.0], got 1.5` (exit 2)" in page
    with pytest.raises(InputError, match=r"^q must be in \[0\.0, 1\.0\], got 1\.5$"):
        config_from_dict({"method": "quantile", "models": ["a", "b", "c"], "parameters": {"q": 1.5}})
    mergekit = config_from_dict(
        {"merge_method": "quantile", "models": [{"model": m} for m in "abc"], "parameters": {"q": 0.25}}
    )
    assert mergekit.parameter("q") == 0.25


@pytest.mark.parametrize(
    "method, weights, flags, parameters",
    [
        ("della", False, ["--density", "0.6", "--epsilon", "0.3"], {"density": 0.6, "epsilon": 0.3}),
        ("breadcrumbs", False, ["--gamma", "0.2", "--rescale"], {"gamma": 0.2, "rescale": True}),
        ("multislerp", True, ["--no-normalize-weights", "--eps", "1e-6"], {"normalize_weights": False, "eps": 1e-6}),
        (
            "nuslerp",
            True,
            ["--no-nuslerp-flatten", "--nuslerp-row-wise"],
            {"nuslerp_flatten": False, "nuslerp_row_wise": True},
        ),
        ("passthrough", False, ["--scale", "0.5"], {"scale": 0.5}),
    ],
)
def test_a_new_flag_merges_as_its_config_key_does(method, weights, flags, parameters, tmp_path):
    """The flags that had none (a config key only) give the config's bytes, and not the defaults'."""
    first, second = save_random_pair(tmp_path, 2, (8, 16))
    declared = methods.REGISTRY[method]
    if method == "passthrough":
        inputs, models = ["--model", str(first)], [str(first)]
    elif declared.needs_base:
        inputs, models = ["--base", str(first), "--model", str(second)], [str(second)]
    else:
        inputs = [
            "--model",
            f"{first}:1" if weights else str(first),
            "--model",
            f"{second}:3" if weights else str(second),
        ]
        models = (
            [
                {"model": str(first), "parameters": {"weight": 1.0}},
                {"model": str(second), "parameters": {"weight": 3.0}},
            ]
            if weights
            else [str(first), str(second)]
        )
    config = {"method": method, "models": models, "parameters": parameters}
    if declared.needs_base:
        config["base"] = str(first)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    common = ["merge", "--method", method, *inputs, "-q", "--no-write-model-card"]

    def merged(name: str, *args: str) -> bytes:
        result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        return (tmp_path / name / "model.safetensors").read_bytes()

    by_flags = merged("flags", *common, *flags)
    assert by_flags == merged("config", "merge", str(tmp_path / "config.yaml"), "-q", "--no-write-model-card")
    assert by_flags != merged("defaults", *common)
