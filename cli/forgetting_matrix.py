"""`forgetting --matrix` and `forgetting --history`: the example-forgetting matrix across fine-tunes of one model,
and the prediction (and replay set) for a new fine-tune from it. Their options are MatrixSettings
(mergekit_lite/evaluate/settings.py); the math is mergekit_lite.evaluate.matrix."""

import json
import os
from pathlib import Path

import click
import numpy as np

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.matrix import (
    build_matrix,
    completion_table,
    forgetting_row,
    format_completion,
    pre_docs,
    pre_seeds,
    predict_row,
    r2_by_rank,
    select_replay,
)
from mergekit_lite.evaluate.matrix_files import prediction_rows, read_history, summary, write_matrix
from mergekit_lite.evaluate.outcomes import Scoring, load_lm_eval_run
from mergekit_lite.evaluate.settings import MatrixSettings
from mergekit_lite.evaluate.trajectory import jsonl, replay_records
from mergekit_lite.io.outputs import atomic_output_dir, check_output_file, check_output_folder, write_atomic


def run_matrix_form(
    inputs,
    options: MatrixSettings,
    scoring: Scoring,
    samples_out,
    replay_out,
    replay_format,
    as_json,
    trajectory_options: list[str],
    html_out=None,
) -> bool:
    """Run the --matrix or --history form if asked (True), else refuse their options given alone (False)."""
    matrix_dir, history_dir = options.matrix_dir, options.history_dir
    if not matrix_dir and not history_dir:
        if options.replay_budget is not None or options.known or options.predictor:
            raise InputError("--replay-budget, --known and --predictor go with --matrix DIR or --history DIR")
        if options.value != "outcome":
            raise InputError("--value goes with --matrix DIR")
        return False
    if matrix_dir and history_dir:
        raise InputError("--matrix builds a history, --history reads one: give one of them")
    if trajectory_options:
        raise InputError(f"{', '.join(trajectory_options)}: not with --matrix or --history")
    if html_out:
        check_output_file(html_out, inputs, suffixes={"html", "htm"})
    if matrix_dir:
        write_history(inputs, options, scoring, matrix_dir, samples_out or replay_out, as_json, html_out)
    else:
        predict_new(inputs, options, scoring, samples_out, replay_out, replay_format, as_json, html_out)
    return True


def write_history(inputs, options, scoring, matrix_dir, other_output, as_json, html_out=None) -> None:
    """PRE POST_1 ... POST_M --matrix DIR."""
    if other_output:
        raise InputError("--samples and --replay go with --history (a prediction), not --matrix")
    if len(inputs) < 4:
        raise InputError(f"--matrix needs PRE and at least 3 fine-tunes of it, got {len(inputs) - 1}")
    known = options.known or (30,)
    if min(known) < 1:
        raise InputError(f"--known must be at least 1, got {min(known)}")
    check_output_folder(matrix_dir, inputs)
    pre = load_lm_eval_run(inputs[0], scoring)
    matrix = build_matrix(pre, lambda path: load_lm_eval_run(path, scoring), inputs[1:], options.value)
    tables = [completion_table(matrix, k, options.matrix_seed) for k in known]
    payload = summary(matrix, r2_by_rank(matrix.z), tables)
    with atomic_output_dir(matrix_dir, inputs=inputs) as folder:
        write_matrix(folder, matrix, payload)
        if html_out:
            from mergekit_lite.evaluate.pages import matrix_page

            page = matrix_page(payload, Path(folder))
    if html_out:
        write_atomic(html_out, page)
        click.echo(f"html: written to {html_out}", err=True)
    if as_json:
        click.echo(json.dumps(payload, indent=2, allow_nan=False))
        return
    click.echo(
        f"matrix: {len(matrix.rows)} fine-tunes x {len(matrix.docs)} docs ({matrix.value}; "
        f"{payload['docs']['forgettable']} can be forgotten; mean {payload['mean']:.4f})"
    )
    click.echo("R^2 by rank: " + ", ".join(f"{rank}: {r2:.3f}" for rank, r2 in enumerate(payload["r2_by_rank"], 1)))
    for table in tables:
        click.echo()
        click.echo(format_completion(table))
    click.echo(f"written: {matrix_dir}", err=True)


def predict_new(inputs, options, scoring, samples_out, replay_out, replay_format, as_json, html_out=None) -> None:
    """PRE NEW --history DIR: NEW's observed docs as logged, the others predicted."""
    if len(inputs) != 2:
        raise InputError(f"--history takes PRE and one new fine-tune, got {len(inputs)} inputs")
    if replay_out and options.replay_budget is None:
        raise InputError("--replay with --history chooses --replay-budget N docs: give the budget")
    if options.replay_budget is not None and not replay_out:
        raise InputError("--replay-budget needs --replay FILE to write the chosen docs to")
    given = (("--samples", samples_out), ("--replay", replay_out), ("--html", html_out))
    outputs = {option: path for option, path in given if path}
    for path in outputs.values():
        check_output_file(path, inputs)
    if len({os.path.realpath(path) for path in outputs.values()}) != len(outputs):
        raise InputError(f"{', '.join(outputs)} must name different files")
    matrix, payload = read_history(options.history_dir)
    pre = load_lm_eval_run(inputs[0], scoring)
    docs, chosen = pre_docs(pre)
    if not docs.same_as(matrix.docs) or not np.array_equal(docs.pre_correct, matrix.docs.pre_correct):
        raise InputError(
            f"--history {options.history_dir}: built on other docs (or another pre) than "
            f"{inputs[0]} ({len(matrix.docs)} docs there, {len(docs)} here)"
        )
    seeds = pre_seeds(pre)
    values, observed = forgetting_row(
        chosen, load_lm_eval_run(inputs[1], scoring), inputs[1], matrix.value, partial=True, pre_seeds=seeds
    )
    tables = payload.get("completion") or [{}]
    method = options.predictor or tables[0].get("best") or "mf"
    prediction = predict_row(matrix, values, observed, method)
    rows = prediction_rows(matrix, prediction, chosen, seeds)
    report = prediction_report(matrix, prediction, values)
    if "--replay" in outputs:
        report["replay"] = write_replay(outputs["--replay"], rows, matrix, prediction, options, replay_format)
    if "--samples" in outputs:
        write_atomic(outputs["--samples"], jsonl(rows))
        click.echo(f"samples: {len(rows)} rows written to {outputs['--samples']}", err=True)
    if "--html" in outputs:
        from mergekit_lite.evaluate.pages import history_page

        write_atomic(outputs["--html"], history_page(report, [dict(row) for row in rows], method))
        click.echo(f"html: written to {outputs['--html']}", err=True)
    if as_json:
        click.echo(json.dumps(report, indent=2, allow_nan=False))
        return
    click.echo(f"predicted by {method}: {report['observed']} docs observed, {report['predicted']} predicted")
    if matrix.binary:
        click.echo(
            f"forgotten: {report['observed_forgotten']} observed, {report['expected_forgotten']:.1f} expected "
            f"among the predicted; predicted F = {report['F_predicted']:.4f} of {report['docs']} docs"
        )
    else:
        click.echo(
            f"mean log-likelihood drop: observed {report['observed_mean_drop']:.4f}, predicted "
            f"{report['predicted_mean_drop']:.4f}"
        )


def prediction_report(matrix, prediction, values) -> dict:
    """The counts the prediction prints: observed and predicted docs, and what they forget."""
    observed, predicted = prediction.observed, ~prediction.observed
    report = {"method": prediction.method, "value": matrix.value, "docs": len(matrix.docs), **prediction.counts}
    if matrix.binary:
        report.update(
            observed_forgotten=int(values[observed].sum()),
            expected_forgotten=float(prediction.scores[predicted].sum()),
            F_predicted=float(prediction.scores.mean()),
        )
    else:
        report.update(
            observed_mean_drop=float(values[observed].mean()) if observed.any() else None,
            predicted_mean_drop=float(prediction.scores[predicted].mean()) if predicted.any() else None,
        )
    return report


def write_replay(path, rows, matrix, prediction, options, replay_format) -> dict:
    """--replay-budget docs of those that can be forgotten and have a prompt and gold answer in PRE's log, drawn
    by --replay-strategy from their scores (observed forgotten docs included), as TRL JSONL."""
    candidates = [
        index
        for index, row in enumerate(rows)
        if matrix.forgettable[index] and row["prompt"] is not None and row["completion"] is not None
    ]
    scores = prediction.scores[candidates]
    selection = select_replay(
        scores,
        options.replay_budget,
        options.replay_strategy,
        options.replay_temperature,
        options.matrix_seed,
    )
    chosen = [rows[candidates[index]] for index in selection.chosen]
    records, _ = replay_records(chosen, replay_format, chosen=lambda row: True)
    write_atomic(path, jsonl(records))
    observed = sum(not row["predicted"] for row in chosen)
    click.echo(
        f"replay: {len(records)} docs of {len(candidates)} candidates chosen by {options.replay_strategy} "
        f"(T={options.replay_temperature:g}; {observed} observed) written to {path}",
        err=True,
    )
    return {
        "written": len(records),
        "candidates": len(candidates),
        "strategy": options.replay_strategy,
        "temperature": options.replay_temperature,
        "observed": observed,
        "mean_score": float(scores[selection.chosen].mean()),
    }
