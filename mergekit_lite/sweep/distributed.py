"""Sweep points in parallel on Ray: one actor per device, each point a task, results in the run folder.

We do not schedule anything ourselves: Ray places the actors on the resources each asks for (one GPU per
actor when the sweep runs on CUDA, else one CPU), retries a point whose worker died, and `ray.init()`
starts a local cluster when no address is given. Every actor writes its finished point file into the
run folder exactly as a local sweep does, so resume, the lock (held by the driver) and the report are
unchanged; on a cluster the run folder must be on storage every node sees.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from mergekit_lite.errors import InputError
from mergekit_lite.merge.schema import config_from_dict
from mergekit_lite.sweep.evaluator import PointEvaluator, evaluate_point
from mergekit_lite.sweep.settings import SweepSettings

LOCAL = "local"


def worker_resources(device: str, gpus_per_point: int = 1) -> dict:
    """What one point needs: GPUs for CUDA sweeps, one CPU otherwise."""
    if device.startswith("cuda"):
        return {"num_gpus": gpus_per_point, "num_cpus": 1}
    return {"num_gpus": 0, "num_cpus": 1}


def worker_count(pending: int, resources: dict, available: dict) -> int:
    """As many actors as the cluster can hold at once, and no more than there are points."""
    gpus, cpus = resources["num_gpus"], resources["num_cpus"]
    fit = int(available.get("GPU", 0) // gpus) if gpus else int(available.get("CPU", 0) // cpus)
    if fit < 1:
        need = f"{gpus} GPU" if gpus else f"{cpus} CPU"
        raise InputError(
            f"the Ray cluster has no room for one sweep worker (each needs {need}; available: {available})"
        )
    return max(1, min(pending, fit))


def run_points_on_ray(
    settings, todo: list[tuple[str, float | None, dict | None]], address: str | None, gpus_per_point: int = 1
) -> list[str]:
    """Evaluate `todo` (label, alpha, merge config as a dict; None for pre and post) on Ray actors.

    The driver resolves every point's merge config first (RECALL's similarities are computed once
    there), so the actors only merge and evaluate. Returns the labels in the order they finished."""
    from ray.util import ActorPool

    with ray_actors(settings, len(todo), address, gpus_per_point) as actors:
        pool = ActorPool(actors)
        return list(pool.map_unordered(lambda actor, point: actor.run.remote(*point), todo))


@contextmanager
def ray_actors(settings, wanted: int, address: str | None, gpus_per_point: int = 1) -> Iterator[list]:
    """Up to `wanted` PointWorker actors, as many as the cluster holds (Ray started here when it is not running,
    and shut down after)."""
    try:
        import ray
    except ImportError:
        raise InputError("--ray needs Ray: pip install 'mergekit-lite[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        init = {
            "address": None if address in (None, LOCAL) else address,
            "include_dashboard": False,
            "log_to_driver": False,
            "logging_level": "ERROR",
        }
        if init["address"] is None:
            init["num_cpus"] = os.cpu_count()
        # Workers import this package as the driver does (an editable install or PYTHONPATH on every node).
        init["runtime_env"] = {"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "TQDM_DISABLE": "1"}}
        ray.init(**init)
    try:
        resources = worker_resources(settings.device, gpus_per_point)
        worker_class = ray.remote(max_restarts=1, max_task_retries=1, **resources)(PointWorker)
        count = worker_count(wanted, resources, ray.available_resources())
        yield [worker_class.remote(asdict(settings)) for _ in range(count)]
    finally:
        if started_here:
            ray.shutdown()


class PointWorker:
    """One Ray actor: builds the sweep's evaluator once (model skeleton, tokenizer, task index) and
    evaluates the points it is given, saving each point file itself."""

    def __init__(self, settings: dict):
        self.settings = SweepSettings(**settings)
        self.evaluator = None

    def point_evaluator(self) -> PointEvaluator:
        from tqdm import tqdm

        if self.evaluator is None:
            self.evaluator = PointEvaluator(self.settings, Path(self.settings.out), tqdm(disable=True))
        return self.evaluator

    def run(self, label: str, alpha: float | None, config: dict | None) -> str:
        evaluate_point(
            self.point_evaluator(), self.settings, label, alpha, None if config is None else config_from_dict(config)
        )
        return label

    def merged(self, config: dict, samples: dict | None = None) -> list:
        """One merge scored on every doc or on `samples`, its runs returned (the driver saves them: a vector
        search's trial)."""
        return self.point_evaluator().merged(config_from_dict(config), samples)
