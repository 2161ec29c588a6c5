"""What was forgotten, sample by sample, between a reference and one or more later checkpoints [ours].

The forgetting map ("Mapping Post-Training Forgetting in Language Models at Scale", §2) counts transitions;
this module names them: one row per compared (task, doc, seed) with each model's score, the prompt, the gold
answer and each model's answer (`records.sample_text`), the samples to replay ("Demystifying Language
Model Forgetting with Low-Rank Example Associations" replays the forgotten examples), and the map along a
training run: checkpoint i is compared with checkpoint 0, exactly as the two-model map compares post with pre,
with alert thresholds a training pipeline can stop on.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.forgetting import SHARES, ForgettingMap, GroupForgetting, forgetting_map
from mergekit_lite.evaluate.outcomes import LoadedRun, SampleOutcomes

OUTCOMES = {(True, True): "kept", (False, True): "gained", (True, False): "forgotten", (False, False): "never"}
REPLAY_FORMATS = ("prompt-completion", "messages")
DECIMAL = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
ALERT = re.compile(r"^(?P<group>[^:]+):(?P<metric>[A-Za-z_]+)\s*(?P<op>[<>])\s*(?P<value>\S+)$")


@dataclass(frozen=True)
class Trajectory:
    """Checkpoint 0 (the reference: pre) and each later checkpoint's map against it, in the order given."""

    labels: list[str]
    runs: list[LoadedRun]
    maps: list[ForgettingMap]  # maps[i - 1] compares checkpoint i with checkpoint 0


def trajectory(runs: Sequence[LoadedRun], labels: Sequence[str]) -> Trajectory:
    """The forgetting map of every checkpoint against the first: row i is what the two-model form gives for
    (checkpoint 0, checkpoint i)."""
    if len(runs) < 2:
        raise InputError("forgetting needs at least two lm-eval outputs (pre and post)")
    return Trajectory(list(labels), list(runs), [forgetting_map(runs[0], run) for run in runs[1:]])


def sample_rows(series: Trajectory) -> list[dict]:
    """One row per (task, doc, seed) that every checkpoint's map compared, in task, seed and doc order
    (`sample_row`); `first_forgotten` is the first checkpoint (1-based position in the order given) that is
    wrong where checkpoint 0 was right, or None."""
    rows = []
    last = series.maps[-1]
    for task in sorted(last.rows):
        for seed in sorted(last.rows_by_seed):
            if task not in last.rows_by_seed[seed] or not all(
                task in m.rows_by_seed.get(seed, {}) for m in series.maps
            ):
                continue
            outcomes = [run.outcomes[task][seed] for run in series.runs]
            for key in doc_order(outcomes[0]):
                row = sample_row(outcomes, key, seed)
                scores = row["scores"]
                row["first_forgotten"] = next((i for i in range(1, len(scores)) if scores[0] and not scores[i]), None)
                rows.append(row)
    return rows


def doc_order(outcomes: SampleOutcomes) -> list[str]:
    """A task's sample keys in lm-eval's doc order."""
    return sorted(outcomes.correct, key=lambda key: (outcomes.doc_ids.get(key, -1), key))


def sample_row(outcomes: Sequence[SampleOutcomes], key: str, seed: str) -> dict:
    """One sample across models (the first is the reference): `scores` and `answers` in the models' order,
    `outcome` the transition from the first to the last (for two models: pre -> post), the prompt, gold and
    replay completion from the reference's record (`records.sample_text`)."""
    reference = outcomes[0]
    scores = [outcome.correct[key] for outcome in outcomes]
    text = reference.texts.get(key)
    return {
        "task": reference.task,
        "doc_id": reference.doc_ids.get(key),
        "doc_hash": text.doc_hash if text else None,
        "seed": seed,
        "outcome": OUTCOMES[(scores[0], scores[-1])],
        "scores": [int(score) for score in scores],
        "prompt": text.prompt if text else None,
        "gold": text.gold if text else None,
        "answers": [outcome.texts[key].answer if key in outcome.texts else None for outcome in outcomes],
        "answer_rule": reference.answer_rule,
        "completion": text.completion if text else None,
    }


def replay_records(
    rows: Sequence[dict], replay_format: str, chosen: Callable[[dict], bool] = lambda row: row["outcome"] == "forgotten"
) -> tuple[list[dict], int]:
    """The `chosen` samples (by default the forgotten ones) as TRL training records, one per (task, doc)
    whatever the seeds, and how many chosen docs had no recoverable prompt or gold answer (not written).

    prompt-completion: {"prompt", "completion"} (TRL's prompt-completion format; prompt + completion is the
    text lm-eval scored, or its few-shot join of question and answer); messages: {"messages": [user, assistant]}
    (TRL's conversational format). Both add "task" and "doc_id"."""
    if replay_format not in REPLAY_FORMATS:
        raise InputError(f"--replay-format must be one of {', '.join(REPLAY_FORMATS)}, got {replay_format!r}")
    records, unrecoverable, seen = [], 0, set()
    for row in rows:
        if not chosen(row) or (row["task"], row["doc_hash"], row["doc_id"]) in seen:
            continue
        seen.add((row["task"], row["doc_hash"], row["doc_id"]))
        if row["prompt"] is None or row["completion"] is None:
            unrecoverable += 1
            continue
        if replay_format == "messages":
            body = {
                "messages": [
                    {"role": "user", "content": row["prompt"]},
                    {"role": "assistant", "content": row["completion"].lstrip()},
                ]
            }
        else:
            body = {"prompt": row["prompt"], "completion": row["completion"]}
        records.append({**body, "task": row["task"], "doc_id": row["doc_id"]})
    return records, unrecoverable


def jsonl(records: Sequence[dict]) -> str:
    return "".join(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n" for record in records)


# --- alerts ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Alert:
    """GROUP:METRIC>VALUE or GROUP:METRIC<VALUE: crossed when a checkpoint's group value is beyond VALUE."""

    group: str
    metric: str
    op: str
    value: float

    def __str__(self) -> str:
        return f"{self.group}:{self.metric}{self.op}{self.value:g}"

    def crossed(self, value: float) -> bool:
        return value > self.value if self.op == ">" else value < self.value


def parse_alert(spec: str, groups: Sequence[str]) -> Alert:
    """One --alert, checked before any work: its syntax, a metric of the map, a group given by --group."""
    match = ALERT.match(spec.strip())
    if not match:
        raise InputError(f"--alert {spec!r}: expected GROUP:METRIC>VALUE or GROUP:METRIC<VALUE (e.g. old:F_true>0.1)")
    group, metric = match["group"].strip(), match["metric"]
    if metric not in SHARES:
        raise InputError(f"--alert {spec!r}: unknown metric {metric!r} (choose from {', '.join(SHARES)})")
    if group not in groups:
        raise InputError(f"--alert {spec!r}: no group {group!r} (groups: {', '.join(groups) or 'none; add --group'})")
    if not DECIMAL.match(match["value"]):  # float() also reads 'inf', 'nan' and '0_1'
        raise InputError(f"--alert {spec!r}: {match['value']!r} is not a number (write a decimal, e.g. 0.1)")
    value, op = float(match["value"]), match["op"]
    if not (0 <= value < 1 if op == ">" else 0 < value <= 1):  # every metric is a share in [0, 1]
        acts = "can never be crossed" if (value >= 1) == (op == ">") else "is crossed by every value"
        raise InputError(
            f"--alert {spec!r}: {metric} is a share in [0, 1], so {op}{match['value']} {acts}; give a "
            f"threshold in {'[0, 1)' if op == '>' else '(0, 1]'}"
        )
    return Alert(group, metric, op, value)


def crossings(
    alerts: Sequence[Alert], groups_per_checkpoint: Sequence[Sequence[GroupForgetting]], labels: Sequence[str]
) -> list[dict]:
    """Every (checkpoint, alert) whose group value crosses the threshold, checkpoints 1.. in order."""
    crossed = []
    for position, groups in enumerate(groups_per_checkpoint, start=1):
        by_name = {row.group: row for row in groups}
        for alert in alerts:
            if alert.group in by_name and alert.crossed(value := getattr(by_name[alert.group], alert.metric)):
                crossed.append(
                    {
                        "checkpoint": position,
                        "path": labels[position],
                        "alert": str(alert),
                        "group": alert.group,
                        "metric": alert.metric,
                        "value": value,
                    }
                )
    return crossed


# --- heat map -------------------------------------------------------------------------------------------


def _short(label: str, width: int = 24) -> str:
    """A checkpoint's folder name for an axis label, its end kept when long (where step numbers are)."""
    name = os.path.basename(os.path.normpath(label)) or label
    return name if len(name) <= width else "..." + name[-(width - 3) :]


def heatmap_values(series: Trajectory, group_rows: Sequence[Sequence[GroupForgetting]]) -> tuple[list[str], dict]:
    """Rows of the heat map: the groups, or every compared task when there are none (nan where a checkpoint
    did not compare it); one column per checkpoint after the first."""
    if group_rows and group_rows[0]:
        names = [row.group for row in group_rows[0]]
        cells = [{row.group: row for row in groups} for groups in group_rows]
    else:
        names = sorted({task for result in series.maps for task in result.rows})
        cells = [result.rows for result in series.maps]
    return names, {
        metric: [[getattr(cell[name], metric) if name in cell else math.nan for cell in cells] for name in names]
        for metric in ("F_true", "BT_true")
    }


def heatmap_formats() -> set[str]:
    """The file suffixes matplotlib saves a figure as, but pgf (it needs a LaTeX installation)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return set(FigureCanvasBase.get_supported_filetypes()) - {"pgf"}


def plot_heatmap(series: Trajectory, group_rows: Sequence[Sequence[GroupForgetting]], path) -> None:
    """F_true and BT_true, groups (or tasks) by checkpoint, each cell labelled; matplotlib's Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names, values = heatmap_values(series, group_rows)
    checkpoints = [f"{position}: {_short(label)}" for position, label in enumerate(series.labels[1:], start=1)]
    figure = Figure(figsize=(2.4 + 1.5 * len(checkpoints), 2.6 + 0.45 * len(names)))
    FigureCanvasAgg(figure)
    for position, metric in enumerate(("F_true", "BT_true")):
        axes = figure.add_subplot(1, 2, position + 1)
        image = axes.imshow(
            values[metric], vmin=0, vmax=1, cmap="Reds" if metric == "F_true" else "Greens", aspect="auto"
        )
        for row, line in enumerate(values[metric]):
            for column, value in enumerate(line):
                axes.text(
                    column,
                    row,
                    "-" if value != value else f"{value:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if value > 0.6 else "black",
                )
        axes.set_xticks(range(len(checkpoints)), checkpoints, fontsize=7, rotation=45, ha="right")
        axes.set_yticks(range(len(names)), names, fontsize=7)
        axes.set_xlabel("checkpoint")
        axes.set_title(f"{metric} vs checkpoint 0", fontsize=9)
        figure.colorbar(image, ax=axes, shrink=0.8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
