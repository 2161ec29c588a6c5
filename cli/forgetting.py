"""`mergekit-lite forgetting`: which samples a later model forgot or gained, from two lm-eval sample logs."""

import fnmatch
import json
from collections.abc import Sequence

import click

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.forgetting import (
    AGGREGATIONS,
    OVERALL,
    Scoring,
    forgetting_map,
    format_table,
    load_lm_eval_run,
)


def parse_group(spec: str) -> tuple[str, list[str]]:
    """NAME=task1,task2 (names or shell patterns like mmlu_*) into (NAME, [patterns])."""
    name, equals, tasks = spec.partition("=")
    patterns = [task.strip() for task in tasks.split(",") if task.strip()]
    if not equals or not name.strip() or not patterns:
        raise InputError(f"--group {spec!r}: expected NAME=task1,task2 (e.g. old=arc_easy,hellaswag)")
    return name.strip(), patterns


def group_tasks(name: str, patterns: list[str], compared: Sequence[str], known_tasks: set[str]) -> list[str]:
    """The compared tasks a group names; a pattern naming no task on either side is a typo, so it errors."""
    members = []
    for pattern in patterns:
        if not fnmatch.filter(known_tasks, pattern):
            raise InputError(f"--group {name}: {pattern!r} matches no task in either samples input")
        members += [task for task in fnmatch.filter(compared, pattern) if task not in members]
    if not members:
        raise InputError(f"--group {name}: none of its tasks could be compared")
    return sorted(members)


@click.command("forgetting")
@click.argument("pre_samples", type=click.Path(exists=True))
@click.argument("post_samples", type=click.Path(exists=True))
@click.option(
    "--group",
    "groups",
    multiple=True,
    metavar="NAME=TASK,...",
    help="A group of tasks, e.g. old=arc_easy,hellaswag or new=mmlu_*. Repeatable.",
)
@click.option("--metric", "metrics", multiple=True, metavar="[TASK=]METRIC",
              help="0/1 metric to score by, global (used where logged) or per task (default: the task's first).")
@click.option("--filter", "filters", multiple=True, metavar="[TASK=]FILTER",
              help="lm-eval filter to score, e.g. flexible-extract or gsm8k=strict-match (default: the first logged).")
@click.option("--choices", "choices", multiple=True, metavar="TASK=K",
              help="Number of options of a generative multiple-choice task (default: from the docs; inf if none).")
@click.option("--aggregation", type=click.Choice(AGGREGATIONS), default="paper", show_default=True,
              help="Group values: paper = unweighted mean of the tasks' values; pooled = all samples pooled.")
@click.option("--overall", is_flag=True,
              help="Add the paper's OVERALL row: the mean of the --group rows, each group weighing the same.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON ({tasks, groups, skipped}) instead of tables.")
def forgetting(pre_samples, post_samples, groups, metrics, filters, choices, aggregation, overall, as_json):
    """Sample-level forgetting (F) and backward transfer (BT) between two models, chance-corrected
    as in "Mapping Post-Training Forgetting in Language Models at Scale" (§2).

    PRE_SAMPLES and POST_SAMPLES are lm-eval --log_samples outputs of one model each: a
    samples_<task>_<timestamp>.jsonl file or a folder searched for them (newest file per task
    and seed; several seeds are compared seed by seed and averaged). F_true/BT_true remove what
    guessing explains; F_max and BT_max are the shares truly known before and after. A task that
    cannot be compared (misaligned samples, a metric that is not 0/1) is skipped and listed.

    \b
    Example:
      mergekit-lite forgetting runs/base runs/instruct --group old=arc_easy,hellaswag \\
          --group new=gsm8k --filter gsm8k=flexible-extract --metric hellaswag=acc_norm
    """
    parsed_groups = [parse_group(spec) for spec in groups]
    names = [name for name, _ in parsed_groups]
    if len(set(names)) != len(names):
        raise InputError(f"--group names must be unique, got {', '.join(names)}")
    if overall and not parsed_groups:
        raise InputError("--overall averages the --group rows: give at least one --group")
    if overall and OVERALL in names:
        raise InputError(f"--group {OVERALL} is the name of --overall's row; choose another name")
    scoring = Scoring.from_specs(metrics, filters, choices)
    pre, post = load_lm_eval_run(pre_samples, scoring), load_lm_eval_run(post_samples, scoring)
    result = forgetting_map(pre, post)
    for task, reason in result.skipped.items():
        what = "has seeds skipped" if task in result.rows else "skipped"  # its other seeds still make its row
        click.echo(f"warning: task {task!r} {what}: {reason}", err=True)
    if not result.rows:
        raise InputError(f"no task could be compared between {pre_samples} and {post_samples}")
    known_tasks = set(pre.outcomes) | set(post.outcomes) | set(result.skipped)
    members = [(name, group_tasks(name, patterns, list(result.rows), known_tasks)) for name, patterns in parsed_groups]
    group_results = [result.group(name, tasks, aggregation) for name, tasks in members]
    if overall:
        group_results.append(result.overall(members, aggregation))
    if as_json:
        payload = {
            "tasks": [row.to_dict() for row in result.rows.values()],
            "groups": [row.to_dict() for row in group_results],
            "skipped": [{"task": task, "reason": reason} for task, reason in result.skipped.items()],
            "seeds": sorted(result.rows_by_seed),
            "models": {"pre": pre.model, "post": post.model},
        }
        click.echo(json.dumps(payload, indent=2))
        return
    click.echo(format_table(list(result.rows.values())))
    if group_results:
        click.echo()
        click.echo(format_table(group_results))
    if result.skipped:
        click.echo()
        click.echo("skipped: " + "; ".join(f"{task} ({reason})" for task, reason in result.skipped.items()))
