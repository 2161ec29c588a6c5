"""`mergekit-lite forgetting`: which samples a later model forgot or gained, from lm-eval sample logs of two
models, or of the checkpoints of a training run."""

import fnmatch
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import click

from mergekit_lite.cli.forgetting_matrix import run_matrix_form
from mergekit_lite.cli.options import QUIET, json_flag, output_file, settings_options
from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.forgetting import OVERALL, format_table
from mergekit_lite.evaluate.outcomes import Scoring, load_lm_eval_run
from mergekit_lite.evaluate.settings import ForgettingSettings, MatrixSettings
from mergekit_lite.evaluate.spurious import SPURIOUS, SpuriousMap, SpuriousSplit, format_split_table, spurious_map
from mergekit_lite.evaluate.ties import run_ties
from mergekit_lite.evaluate.trajectory import (
    REPLAY_FORMATS,
    Trajectory,
    crossings,
    heatmap_formats,
    jsonl,
    parse_alert,
    plot_heatmap,
    replay_records,
    sample_rows,
    trajectory,
)
from mergekit_lite.io.outputs import check_output_file, write_files


def parse_group(spec: str) -> tuple[str, list[str]]:
    """NAME=task1,task2 (names or shell patterns like mmlu_*) into (NAME, [patterns])."""
    name, equals, tasks = spec.partition("=")
    patterns = [task.strip() for task in tasks.split(",") if task.strip()]
    if not equals or not name.strip() or not patterns:
        raise InputError(f"--group {spec!r}: expected NAME=task1,task2 (e.g. old=arc_easy,hellaswag)")
    return name.strip(), patterns


def group_tasks(
    name: str, patterns: list[str], compared: Sequence[str], known_tasks: set[str], lm_eval_groups: dict[str, list[str]]
) -> list[str]:
    """The compared tasks a group names: task names, shell patterns, or lm-eval groups (e.g. mmlu: the tasks
    under it in the results files' group_subtasks); a pattern naming no task on either side is a typo, so it
    errors."""
    members = []
    for pattern in patterns:
        named = (
            leaf_tasks(pattern, lm_eval_groups) if pattern in lm_eval_groups else fnmatch.filter(known_tasks, pattern)
        )
        if not set(named) & known_tasks:
            raise InputError(f"--group {name}: {pattern!r} matches no task in either samples input")
        members += [task for task in compared if task in named and task not in members]
    if not members:
        raise InputError(f"--group {name}: none of its tasks could be compared")
    return sorted(members)


def leaf_tasks(group: str, lm_eval_groups: dict[str, list[str]], seen: frozenset = frozenset()) -> list[str]:
    """The tasks under an lm-eval group, its subgroups expanded (a group listed inside itself is not followed)."""
    tasks = []
    for member in lm_eval_groups.get(group, []):
        if member in lm_eval_groups and member not in seen | {group}:
            tasks += leaf_tasks(member, lm_eval_groups, seen | {group})
        elif member not in lm_eval_groups:
            tasks.append(member)
    return tasks


@click.command("forgetting")
@click.argument("inputs", nargs=-1, required=True, metavar="PRE POST [CKPT...]", type=click.Path(exists=True))
@settings_options(ForgettingSettings)
@output_file(
    "--samples",
    "FILE.jsonl",
    "Write one line per compared (task, doc, seed): outcome, scores, prompt, gold and answers.",
)
@output_file("--replay", "FILE.jsonl", "Write the forgotten samples as training data (TRL's prompt/completion JSONL).")
@output_file("--heatmap", "FILE.png", "Plot F_true and BT_true per group (or task) and checkpoint.")
@output_file(
    "--html",
    "FILE.html",
    "Write the tables, the heat map and every compared sample as one self-contained HTML page.",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace --samples, --replay and --heatmap files an earlier run "
    "wrote (only while unchanged; never another file).",
)
@json_flag("{tasks, groups, skipped}")
@QUIET
@settings_options(MatrixSettings, into="matrix")
def forgetting(inputs, settings, matrix, samples_out, replay_out, heatmap_out, html_out, overwrite, as_json, quiet):
    """Sample-level forgetting (F) and backward transfer (BT) between two models, chance-corrected
    as in "Mapping Post-Training Forgetting in Language Models at Scale" (§2), or along a training run.

    Each input is an lm-eval --log_samples output of one model: a samples_<task>_<timestamp>.jsonl
    file or a folder searched for them (newest file per task and seed; several seeds are compared
    seed by seed and averaged). F_true/BT_true remove what guessing explains; F_max and BT_max are
    the shares truly known before and after. A task that cannot be compared (misaligned samples, a
    metric that is not 0/1) is skipped and listed.

    With three or more inputs (checkpoints of one run, in training order) every checkpoint is compared
    with the first: one row per checkpoint and task/group, as the two-model form would give it.

    \b
    Examples:
      mergekit-lite forgetting runs/base runs/instruct --group old=arc_easy,hellaswag \\
          --group new=gsm8k --filter gsm8k=flexible-extract --metric hellaswag=acc_norm \\
          --samples forgotten.jsonl --replay replay.jsonl
      mergekit-lite forgetting runs/step-0 runs/step-1000 runs/step-2000 --group old=arc_easy \\
          --heatmap forgetting.png --alert 'old:F_true>0.1'
      mergekit-lite forgetting runs/pre runs/ft-1 runs/ft-2 runs/ft-3 runs/ft-4 --matrix history/
      mergekit-lite forgetting runs/pre runs/ft-new-probe --history history/ \\
          --replay replay.jsonl --replay-budget 200
    """
    trajectory_options = [
        name
        for name, given in (
            ("--group", settings.groups),
            ("--overall", settings.overall),
            ("--heatmap", heatmap_out),
            ("--alert", settings.alerts),
            ("--realigned", settings.realigned),
            ("--replay-spurious", settings.replay_spurious),
            ("--overwrite", overwrite),
        )
        if given
    ]
    if run_matrix_form(
        inputs,
        matrix,
        Scoring.from_specs(settings.metrics, settings.filters, settings.choices),
        samples_out,
        replay_out,
        settings.replay_format or REPLAY_FORMATS[0],
        as_json,
        trajectory_options,
        html_out,
    ):
        return
    if len(inputs) < 2:
        raise InputError(
            "forgetting needs at least two lm-eval outputs: PRE POST, or the checkpoints of a run in order"
        )
    parsed_groups, parsed_alerts = checked_groups_and_alerts(settings, inputs, replay_out)
    outputs = check_outputs(
        {"--samples": samples_out, "--replay": replay_out, "--heatmap": heatmap_out, "--html": html_out},
        [*inputs, *([settings.realigned] if settings.realigned else [])],
        overwrite,
    )
    scoring = Scoring.from_specs(settings.metrics, settings.filters, settings.choices)
    runs = [load_lm_eval_run(path, scoring) for path in inputs]
    tied = [run_ties(path) for path in inputs]  # docs whose answer is lm-eval's order, not the model's choice
    series = trajectory(runs, inputs)
    group_rows = grouped_rows(series, runs, parsed_groups, settings)  # an error is one line, before any warning
    split = realigned_split(series, settings.realigned, scoring, group_rows[0]) if settings.realigned else None
    warn_skipped_and_tied(series, inputs, tied)
    crossed = crossings(parsed_alerts, group_rows, inputs)
    if len(inputs) == 2:
        render_two_models(series, group_rows[0], as_json, split, tied)
    else:
        render_trajectory(series, group_rows, crossed, as_json)
    replay_format = settings.replay_format or REPLAY_FORMATS[0]
    write_outputs(outputs, series, group_rows, replay_format, split, settings.replay_spurious, overwrite, crossed)
    for alert in crossed:
        click.echo(
            f"alert: checkpoint {alert['checkpoint']} ({alert['path']}): {alert['group']} {alert['metric']} = "
            f"{alert['value']:.3f} crosses {alert['alert']}",
            err=True,
        )
    if crossed:
        raise click.exceptions.Exit(3)


def checked_groups_and_alerts(settings: ForgettingSettings, inputs: Sequence[str], replay_out) -> tuple[list, list]:
    """The --group and --alert specs parsed, and the options that only go together checked, before any file is
    read."""
    parsed_groups = [parse_group(spec) for spec in settings.groups]
    names = [name for name, _ in parsed_groups]
    if len(set(names)) != len(names):
        raise InputError(f"--group names must be unique, got {', '.join(names)}")
    if settings.overall and not parsed_groups:
        raise InputError("--overall averages the --group rows: give at least one --group")
    if settings.overall and OVERALL in names:
        raise InputError(f"--group {OVERALL} is the name of --overall's row; choose another name")
    parsed_alerts = [parse_alert(spec, names + [OVERALL] * settings.overall) for spec in settings.alerts]
    check_realigned_options(settings.realigned, settings.replay_spurious, inputs)
    if settings.replay_format is not None and not replay_out:
        raise InputError("--replay-format shapes --replay's file: give --replay FILE.jsonl")
    return parsed_groups, parsed_alerts


def grouped_rows(series: Trajectory, runs, parsed_groups, settings: ForgettingSettings) -> list[list]:
    """Per compared checkpoint, the --group rows (and --overall's): a group names tasks, patterns or lm-eval groups
    of either run; a checkpoint sharing no task with the first is an error."""
    inputs, group_rows = series.labels, []
    for position, result in enumerate(series.maps, start=1):
        if not result.rows:
            raise InputError(
                f"no task could be compared between {inputs[0]} and {inputs[position]}: "
                + "; ".join(f"{task} ({reason})" for task, reason in result.skipped.items())
            )
        known_tasks = set(runs[0].outcomes) | set(runs[position].outcomes) | set(result.skipped)
        lm_eval_groups = {**runs[0].groups, **runs[position].groups}
        members = [
            (name, group_tasks(name, patterns, list(result.rows), known_tasks, lm_eval_groups))
            for name, patterns in parsed_groups
        ]
        group_rows.append(
            [result.group(name, tasks, settings.aggregation) for name, tasks in members]
            + ([result.overall(members, settings.aggregation)] if settings.overall else [])
        )
    return group_rows


def warn_skipped_and_tied(series: Trajectory, inputs: Sequence[str], tied) -> None:
    """A warning per skipped task (or skipped seeds of a task) and per model whose answers are lm-eval's order."""
    for position, result in enumerate(series.maps, start=1):
        where = "" if len(inputs) == 2 else f"checkpoint {position} ({inputs[position]}): "
        for task, reason in result.skipped.items():
            what = "has seeds skipped" if task in result.rows else "skipped"  # its other seeds still make its row
            click.echo(f"warning: {where}task {task!r} {what}: {reason}", err=True)
    for label, ties in zip(inputs, tied, strict=True):
        if ties.tasks:
            click.echo(f"warning: tied answers (argmax takes the first option): {ties.text(label)}", err=True)


def check_outputs(outputs: dict, inputs: Sequence[str], overwrite: bool = False) -> dict:
    """The files to write, checked before any work: new files (or, with `overwrite`, ones an earlier run wrote),
    apart from the inputs and from each other, the heat map in a format matplotlib writes."""
    given = {option: path for option, path in outputs.items() if path}
    for option, path in given.items():
        formats = heatmap_formats() if option == "--heatmap" else {"html", "htm"} if option == "--html" else None
        check_output_file(path, inputs, overwrite=overwrite, suffixes=formats)
    if len({os.path.realpath(path) for path in given.values()}) != len(given):
        raise InputError(f"{', '.join(given)} must name different files")
    return given


def render_two_models(series: Trajectory, groups, as_json: bool, split=None, tied=None) -> None:
    """The two-model form's output: tables, or JSON {tasks, groups, skipped, seeds, models}; with --realigned each
    task and group also carries its spurious/genuine split."""
    result, (pre, post) = series.maps[0], series.runs
    if as_json:
        payload = {
            "tasks": [with_split(row.to_dict(), split and split.rows.get(row.task)) for row in result.rows.values()],
            "groups": [with_split(row.to_dict(), split and split.groups.get(row.group)) for row in groups],
            "skipped": [{"task": task, "reason": reason} for task, reason in result.skipped.items()],
            "seeds": sorted(result.rows_by_seed),
            "models": {"pre": pre.model, "post": post.model},
            "ties": {label: ties.to_dict() for label, ties in zip(("pre", "post"), tied or (), strict=False)},
        }
        click.echo(json.dumps(payload, indent=2, allow_nan=False))
        return
    click.echo(format_table(list(result.rows.values())))
    if groups:
        click.echo()
        click.echo(format_table(groups))
    if split is not None:
        click.echo()
        click.echo(format_split_table([*split.rows.values(), *split.groups.values()]))
    for label, ties in zip(("pre", "post"), tied or (), strict=False):
        if ties.tasks:
            click.echo()
            click.echo(f"ties: {ties.text(label)}")
    if result.skipped:
        click.echo()
        click.echo("skipped: " + "; ".join(f"{task} ({reason})" for task, reason in result.skipped.items()))


def render_trajectory(series: Trajectory, group_rows, crossed, as_json: bool) -> None:
    """One row per checkpoint and task (then per checkpoint and group), checkpoint i against checkpoint 0."""
    if as_json:
        payload = {
            "checkpoints": [
                {"position": position, "path": label, "model": run.model}
                for position, (label, run) in enumerate(zip(series.labels, series.runs, strict=True))
            ],
            "rows": [
                {
                    "checkpoint": position,
                    "path": series.labels[position],
                    "tasks": [row.to_dict() for row in result.rows.values()],
                    "groups": [row.to_dict() for row in groups],
                    "skipped": [{"task": task, "reason": reason} for task, reason in result.skipped.items()],
                }
                for position, (result, groups) in enumerate(zip(series.maps, group_rows, strict=True), start=1)
            ],
            "alerts": crossed,
        }
        click.echo(json.dumps(payload, indent=2, allow_nan=False))
        return
    click.echo(f"reference (checkpoint 0): {series.labels[0]}")
    labels = [f"{position}" for position in range(1, len(series.labels))]
    task_rows = [
        (label, row) for label, result in zip(labels, series.maps, strict=True) for row in result.rows.values()
    ]
    click.echo(format_table([row for _, row in task_rows], checkpoints=[label for label, _ in task_rows]))
    group_cells = [(label, row) for label, groups in zip(labels, group_rows, strict=True) for row in groups]
    if group_cells:
        click.echo()
        click.echo(format_table([row for _, row in group_cells], checkpoints=[label for label, _ in group_cells]))
    click.echo()
    click.echo(
        "checkpoints: " + "; ".join(f"{label}: {name}" for label, name in zip(labels, series.labels[1:], strict=True))
    )


def write_outputs(
    outputs: dict,
    series: Trajectory,
    group_rows,
    replay_format: str,
    split=None,
    replay_spurious: bool = False,
    overwrite: bool = False,
    crossed: list[dict] | None = None,
) -> None:
    """--samples, --replay, --heatmap and --html, written together or not at all; the counts on stderr. With
    --realigned, forgotten rows carry forgetting_kind and --replay leaves the spurious ones out unless asked."""
    rows = sample_rows(series) if {"--samples", "--replay"} & set(outputs) else []
    if split is not None:
        mark_kinds(rows, split.map)
    files, notes = {}, []
    if "--samples" in outputs:
        files[outputs["--samples"]] = jsonl(rows)
        notes.append(f"samples: {len(rows)} rows written to {outputs['--samples']}")
    if "--replay" in outputs:
        kept = replay_chooser(split is not None and not replay_spurious)
        records, unrecoverable = replay_records(rows, replay_format, kept)
        files[outputs["--replay"]] = jsonl(records)
        note = (
            f"; {unrecoverable} forgotten docs left out: their gold answer or prompt is not in the log"
            if unrecoverable
            else ""
        )
        if split is not None and not replay_spurious:
            note += f"; {spurious_docs(rows)} spurious docs left out (--replay-spurious keeps them)"
        notes.append(f"replay: {len(records)} forgotten samples written to {outputs['--replay']}{note}")
    if "--heatmap" in outputs:
        files[outputs["--heatmap"]] = lambda temp: plot_heatmap(series, group_rows, temp)
    if "--html" in outputs:
        from mergekit_lite.evaluate.pages import forgetting_page

        files[outputs["--html"]] = forgetting_page(series, group_rows, crossed or [], split)
        notes.append(f"html: written to {outputs['--html']}")
    write_files(files, overwrite)
    for note in notes:
        click.echo(note, err=True)


# --- re-alignment: spurious against genuine forgetting -------------------------------------------------------


@dataclass
class RealignedSplit:
    """The spurious/genuine split of the compared tasks and of the --group rows."""

    map: SpuriousMap
    rows: dict[str, SpuriousSplit]
    groups: dict[str, SpuriousSplit]


def check_realigned_options(realigned: str | None, replay_spurious: bool, inputs: Sequence[str]) -> None:
    if replay_spurious and not realigned:
        raise InputError("--replay-spurious keeps spurious docs in --replay: it needs --realigned LOG")
    if realigned and len(inputs) != 2:
        raise InputError("--realigned compares two models (PRE POST): it is POST's log under a re-alignment")


def realigned_split(series: Trajectory, realigned: str, scoring: Scoring, groups) -> RealignedSplit:
    """Load LOG, split each compared task's forgotten docs, and each --group's; tasks LOG lacks, a warning."""
    result, (pre, post) = series.maps[0], series.runs
    compared = {}
    for seed, rows in result.rows_by_seed.items():
        for task in rows:
            compared.setdefault(task, {})[seed] = rows[task]
    split = spurious_map(pre, post, load_lm_eval_run(realigned, scoring), compared, realigned)
    for task in split.missing:
        click.echo(
            f"warning: --realigned {realigned} has no samples of task {task!r}: its forgetting is not split", err=True
        )
    return RealignedSplit(split, split.tasks, {row.group: split.group(row.group, row.tasks) for row in groups})


def with_split(row: dict, found: SpuriousSplit | None) -> dict:
    """A JSON row with its split: spurious and genuine as doc counts, the shares under their own names."""
    if not found:
        return row
    return {**row, **{key: value for key, value in found.to_dict().items() if key not in ("name", "forgotten")}}


def mark_kinds(rows: list[dict], split: SpuriousMap) -> None:
    """forgetting_kind on each forgotten sample row: spurious or genuine (None where LOG lacks the task)."""
    for row in rows:
        if row["outcome"] == "forgotten":
            doc = row["doc_id"] if row["doc_id"] is not None else row["doc_hash"]
            row["forgetting_kind"] = split.kind(row["task"], row["seed"], doc)


def replay_chooser(genuine_only: bool):
    if genuine_only:
        return lambda row: row["outcome"] == "forgotten" and row.get("forgetting_kind") != SPURIOUS
    return lambda row: row["outcome"] == "forgotten"


def spurious_docs(rows: list[dict]) -> int:
    """Distinct (task, doc) forgotten as spurious: the docs --replay leaves out."""
    return len(
        {
            (row["task"], row["doc_hash"], row["doc_id"])
            for row in rows
            if row["outcome"] == "forgotten" and row.get("forgetting_kind") == SPURIOUS
        }
    )
