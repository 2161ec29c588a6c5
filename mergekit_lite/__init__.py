"""mergekit-lite: recover what post-training forgot by merging checkpoints.

The Python API behind the `mergekit-lite` command, one import away::

    from mergekit_lite import load_config, run_merge, audit_adapter, run_sweep, SweepSettings
    from mergekit_lite import load_lm_eval_run, forgetting_map

Each name is imported on first use (PEP 562), so `import mergekit_lite` stays cheap and the floors hold:
`io`; `merge`; `evaluate` and `audits`; `audited` (merging with the audit gate); `sweep`; `demo`; `cli` on top,
each importing only from those below it (tests/test_layout.py checks it).
"""

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_API = {
    "load_config": "mergekit_lite.merge.schema",
    "config_from_dict": "mergekit_lite.merge.schema",
    "plan_merge": "mergekit_lite.merge.plan",
    "run_merge": "mergekit_lite.audited",
    "merge_state_dict": "mergekit_lite.audited",
    "extract_lora": "mergekit_lite.audited",
    "audit_adapter": "mergekit_lite.audits.adapter",
    "SweepSettings": "mergekit_lite.sweep",
    "run_sweep": "mergekit_lite.sweep",
    "run_comparison": "mergekit_lite.sweep",
    "load_lm_eval_run": "mergekit_lite.evaluate.outcomes",
    "forgetting_map": "mergekit_lite.evaluate.forgetting",
    "spurious_map": "mergekit_lite.evaluate.spurious",
    "trajectory": "mergekit_lite.evaluate.trajectory",
    "model_drift": "mergekit_lite.evaluate.drift",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'mergekit_lite' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
