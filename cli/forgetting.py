"""`mergekit-lite forgetting`: which samples a later model forgot or gained, from two lm-eval sample logs."""

import fnmatch
import json

import click

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.forgetting import (
    TaskForgetting,
    aggregate,
    compare,
    format_table,
    load_lm_eval_samples,
)


def parse_group(spec: str) -> tuple[str, list[str]]:
    """NAME=task1,task2 (names or shell patterns like mmlu_*) into (NAME, [patterns])."""
    name, equals, tasks = spec.partition("=")
    patterns = [task.strip() for task in tasks.split(",") if task.strip()]
    if not equals or not name.strip() or not patterns:
        raise InputError(f"--group {spec!r}: expected NAME=task1,task2 (e.g. old=arc_easy,hellaswag)")
    return name.strip(), patterns


def group_rows(
    name: str, patterns: list[str], rows: dict[str, TaskForgetting], known_tasks: set[str]
) -> list[TaskForgetting]:
    """The compared tasks a group names; a pattern naming no task on either side is a typo, so it errors."""
    members = []
    for pattern in patterns:
        if not fnmatch.filter(known_tasks, pattern):
            raise InputError(f"--group {name}: {pattern!r} matches no task in either samples input")
        members += [task for task in fnmatch.filter(rows, pattern) if task not in members]
    if not members:
        raise InputError(f"--group {name}: none of its tasks is in both samples inputs")
    return [rows[task] for task in sorted(members)]


@click.command("forgetting")
@click.argument("pre_samples", type=click.Path(exists=True))
@click.argument("post_samples", type=click.Path(exists=True))
@click.option(
    "--group",
    "groups",
    multiple=True,
    metavar="NAME=TASK,...",
    help="Pool tasks into a sample-weighted group, e.g. old=arc_easy,hellaswag or new=mmlu_*. Repeatable.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON ({tasks: [...], groups: [...]}) instead of tables.")
def forgetting(pre_samples, post_samples, groups, as_json):
    """Sample-level forgetting (F) and backward transfer (BT) between two models, chance-corrected.

    PRE_SAMPLES and POST_SAMPLES are lm-eval --log_samples outputs: a
    samples_<task>_<timestamp>.jsonl file or a folder searched for them
    (newest file per task). F_true/BT_true remove what guessing alone
    explains; F_max is the share truly known before.

    \b
    Example:
      mergekit-lite forgetting runs/base runs/instruct --group old=arc_easy,hellaswag --group new=gsm8k
    """
    parsed_groups = [parse_group(spec) for spec in groups]
    names = [name for name, _ in parsed_groups]
    if len(set(names)) != len(names):
        raise InputError(f"--group names must be unique, got {', '.join(names)}")
    pre, post = load_lm_eval_samples(pre_samples), load_lm_eval_samples(post_samples)
    for task in sorted(pre.keys() ^ post.keys()):
        side = "PRE_SAMPLES" if task in pre else "POST_SAMPLES"
        click.echo(f"warning: task {task!r} is only in {side}; skipped", err=True)
    common = sorted(pre.keys() & post.keys())
    if not common:
        raise InputError(f"no task in common between {pre_samples} and {post_samples}")
    rows = {task: compare(pre[task], post[task]) for task in common}
    known_tasks = pre.keys() | post.keys()
    group_results = [
        aggregate(group_rows(name, patterns, rows, known_tasks), name) for name, patterns in parsed_groups
    ]
    if as_json:
        payload = {
            "tasks": [row.to_dict() for row in rows.values()],
            "groups": [row.to_dict() for row in group_results],
        }
        click.echo(json.dumps(payload, indent=2))
        return
    click.echo(format_table(list(rows.values())))
    if group_results:
        click.echo()
        click.echo(format_table(group_results, name_header="group"))
