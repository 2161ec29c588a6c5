"""mergekit itself, run side by side: its CLI from the venv named by $MERGEKIT_VENV.

Tests that compare against mergekit call `mergekit_cli()` and skip, saying why, where mergekit is not
installed; `.ci/run` installs mergekit==0.1.5 into its own venv and exports MERGEKIT_VENV, so CI runs them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


def mergekit_cli() -> Path:
    """mergekit-yaml from $MERGEKIT_VENV, or skip the calling test with the reason."""
    hint = "set MERGEKIT_VENV to a venv with mergekit==0.1.5 (.ci/run makes one)"
    venv = os.environ.get("MERGEKIT_VENV")
    if not venv:
        pytest.skip(f"mergekit is not installed: {hint}")
    cli = Path(venv) / "bin" / "mergekit-yaml"
    if not cli.is_file():
        pytest.skip(f"mergekit is not installed ({cli} missing): {hint}")
    return cli


# What mergekit-yaml's main does (mergekit/scripts/run_yaml.py), once per config in one interpreter: importing
# torch and mergekit costs more than a tiny merge, so a batch of configs shares one start.
BATCH = """
import sys, yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
options = MergeOptions(random_seed=int(sys.argv[1]), quiet=True)
options.apply_global_options()
for config_file, out_path in zip(sys.argv[2::2], sys.argv[3::2]):
    source = open(config_file, encoding="utf-8").read()
    run_merge(MergeConfiguration.model_validate(yaml.safe_load(source)), out_path, options=options,
              config_source=source)
"""


def _environment() -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", ""),
        "HOME": os.environ.get("HOME", "/tmp"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def run_mergekit(config: Path, out: Path, seed: int = 0) -> Path:
    """mergekit-yaml CONFIG OUT on the CPU, offline, in its own environment (none of ours leaks in)."""
    result = subprocess.run(
        [str(mergekit_cli()), str(config), str(out), "--random-seed", str(seed), "--quiet"],
        capture_output=True,
        text=True,
        env=_environment(),
        timeout=600,
    )
    assert result.returncode == 0, f"mergekit failed on {config}:\n{result.stderr[-3000:]}"
    return out


def run_mergekit_batch(jobs: dict[Path, Path], seed: int = 0) -> dict[Path, Path]:
    """Several configs (config -> output folder) through mergekit's own entry point in one process."""
    python = mergekit_cli().parent / "python"
    arguments = [str(part) for pair in jobs.items() for part in pair]
    result = subprocess.run(
        [str(python), "-c", BATCH, str(seed), *arguments],
        capture_output=True,
        text=True,
        env=_environment(),
        timeout=900,
    )
    assert result.returncode == 0, f"mergekit failed:\n{result.stderr[-3000:]}"
    return jobs
