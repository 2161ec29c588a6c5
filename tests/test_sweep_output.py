"""What a sweep prints on stderr: its own bar, with transformers' and lm-eval's bars and logs quiet under it;
--verbose brings them back."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
LIBRARY_BARS = ("Loading weights", "Running loglikelihood requests")


def sweep(pair, out: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [str(Path(sys.executable).with_name("mergekit-lite")), "sweep", "--pre", str(pair.pre_dir)]
    command += ["--post", str(pair.post_dir), "--alphas", "0.5", "--limit", "8", "--out", str(out), *flags]
    command += ["--old-tasks", ",".join(pair.old_tasks), "--new-tasks", ",".join(pair.new_tasks)]
    command += ["--include-path", str(pair.task_dir)]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)


def test_the_sweeps_bar_alone_and_the_libraries_with_verbose(toy_pair, tmp_path):
    plain = sweep(toy_pair, tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr
    assert "sweep: 100%" in plain.stderr
    assert not any(bar in plain.stderr for bar in LIBRARY_BARS), plain.stderr
    verbose = sweep(toy_pair, tmp_path / "verbose", "--verbose")
    assert verbose.returncode == 0, verbose.stderr
    assert "sweep: 100%" in verbose.stderr and all(bar in verbose.stderr for bar in LIBRARY_BARS)
    assert plain.stdout.splitlines()[:4] == verbose.stdout.splitlines()[:4]  # the same sweep, said the same way


def test_quiet_and_verbose_together_are_refused(toy_pair, tmp_path):
    done = sweep(toy_pair, tmp_path / "run", "--quiet", "--verbose")
    assert done.returncode == 2 and done.stderr.strip().startswith("error: --quiet and --verbose")
    assert not (tmp_path / "run").exists()
