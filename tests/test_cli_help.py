"""Every command's --help as click renders it: bounds shown where an option has them, never a placeholder."""

import pytest
from click.testing import CliRunner

from mergekit_lite.cli.main import main

COMMANDS = ["merge", "audit", "sweep", "extract", "forgetting", "demo"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_bounds_and_no_placeholder(command):
    result = CliRunner().invoke(main, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "None" not in result.output
    assert "-q, --quiet" in result.output  # every command takes -q, which also quiets the libraries (cli/main.py)
    if command == "audit":
        assert "0<=x<=1" in result.output and "x>=0" in result.output  # --max-contaminated, --min-delta
    if command == "sweep":
        assert "0<x<1" in result.output  # --selection-fraction and --confidence keep their open bounds
