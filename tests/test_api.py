"""The Python API as a user meets it: the README's example run as it is shown, on the toy models, and the install
that ships it under one name (no `cli` or `audits` in site-packages)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_python_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Python API") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_readmes_api_example_runs_as_shown(toy_pair, lm_eval_runs, tmp_path):
    """The block is run in a folder holding what it names (pre, post, tasks and two lm-eval outputs), in a fresh
    interpreter: each step does what its comment says."""
    shutil.copytree(toy_pair.pre_dir, tmp_path / "pre")
    shutil.copytree(toy_pair.post_dir, tmp_path / "post")
    shutil.copytree(toy_pair.task_dir, tmp_path / "tasks")
    shutil.copytree(lm_eval_runs.pre, tmp_path / "pre_samples")
    shutil.copytree(lm_eval_runs.post, tmp_path / "post_samples")
    result = subprocess.run(
        [sys.executable, "-c", readme_python_example()], cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "VERIFIED"
    assert any(line.startswith("toy_old ") for line in lines[1:-1])
    assert 0.0 <= float(lines[-1]) <= 1.0
    assert list((tmp_path / "merged").glob("*.safetensors"))
    assert (tmp_path / "runs" / "lerp" / "results.json").is_file()


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_package(tmp_path):
    """`pip install .` puts `mergekit_lite` in site-packages and nothing else of ours: from outside the repository,
    `import cli` and `import audits` fail while `mergekit_lite.cli` and `mergekit_lite.audits` import."""
    source = tmp_path / "source"  # built from a copy: the build writes its build/ folder beside the sources
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in tracked.split():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = (tmp_path / "dist").glob("mergekit_lite-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"mergekit_lite"}
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    program = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
        "import mergekit_lite.cli.main, mergekit_lite.audits.adapter\n"
        "assert mergekit_lite.__file__.startswith(sys.argv[1]), mergekit_lite.__file__\n"
        "for name in ('cli', 'audits'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    raise SystemExit(f'{name} is importable')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program, str(site)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
