"""The whole mission on tiny models made here, offline, in a few minutes on two CPU cores.

Train a model on an old skill (pre), post-train it on a new one until the old is forgotten (post),
audit LoRA adapters extracted from the fine-tune (a real one and a no-op), sweep the merge coefficient
for several methods, and write one summary. Every number comes from this run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file

from mergekit_lite.io.outputs import prepare_run_folder
from mergekit_lite.merge.extract import extract_lora
from mergekit_lite.sweep import SweepResult, SweepSettings, run_sweep
from mergekit_lite.sweep.result import pick_fields
from mergekit_lite.toy import ToyPair, build_toy_pair

# method -> (grid of its main coefficient, extra settings)
DEMO_SWEEPS = {
    "linear": ([0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0], {}),
    "ties": ([0.0, 0.2, 0.4, 0.6, 0.8, 1.0], {"density": 0.5}),
    "recall": ([0.03, 0.1, 0.3, 1.0, 3.0, 10.0], {}),
    "recall_lerp": ([0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0], {}),
}
ADAPTER_RANK = 8


@dataclass
class DemoResult:
    out: Path
    pair: ToyPair
    audits: list  # audits.report.AuditReport, one per adapter
    sweeps: dict[str, SweepResult]
    summary_file: Path


def make_adapters(pair: ToyPair, folder: Path) -> list[Path]:
    """A rank-8 LoRA of the fine-tune shipping its base's fingerprint, and a copy with B zeroed (a no-op)."""
    from mergekit_lite.audits.fingerprint import (
        FINGERPRINT_FILE,
        compute_fingerprint,
        write_fingerprint,
    )

    real, no_op = folder / "post-lora", folder / "no-op-lora"
    if not real.exists():
        extract_lora(str(pair.pre_dir), str(pair.post_dir), str(real), rank=ADAPTER_RANK, linear_only=True)
        write_fingerprint(compute_fingerprint(pair.pre_dir), real / FINGERPRINT_FILE, base_dir=pair.pre_dir)
    if not no_op.exists():
        no_op.mkdir(parents=True)
        tensors = load_file(real / "adapter_model.safetensors")
        save_file(
            {name: tensor.zero_() if "lora_B" in name else tensor for name, tensor in tensors.items()},
            str(no_op / "adapter_model.safetensors"),
        )
        (no_op / "adapter_config.json").write_text((real / "adapter_config.json").read_text())
    return [real, no_op]


def run_demo(
    out: str | Path, seed: int = 0, methods: tuple[str, ...] = tuple(DEMO_SWEEPS), progress: bool = False, echo=print
) -> DemoResult:
    """Run every stage; finished stages in `out` are reused, so a rerun is quick."""
    from mergekit_lite.audits.adapter import audit_adapter

    out = prepare_run_folder(out)
    echo(f"[1/4] building and training the tiny pre/post models in {out / 'models'}")
    pair = build_toy_pair(out / "models", seed=seed, max_shard_size="100KB")
    echo("[2/4] auditing LoRA adapters extracted from the fine-tune")
    audits = [audit_adapter(adapter, pair.pre_dir) for adapter in make_adapters(pair, out / "adapters")]
    for report in audits:
        echo(
            f"      {Path(report.adapter).name}: {report.verdict}"
            + (f" ({report.reasons[0]})" if report.reasons else "")
        )
    sweeps = {}
    for position, method in enumerate(methods):
        grid, extra = DEMO_SWEEPS[method]
        echo(f"[3/4] sweep {position + 1}/{len(methods)}: {method} over {grid}")
        settings = SweepSettings(
            pre=str(pair.pre_dir),
            post=str(pair.post_dir),
            method=method,
            alphas=grid,
            old_tasks=pair.old_tasks,
            new_tasks=pair.new_tasks,
            include_path=str(pair.task_dir),
            out=str(out / "sweeps" / method),
            recall_texts=str(pair.typical_texts),
            seed=seed,
            **extra,
        )
        sweeps[method] = run_sweep(settings, progress=progress)
    echo("[4/4] writing the summary")
    summary_file = out / "SUMMARY.md"
    summary_file.write_text(summary_markdown(sweeps, audits))
    (out / "summary.json").write_text(json.dumps(summary_data(sweeps, audits), indent=2, allow_nan=False) + "\n")
    return DemoResult(out, pair, audits, sweeps, summary_file)


def _interval(point, name: str) -> str:
    low, high = point.intervals.get(name, (None, None))
    return "" if low is None else f" [{low:.3f}, {high:.3f}]"


def summary_data(sweeps: dict[str, SweepResult], audits: list) -> dict:
    first = next(iter(sweeps.values()))
    return {
        "pre": {"old": first.pre.old, "new": first.pre.new},
        "post": {"old": first.post.old, "new": first.post.new},
        "selection": {
            "method": first.settings.selection,
            "fraction": first.settings.selection_fraction,
            "docs": {task: {"selection": len(keys[0]), "report": len(keys[1])} for task, keys in first.splits.items()},
            "bootstrap": first.settings.bootstrap,
            "confidence": first.settings.confidence,
        },
        "best": {
            method: {
                "alpha": r.best.alpha,
                "old": r.best.old,
                "new": r.best.new,
                "harmonic_mean": r.best.harmonic_mean,
                "intervals": r.best.intervals,
                "selection_harmonic_mean": r.best.selection.harmonic_mean,
                "indistinguishable": r.indistinguishable,
                "docs_to_separate": r.separation.to_json() if r.separation else None,
                **pick_fields(r),
            }
            for method, r in sweeps.items()
        },
        "audits": {Path(a.adapter).name: {"verdict": a.verdict, "reasons": a.reasons} for a in audits},
    }


def summary_lines(sweeps: dict[str, SweepResult]) -> list[str]:
    """The printed summary: pre and post on both skills, each method's pick (chosen on the selection docs,
    scored on the report docs), the forgetting it recovered and the new skill it kept (or that it is pre or post
    itself), and a warning where another alpha beat it on the report docs."""
    first = next(iter(sweeps.values()))
    lines = [
        f"pre   old {first.pre.old:.3f}  new {first.pre.new:.3f}",
        f"post  old {first.post.old:.3f}  new {first.post.new:.3f}",
    ]
    for method, result in sweeps.items():
        lines.append(
            f"best {method:<7} (alpha {result.best.alpha:g})  old {result.best.old:.3f}  new {result.best.new:.3f}"
            f"  harmonic mean {result.best.harmonic_mean:.3f}{_interval(result.best, 'harmonic_mean')}"
        )
        lines.append(f"      {result.outcome_text()}")
        lines += [f"      {method} {result.warning_text()}"] if result.better else []
    lines.append(
        f"(alpha picked on {first.settings.selection_fraction:.0%} of each task's docs; scores and "
        f"{first.settings.confidence:.0%} bootstrap intervals on the other docs)"
    )
    return lines


def summary_markdown(sweeps: dict[str, SweepResult], audits: list) -> str:
    first = next(iter(sweeps.values()))
    docs = ", ".join(f"`{task}` {len(keys[0])}/{len(keys[1])}" for task, keys in first.splits.items())
    split = (
        f"Alpha is picked on a selection split ({first.settings.selection_fraction:.0%} of each task's docs, "
        f"a seeded doc_hash partition; selection/report docs: {docs}); every score below is measured on the "
        f"disjoint report split, with {first.settings.confidence:.0%} paired-bootstrap intervals "
        f"({first.settings.bootstrap} resamples)."
    )
    rows = [
        "| model | coefficient | old | new | harmonic mean | alphas indistinguishable from the pick | "
        "forgetting recovered | new skill kept |",
        "|---|---|---|---|---|---|---|---|",
        f"| pre | | {first.pre.old:.3f}{_interval(first.pre, 'old')} | {first.pre.new:.3f}{_interval(first.pre, 'new')}"
        f" | {first.pre.harmonic_mean:.3f}{_interval(first.pre, 'harmonic_mean')} | | | |",
        f"| post | | {first.post.old:.3f}{_interval(first.post, 'old')} | "
        f"{first.post.new:.3f}{_interval(first.post, 'new')} | "
        f"{first.post.harmonic_mean:.3f}{_interval(first.post, 'harmonic_mean')} | | | |",
    ]
    warnings = []
    for method, result in sweeps.items():
        best = result.best
        recovered = f"{result.recovered:.1%}" if result.recovered is not None else "N/A"
        kept = f"{result.kept:.1%}" if result.kept is not None else "N/A"
        if result.pick_is:
            recovered = kept = f"the pick is {result.pick_is} itself"
        same = ", ".join(f"{alpha:g}" for alpha in result.indistinguishable) or "none"
        if result.separation:  # the report docs that would separate the pick from its runner-up (sweep.power)
            same += f" ({result.separation.text('the runner-up')})"
        rows.append(
            f"| best {method} | {best.alpha:g} | {best.old:.3f}{_interval(best, 'old')} | "
            f"{best.new:.3f}{_interval(best, 'new')} | {best.harmonic_mean:.3f}"
            f"{_interval(best, 'harmonic_mean')} | {same} | {recovered} | {kept} |"
        )
        warnings += [f"**{method}: {result.warning_text()}**\n\n"] if result.better else []
    audit_rows = ["| adapter | verdict | reasons |", "|---|---|---|"]
    audit_rows += [f"| {Path(a.adapter).name} | {a.verdict} | {'; '.join(a.reasons) or '-'} |" for a in audits]
    links = "\n".join(
        f"- [{method}](sweeps/{method}/report.md): table with intervals, plot (`sweep.png`) and "
        "forgetting map (`forgetting_map.png`)"
        for method in sweeps
    )
    return (
        "# mergekit-lite demo\n\nOld skill = `toy_old`, new skill = `toy_new` (4-way multiple choice, chance 0.25). "
        "Forgetting recovered = (old_best - old_post) / (old_pre - old_post); new skill kept = "
        "(new_best - new_pre) / (new_post - new_pre).\n\n"
        + split
        + "\n\n"
        + "\n".join(rows)
        + "\n\n"
        + "".join(warnings)
        + "## Adapter audits\n\n"
        + "\n".join(audit_rows)
        + "\n\n## Sweeps\n\n"
        + links
        + "\n"
    )
