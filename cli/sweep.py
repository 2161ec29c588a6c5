"""`mergekit-lite sweep`: merge pre and post at every alpha of a grid, score old and new skills, pick the best."""

import contextlib
import os

import click

from mergekit_lite.cli.options import given_options
from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.trajectory import REPLAY_FORMATS
from mergekit_lite.merge.methods import SWEEPABLE
from mergekit_lite.sweep.settings import CHAT_TEMPLATE_DEFAULT, SweepFile

EXAMPLES = (
    """
\b
What alpha is, per --method (the method's main coefficient):
"""
    + "\n".join(f"  {name:<17} {method.alpha_meaning}" for name, method in SWEEPABLE.items())
    + """
\b
Pick: the alpha with the highest harmonic mean 2*old*new/(old+new) of the old-task and new-task
scores (per group: the unweighted mean of its tasks' scores, as the forgetting paper averages
tasks; --aggregation pooled weighs samples), measured on a selection split of every task's docs
(seeded doc_hash partition, --selection-fraction); every alpha is reported on the disjoint report
split with paired-bootstrap intervals, and the alphas that cannot be told from the pick are named
(--selection none: pick and report on the same docs); an alpha that beats the pick there with an
interval above 0 is named in a warning. Ties go to the smallest alpha. "forgetting recovered" is
(old_best - old_post) / (old_pre - old_post), the share of post's old-task loss the pick wins back;
"new skill kept" is (new_best - new_pre) / (new_post - new_pre); when the pick is pre or post
itself, the summary says so instead.
\b
Tasks are scored as `mergekit-lite forgetting` scores lm-eval files: --metric, --filter and
--choices take a global value or TASK=VALUE (e.g. --filter gsm8k=flexible-extract).
\b
The --out folder gets points/ (one JSON per finished model: rerunning the same command resumes,
and writes its --replay file and --save-best folder again), results.json, report.md, sweep.png,
forgetting_map.png and samples.jsonl (each doc's outcome for pre, post and the pick; --replay
writes the docs the pick still loses as training data).
\b
Examples:
  mergekit-lite sweep --pre base/ --post instruct/ --alphas 0:1:0.1 \\
      --old-tasks arc_easy,hellaswag --new-tasks gsm8k --limit 200 --out runs/lerp
\b
  # an instruct model scored as lm-eval scores it: 5-shot, chat template, demonstrations as turns
  mergekit-lite sweep --pre base/ --post instruct/ --alphas 0:1:0.1 --old-tasks arc_easy \\
      --new-tasks gsm8k --num-fewshot 5 --apply-chat-template --fewshot-as-multiturn --out runs/chat
\b
  mergekit-lite sweep examples/sweep.yaml --method ties --density 0.5 --alphas 0:1.5:0.25 --out runs/ties
\b
  # several methods in one run folder, pre and post evaluated once; comparison.md against --baseline
  mergekit-lite sweep examples/sweep.yaml --method linear,task_arithmetic,ties,lines --out runs/compare
\b
  # two coefficients: every lambda x density cell (heat map in the report); --budget: successive halving
  mergekit-lite sweep examples/sweep.yaml --method ties --densities 0.1:0.9:0.2 --budget 20 --out runs/ties-2d
"""
)


@click.command(epilog=EXAMPLES)
@click.argument("config_file", required=False, type=click.Path(dir_okay=False))
@given_options(SweepFile)
@click.option("--baseline", help="With several methods: the one each is compared with (default linear).")
@click.option(
    "--replay",
    "replay_out",
    type=click.Path(dir_okay=False),
    metavar="FILE.jsonl",
    help="Write the docs post forgot that the pick still loses as training data (TRL's prompt/completion "
    "JSONL, as `forgetting --replay`), both splits.",
)
@click.option(
    "--replay-format",
    type=click.Choice(REPLAY_FORMATS),
    default="prompt-completion",
    show_default=True,
    help="--replay records: prompt/completion, or chat messages (user, assistant).",
)
@click.option("--replay-all", is_flag=True, help="--replay every doc post forgot, the ones the pick won back too.")
@click.option(
    "--require-verified",
    is_flag=True,
    help="Sweep a LoRA adapter (--post, or a model+lora reference) only "
    "when its audit VERIFIES it: a WARN stops the sweep too (exit 1). Its verdict is printed on stderr "
    "either way.",
)
@click.option("--quiet", "-q", is_flag=True, help="No sweep progress bar either (library bars are hidden by default).")
@click.option(
    "--verbose",
    is_flag=True,
    help="Show transformers' and lm-eval's own progress bars and logs too (hidden under the sweep's bar by default).",
)
def sweep(config_file, given, baseline, replay_out, replay_format, replay_all, require_verified, quiet, verbose):
    """Sweep the merge coefficient alpha between PRE and POST, evaluate old and new skills at every
    alpha (plus pre and post themselves), map sample-level forgetting against pre, and pick the
    alpha with the best harmonic mean. Settings come from flags or a YAML CONFIG_FILE with the
    same keys (flags win); see examples/sweep.yaml.
    """
    from mergekit_lite.audits.report import each_verdict_once
    from mergekit_lite.sweep import load_sweep_file, run_sweep, settings_from_dict
    from mergekit_lite.sweep.samples import check_replay, write_replay

    _library_output(quiet, verbose)
    data = {"method": "linear", **(load_sweep_file(config_file) if config_file else {})}
    if given.get("apply_chat_template") == CHAT_TEMPLATE_DEFAULT:
        given["apply_chat_template"] = True
    data = {**data, **given}  # the command line wins over the file
    listed = data.pop("methods", None)
    methods = (
        listed
        if listed and "method" not in given
        else [name.strip() for name in data["method"].split(",") if name.strip()]
    )
    if (replay_format != "prompt-completion" or replay_all) and not replay_out:
        raise InputError("--replay-format and --replay-all shape --replay's file: give --replay FILE.jsonl")
    if require_verified:
        from mergekit_lite.audited import require_verified_inputs

        require_verified_inputs(data.get("pre"), [data.get("pre"), data.get("post")])
    if len(methods) > 1 or baseline:
        from mergekit_lite.sweep import method_settings, run_comparison

        if replay_out:
            raise InputError("--replay writes one sweep's pick: give a single --method")
        from mergekit_lite.sweep.compare import comparison_summary

        every = method_settings(data, methods)
        _warn_remote_code(every[0])
        with _resume_hint(data.get("out")), each_verdict_once():  # a sweep audits its adapter at each point: one line
            comparison = run_comparison(every, baseline or "linear", progress=not quiet)
        click.echo(comparison_summary(comparison))
        for result in comparison.sweeps.values():
            _warn(result)
        return
    settings = settings_from_dict(data)
    if replay_out:
        check_replay(replay_out, settings)
    _warn_remote_code(settings)
    with _resume_hint(settings.out), each_verdict_once():  # a sweep audits its adapter at each point: one line
        result = run_sweep(settings, progress=not quiet)
    click.echo(summary(result))
    _warn(result)
    if settings.save_best:
        click.echo(f"saved the pick ({result.best.label}) as a model folder: {settings.save_best}")
    if settings.save_best_adapter:
        click.echo(f"saved the pick ({result.best.label}) as a LoRA adapter folder: {settings.save_best_adapter}")
    if replay_out:
        written, left_out = write_replay(result, replay_out, replay_format, replay_all)
        which = "forgotten by post" if replay_all else "still lost by the pick"
        click.echo(
            f"replay: {written} docs {which} written to {replay_out}; {left_out} left out (no prompt or gold "
            "answer in the point files)",
            err=True,
        )


def _warn(result) -> None:
    """What results.json and report.md mark, said here too, where the command ends with exit 0 and a pick: models
    that gave NaN or infinite logits, and tasks scored within chance (sweep.chance)."""
    broken = [point.label for point in (result.pre, result.post, *result.points) if point.nonfinite]
    if broken:
        shown = ", ".join(broken[:5]) + (", ..." if len(broken) > 5 else "")
        click.echo(
            f"warning: {len(broken)} model(s) gave NaN or infinite logits ({shown}): their scores are noise, never the "
            f"pick (see {result.out / 'report.md'}); sweep smaller coefficients",
            err=True,
        )
    if result.unsupported:
        click.echo(f"{result.chance_text()} (see {result.out / 'report.md'})", err=True)


def _library_output(quiet: bool, verbose: bool) -> None:
    """transformers' and lm-eval's bars and logs are quiet under the sweep's own bar (which sets `disable` itself, so
    TQDM_DISABLE leaves it); --verbose lets them through, lm-eval's stderr included (lm_harness.VERBOSE_ENV)."""
    from mergekit_lite.cli.main import QUIET_ENVIRONMENT, quiet_third_party
    from mergekit_lite.evaluate.lm_harness import VERBOSE_ENV

    if quiet and verbose:
        raise InputError("--quiet and --verbose contradict each other: give one")
    if verbose:
        os.environ[VERBOSE_ENV] = "1"  # Ray actors inherit it
        for name in QUIET_ENVIRONMENT:  # asked for: shown, whatever an earlier quiet run left in the environment
            os.environ.pop(name, None)
    else:
        quiet_third_party()  # TQDM_DISABLE too: the library bars that honour it (lm-eval's request bars do not)


def _warn_remote_code(settings) -> None:
    if settings.lm_eval.trusts_remote_code:
        click.echo(
            "warning: --model-args trust_remote_code=True runs the Python code in the model folders (pre, post) "
            "with your permissions; use it only for models whose code you trust",
            err=True,
        )


@contextlib.contextmanager
def _resume_hint(out: str | None):
    """An interrupted sweep keeps every finished point: say that the same command resumes it (a handled SIGTERM is a
    KeyboardInterrupt too), where a run folder is left to resume (one interrupted before its first point is taken
    back)."""
    try:
        yield
    except KeyboardInterrupt:
        if out and os.path.isdir(out):
            click.echo(
                "sweep interrupted: the points finished so far are saved in the run folder; run the same "
                "command again to resume from them",
                err=True,
            )
        raise


def summary(result) -> str:
    """Pre, post and the pick (report split) in a few lines, with how much of the forgetting it recovered."""
    best = result.best
    resumed = len(result.points) + 2 - len(result.evaluated)
    split = (
        "picked on the same docs (--selection none)"
        if result.settings.selection == "none"
        else f"picked on {result.settings.selection_fraction:.0%} of the docs, reported on the rest"
    )
    probe = result.probe
    second = f" {best.second[0]}={best.second[1]!r}" if best.second else ""
    probed = (
        [
            f"probe {len(probe.estimates)} alphas on {probe.samples_probed} of {probe.samples_all} docs each "
            f"(estimates in the report); indistinguishable from the pick by the estimates: "
            f"{', '.join(map(repr, probe.indistinguishable)) or 'none'}"
            + (f"; {probe.separation.text()}" if probe.separation else "")
        ]
        if probe
        else []
    )
    return "\n".join(
        [
            f"pre   old {result.pre.old:.4f}  new {result.pre.new:.4f}",
            f"post  old {result.post.old:.4f}  new {result.post.new:.4f}",
            f"best  alpha={best.alpha!r}{second} ({result.settings.coefficient} of {result.settings.method})  "
            f"old {best.old:.4f}  new {best.new:.4f}  harmonic mean {best.harmonic_mean:.4f}"
            + ("  (unsupported: tasks at chance)" if result.unsupported else ""),
            f"      {split}; indistinguishable from the pick: {', '.join(map(repr, result.indistinguishable)) or 'none'}"
            + (f"; {result.separation.text()}" if result.separation else ""),
            result.outcome_text(),
            *([result.warning_text()] if result.better else []),
            *probed,
            *(
                [
                    f"budget {result.budget['budget']}: cost {result.budget['cost']:.2f} full evaluations, "
                    f"{len(result.budget['rounds'])} probe rounds, {len(result.budget['full'])} points on every doc"
                ]
                if result.budget
                else []
            ),
            *([f"vector: {result.vector['verdict']}"] if result.vector else []),
            f"evaluated {len(result.evaluated)} models, resumed {resumed}; report: {result.out / 'report.md'}",
        ]
    )
