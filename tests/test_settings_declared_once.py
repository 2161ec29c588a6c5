"""A setting is declared once: a command built on a settings model has exactly one option per field, with the
field's help and default, and takes only a short, named list of options of its own (inputs, outputs, I/O
switches); a field added to a model appears on the command line with nothing else written."""

from typing import Literal

import click
import pytest
from click.testing import CliRunner

from mergekit_lite.audits.thresholds import AuditThresholds
from mergekit_lite.cli.audit import audit_adapters
from mergekit_lite.cli.drift import drift
from mergekit_lite.cli.extract import extract
from mergekit_lite.cli.forgetting import forgetting
from mergekit_lite.cli.merge_adapters import merge_adapters
from mergekit_lite.cli.mergekit_flags import OPTIONS as MERGEKIT_OPTIONS
from mergekit_lite.cli.options import command_line_fields, flag_names, settings_options
from mergekit_lite.cli.sweep import sweep
from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.settings import DriftSettings, ForgettingSettings, MatrixSettings
from mergekit_lite.merge.lora_settings import AdapterMergeSettings, ExtractSettings
from mergekit_lite.settings import Settings, setting
from mergekit_lite.sweep.settings import SweepFile

# per command: its settings models and the options it declares itself (inputs, outputs, how it prints)
COMMANDS = {
    "extract": (extract, [ExtractSettings], {"base", "model", "out", "device", "overwrite", "quiet"}),
    "audit": (
        audit_adapters,
        [AuditThresholds],
        {"adapters", "from_file", "base", "fingerprint", "train_data", "holdout", "base_id", "behaviour", "device"}
        | {"allow_pickle", "require_verified", "as_json", "as_csv", "verbose", "quiet"},
    ),
    "drift": (drift, [DriftSettings], {"pre", "post", "texts", "heatmap_out", "html_out", "as_json", "quiet"}),
    "merge-adapters": (
        merge_adapters,
        [AdapterMergeSettings],
        {"adapters", "base", "out", "force", "require_verified", "allow_pickle", "overwrite", "quiet"},
    ),
    "forgetting": (
        forgetting,
        [ForgettingSettings, MatrixSettings],
        {"inputs", "samples_out", "replay_out", "heatmap_out", "html_out", "overwrite", "as_json", "quiet"},
    ),
}


def _mergekit_names() -> set[str]:
    holder = click.command()(lambda **_: None)
    for option in MERGEKIT_OPTIONS:
        holder = option(holder)
    return {param.name for param in holder.params}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_is_a_field_or_named_as_the_commands_own(name):
    command, models, own = COMMANDS[name]
    options = [param.name for param in command.params]
    fields = [field for model in models for field in command_line_fields(model)]
    assert len(options) == len(set(options)), "an option declared twice"
    assert len(fields) == len(set(fields)), "a setting declared in two models"
    assert set(options) - _mergekit_names() == set(fields) | own
    assert not set(fields) & own


@pytest.mark.parametrize("name", COMMANDS)
def test_options_carry_the_fields_help_default_and_names(name):
    command, models, _ = COMMANDS[name]
    by_name = {param.name: param for param in command.params}
    for field_name, field in [
        (name, model.model_fields[name]) for model in models for name in command_line_fields(model)
    ]:
        option = by_name[field_name]
        assert option.help == field.description
        assert option.opts[0] == flag_names(field_name, field)[0]
        assert option.required == field.is_required(), field_name
        default = option.default if not option.multiple else tuple(option.default or ())
        assert field.is_required() or default == field.default, field_name


def test_every_sweep_option_is_a_field_of_the_file_model_or_the_commands_own():
    own = {
        "config_file",
        "baseline",
        "replay_out",
        "replay_format",
        "replay_all",
        "require_verified",
        "quiet",
        "verbose",
    }
    options = [param.name for param in sweep.params]
    assert len(options) == len(set(options))
    assert set(options) == set(command_line_fields(SweepFile)) | own
    assert set(SweepFile.model_fields) - set(command_line_fields(SweepFile)) == {"methods"}  # a file's list
    by_name = {param.name: param for param in sweep.params}
    for name in command_line_fields(SweepFile):
        assert by_name[name].help == SweepFile.model_fields[name].description
        assert by_name[name].default in (None, ())  # not given: the file's value, else SweepSettings' default


def test_a_new_field_reaches_the_command_line_and_the_api_alone():
    class Knobs(Settings):
        width: int = setting(4, "How wide.", ge=1, le=16)
        mode: Literal["fast", "exact"] = setting("exact", "How careful.")
        tags: tuple[str, ...] = setting((), "A tag (repeatable).", flags=("--tag", "-t"))
        loud: bool = setting(True, "Say it.", negatable=True)

    @click.command()
    @settings_options(Knobs)
    def run(settings):
        click.echo(repr(settings))

    runner = CliRunner()
    shown = runner.invoke(run, ["--help"], terminal_width=200).output
    for text in ("--width", "1<=x<=16", "default: 4", "--mode [fast|exact]", "-t, --tag", "--loud / --no-loud"):
        assert text in shown, text
    given = runner.invoke(run, ["--width", "8", "--mode", "fast", "-t", "a", "--tag", "b", "--no-loud"])
    assert given.output.strip() == repr(Knobs(width=8, mode="fast", tags=("a", "b"), loud=False))
    assert runner.invoke(run, ["--width", "17"]).exit_code == 2  # the declared bound, from click's range
    assert Knobs.of(width=2).width == 2
    with pytest.raises(InputError, match="width: input should be less than or equal to 16, got 17"):
        Knobs.of(width=17)
    with pytest.raises(InputError, match="widht: not a setting"):
        Knobs.of(widht=2)


def test_a_value_click_lets_through_is_refused_by_the_model_naming_the_flag():
    result = CliRunner().invoke(extract, ["--base", "a", "--model", "b", "--out", "c", "--sv-epsilon", "inf"])
    assert result.exit_code != 0
    assert isinstance(result.exception, InputError)
    assert str(result.exception) == "--sv-epsilon: input should be a finite number, got inf"


def test_the_api_and_the_command_line_share_defaults():
    assert ExtractSettings().rank == next(param.default for param in extract.params if param.name == "rank")
