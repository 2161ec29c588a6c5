"""Shared pytest fixtures. Expensive artefacts are session-scoped so every test file reuses them."""

import fcntl
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile

# Tests never touch the network; set before anything imports huggingface_hub or datasets.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from mergekit_lite.toy import ToyPair, build_toy_pair

TEST_CACHE = "MERGEKIT_LITE_TEST_RATES"  # the test run's rates folder, inherited by its xdist workers
OWN_CACHE = pytest.StashKey[str]()  # set in the process that made the folder (and removes it)
Built = TypeVar("Built")


def pytest_configure(config):
    """Tests press Ctrl-C on the CLI by sending SIGINT to it. A shell starts a background job (`.ci/run &`,
    nohup) with SIGINT ignored, and every process it starts inherits that, so the CLI (rightly) keeps ignoring
    it; give the test processes, and so their children, a terminal's default instead. Runs in every xdist worker."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # --dry-run's rates go to a folder of this test run, never the user's cache; xdist workers inherit the
    # controller's environment, so they share its folder (and `calibrated_rates` measures once per run)
    if not os.environ.get(TEST_CACHE):
        os.environ[TEST_CACHE] = tempfile.mkdtemp(prefix="mergekit-lite-rates-")
        config.stash[OWN_CACHE] = os.environ[TEST_CACHE]
    os.environ["MERGEKIT_LITE_CACHE"] = os.environ[TEST_CACHE]


def pytest_unconfigure(config):
    os.environ.pop("MERGEKIT_LITE_CACHE", None)
    folder = config.stash.get(OWN_CACHE, None)
    if folder:
        os.environ.pop(TEST_CACHE, None)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def calibrated_rates() -> str:
    """This machine's rates measured once per test run into the run's cache (the first worker to ask measures,
    under a lock; the others wait and read them), in a fresh interpreter as the CLI measures them. Returns their
    `measured_at`, which a dry run that reused them (and did not calibrate again) prints."""
    folder = Path(os.environ["MERGEKIT_LITE_CACHE"])
    with open(folder / "calibrating.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run([sys.executable, "-c", "from mergekit_lite.merge import cost; cost.load_rates()"], check=True)
    [rates] = json.loads((folder / "rates.json").read_text()).values()
    return rates["measured_at"]


def once_per_run(tmp_path_factory, name: str, build: Callable[[Path], Built]) -> Built:
    """`build(folder)` once per test run, not once per xdist worker: the workers share a folder under the run's
    temp root (the parent of each worker's own); the first to take the lock builds, the others wait and read what
    it built (pickled). Without xdist, simply a folder of this test run."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    folder, built = root / f"once-{name}", root / f"once-{name}.pickle"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not built.is_file():
            value = build(folder)
            built.write_bytes(pickle.dumps(value))
    return pickle.loads(built.read_bytes())


@pytest.fixture(scope="session")
def toy_pair(tmp_path_factory) -> ToyPair:
    """The toy pre -> post pair (seed 0), saved in several safetensors shards so streaming code
    sees sharded inputs, with post-training's checkpoints at steps 25 and 50 (a training run: pre is step 0,
    post the last step). Built once per test run (a few seconds)."""
    return once_per_run(
        tmp_path_factory,
        "toy_pair",
        lambda folder: build_toy_pair(folder, seed=0, max_shard_size="100KB", post_checkpoints=[25, 50]),
    )


@pytest.fixture(autouse=True)
def restore_environment():
    """The CLI's -q sets quieting variables in os.environ (so lm-eval and Ray workers inherit them); a test that
    calls it in-process must not pass them on to the subprocesses of later tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@dataclass(frozen=True)
class LmEvalRuns:
    """What lm-eval's own CLI wrote (--log_samples) for the toy pre and post models on local tasks of every
    output type (tests/lm_eval_tasks.py): one model folder each, and the include path of the tasks."""

    tasks: list[str]
    include_path: Path
    limit: int
    pre: Path
    post: Path


@pytest.fixture(scope="session")
def lm_eval_runs(toy_pair, tmp_path_factory) -> LmEvalRuns:
    """lm-eval run once per model for the whole test run (about half a minute each)."""
    from lm_eval_tasks import run_lm_eval, task_configs, write_tasks

    def build(root: Path) -> LmEvalRuns:
        include_path = write_tasks(toy_pair.task_dir, root / "tasks")
        tasks = [*toy_pair.old_tasks, *toy_pair.new_tasks, *task_configs(toy_pair.task_dir)]
        limit = 32
        pre = run_lm_eval(toy_pair.pre_dir, tasks, include_path, root / "pre", limit=limit)
        post = run_lm_eval(toy_pair.post_dir, tasks, include_path, root / "post", limit=limit)
        return LmEvalRuns(tasks, include_path, limit, pre, post)

    return once_per_run(tmp_path_factory, "lm_eval", build)


@pytest.fixture(scope="session")
def lm_eval_checkpoint(toy_pair, lm_eval_runs, tmp_path_factory) -> Path:
    """lm-eval's CLI on post-training's step-25 checkpoint, as `lm_eval_runs` ran it on pre and post: with them,
    three checkpoints of one training run."""
    from lm_eval_tasks import run_lm_eval

    return once_per_run(
        tmp_path_factory,
        "lm_eval_checkpoint",
        lambda root: run_lm_eval(
            toy_pair.checkpoints[0],
            lm_eval_runs.tasks,
            lm_eval_runs.include_path,
            root / "step-25",
            limit=lm_eval_runs.limit,
        ),
    )


SWEEP_ALPHAS = [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.fixture(scope="session")
def linear_sweep(toy_pair, tmp_path_factory):
    """One full linear sweep of the toy pair (alphas 0 to 1 by 0.25, every doc), once per test run and shared
    by the xdist workers: a test that writes into its folder (a lock, a rerun) works on a copy."""
    from mergekit_lite.sweep import SweepSettings, run_sweep

    return once_per_run(
        tmp_path_factory,
        "linear_sweep",
        lambda folder: run_sweep(
            SweepSettings(
                toy_pair.pre_dir,
                toy_pair.post_dir,
                "linear",
                SWEEP_ALPHAS,
                toy_pair.old_tasks,
                toy_pair.new_tasks,
                toy_pair.task_dir,
                folder / "run",
                limit=None,
            )
        ),
    )
