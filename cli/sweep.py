"""`mergekit-lite sweep`: merge pre and post at every alpha of a grid, score old and new skills, pick the best."""

import contextlib
import os

import click

from mergekit_lite.cli.types import SEED, Number
from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.trajectory import REPLAY_FORMATS
from mergekit_lite.merge.methods import SWEEPABLE

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


def _flag_values(data: dict, **flags) -> dict:
    """Flags the user gave (None / empty means not given) override the config file's values."""
    return {**data, **{name: value for name, value in flags.items() if value not in (None, ())}}


@click.command(epilog=EXAMPLES)
@click.argument("config_file", required=False, type=click.Path(dir_okay=False))
@click.option("--pre", help="Base (pre-trained) model folder: the reference for every forgetting comparison.")
@click.option(
    "--post",
    help="Post-trained model folder (same architecture as --pre), or a LoRA adapter trained on pre (audited first).",
)
@click.option(
    "--method",
    "-m",
    help=f"Merge method (default linear; one of {', '.join(SWEEPABLE)}), see alpha "
    "below; several, comma-separated, compare them in one run (pre and post evaluated once).",
)
@click.option("--baseline", help="With several methods: the one each is compared with (default linear).")
@click.option("--alphas", help="Grid: START:STOP:STEP (STOP included) or a comma list, e.g. 0:1:0.1 or 0,0.3,0.5.")
@click.option("--old-tasks", multiple=True, help="lm-eval tasks of what pre could do; comma list or repeated.")
@click.option("--new-tasks", multiple=True, help="lm-eval tasks of what post-training taught; comma list or repeated.")
@click.option("--include-path", type=click.Path(exists=True, file_okay=False), help="Folder of local task YAMLs.")
@click.option(
    "--limit",
    type=Number(0, min_open=True),
    help="Docs per task, or a share of each task's docs below 1 (e.g. 0.1), as lm-eval's --limit (default: all).",
)
@click.option(
    "--num-fewshot",
    type=click.IntRange(min=0),
    help="Few-shot demonstrations per prompt, as lm-eval's --num_fewshot (default: the task's own).",
)
@click.option(
    "--apply-chat-template",
    is_flag=False,
    flag_value="default",
    default=None,
    metavar="[TEMPLATE]",
    help="Build prompts with the tokenizer's chat template (TEMPLATE: one of its named templates), as "
    "lm-eval's --apply_chat_template; pre's tokenizer, with post's template when pre has none.",
)
@click.option(
    "--fewshot-as-multiturn/--no-fewshot-as-multiturn",
    default=None,
    help="Few-shot demonstrations as chat turns (default: on with --apply-chat-template, as lm-eval).",
)
@click.option(
    "--system-instruction",
    metavar="TEXT",
    help="System instruction before every prompt, as lm-eval's --system_instruction.",
)
@click.option(
    "--gen-kwargs",
    metavar="NAME=VALUE,...",
    help="Generation arguments of generative tasks, as lm-eval's --gen_kwargs (e.g. temperature=0,max_gen_toks=256).",
)
@click.option(
    "--model-args",
    metavar="NAME=VALUE,...",
    help="Model arguments as lm-eval's --model_args takes them: "
    "max_length, truncation, add_bos_token, attn_implementation, trust_remote_code (runs the model "
    "folder's code), ... (hf backend).",
)
@click.option("--batch-size", type=click.IntRange(min=1), help="Evaluation batch size (default 16).")
@click.option("--device", help="Where models run: cpu (default), cuda, cuda:N.")
@click.option("--out", "-o", type=click.Path(file_okay=False), help="Run folder (created; reused to resume).")
@click.option("--density", type=Number(), help="ties: share of the task vector kept by magnitude, in (0, 1].")
@click.option("--drop", type=Number(), help="dare_*: drop probability of task-vector entries, in [0, 1).")
@click.option(
    "--beta",
    type=Number(),
    help="lines: the task vector's scale rises by beta from the first layer to the last (default 1 - alpha).",
)
@click.option("--betas", help="lines: a 2-D grid, alpha x beta (values as --alphas).")
@click.option(
    "--densities", help="ties, della, breadcrumbs, dare_*: a 2-D grid, lambda x density (values as --alphas)."
)
@click.option("--drops", help="dare_*: a 2-D grid, lambda x drop (values as --alphas).")
@click.option(
    "--budget",
    type=click.IntRange(min=3),
    help="At most N full evaluations' worth of docs (pre and post "
    "count 1 each, a probe its share of the docs): successive halving on probe docs, then the survivors "
    "on every doc (see the README).",
)
# a vector of coefficients (sweep.vector): per layer group and/or module type, searched with Optuna
@click.option(
    "--groups",
    type=click.IntRange(min=1),
    help="Also search one coefficient per group of N contiguous decoder layers (embeddings with the first group, "
    "the final norm and head with the last) against the scalar pick, on the selection split (docs/sweep.md).",
)
@click.option(
    "--modules",
    help="Also search one coefficient per module type (comma list: attn, mlp, norm, q, k, v, o, gate, up, down, "
    "...; the rest of the tensors share one more), alone or with --groups.",
)
@click.option(
    "--vector-search",
    type=click.Choice(["tpe", "cmaes", "revert"]),
    help="How --groups/--modules search: Optuna's TPE (default) or CMA-ES, or revert (each slot pre's or the "
    "scalar pick's).",
)
@click.option("--trials", type=click.IntRange(min=1), help="Vectors the search scores on every doc (default 24).")
@click.option(
    "--vector-start",
    type=click.Choice(["scalar", "drift"]),
    help="The search's first trials: the scalar pick's vector (default), and with drift one from post's drift.",
)
@click.option(
    "--vector-prune",
    type=click.FloatRange(min=0, min_open=True, max=1),
    help="Cheap-first trials: each vector scored first on probe docs (this share of the agreeing selection docs), "
    "and Optuna's median pruner stops one clearly worse before its full evaluation.",
)
@click.option(
    "--trial-batch",
    type=click.IntRange(min=1),
    help="Vectors asked of Optuna at once, scored in parallel with --ray (default 1; with --ray the actors Ray "
    "fits). The same batch gives the same vector with or without Ray.",
)
@click.option("--seed", type=SEED, help="Seed of DARE's drop and RECALL's sample choice (default 0).")
@click.option("--recall-texts", type=click.Path(dir_okay=False), help="recall: typical texts, one per line.")
@click.option("--recall-samples", type=click.IntRange(min=1), help="recall: how many typical samples (default 8).")
@click.option("--save-best", type=click.Path(file_okay=False), help="Write the picked merge to this new model folder.")
@click.option(
    "--stream",
    is_flag=True,
    default=None,
    help="Always merge through a folder on disk (default: in memory when 3x the model fits in free RAM).",
)
@click.option(
    "--copy-files-from",
    help="--save-best: model folder whose config/tokenizer files are copied "
    "(default: pre's, with post's chat template and generation config when pre has none).",
)
@click.option("--eval-dtype", help="dtype models are evaluated in: fp32 (default on CPU), bf16 (default on GPU), fp16.")
@click.option(
    "--metric", multiple=True, metavar="[TASK=]METRIC", help="0/1 metric to score by (default: the task's first)."
)
@click.option(
    "--filter",
    "filter_",
    multiple=True,
    metavar="[TASK=]FILTER",
    help="lm-eval filter to score (default: the first the task logs), e.g. gsm8k=flexible-extract.",
)
@click.option("--choices", multiple=True, metavar="TASK=K", help="Options of a generative multiple-choice task.")
@click.option("--aggregation", type=click.Choice(("paper", "pooled")), help="Group scores (default paper).")
@click.option(
    "--selection",
    type=click.Choice(("docs", "none")),
    help="docs (default): pick alpha on a seeded doc_hash split, report on the rest; none: same docs.",
)
@click.option(
    "--selection-fraction",
    type=Number(0, 1, min_open=True, max_open=True),
    help="Share of each task's docs that picks alpha (default 0.5).",
)
@click.option(
    "--bootstrap", type=click.IntRange(min=0), help="Bootstrap resamples for intervals (default 1000; 0: none)."
)
@click.option(
    "--confidence", type=Number(0, 1, min_open=True, max_open=True), help="Interval confidence (default 0.95)."
)
@click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="local",
    default=None,
    metavar="[ADDRESS]",
    help="Evaluate points in parallel as Ray actors (one per GPU on cuda, else per CPU): alone, a local "
    "Ray cluster; with ADDRESS (e.g. auto, ray://head:10001), that cluster. Needs mergekit-lite[ray].",
)
@click.option(
    "--search",
    type=click.Choice(("grid", "golden")),
    help="grid (default): every alpha; golden: golden-section search for the best harmonic mean over the "
    "grid, stopping once the points left are indistinguishable (fewer evaluations).",
)
@click.option(
    "--backend",
    type=click.Choice(("hf", "vllm")),
    help="hf (default): the model in memory; vllm: lm-eval's vLLM backend on each merge written to a "
    "scratch folder (GPU; needs vllm installed).",
)
@click.option(
    "--vllm-args",
    metavar="NAME=VALUE,...",
    help="vLLM model args: tensor_parallel_size, data_parallel_size, gpu_memory_utilization, "
    "max_model_len, dtype, batch_size, seed.",
)
@click.option(
    "--probe",
    type=Number(0, 1, min_open=True),
    help="Probe mode: score each alpha only on the selection docs where pre and post disagree plus this "
    "share of the others (seeded), estimate its scores with standard errors, then score the pick on "
    "every doc (e.g. 0.1; default: every doc at every alpha).",
)
@click.option(
    "--realign-shots",
    type=int,
    metavar="K",
    help="After pre and post, score post again with K demonstrations (lm-eval's few-shot docs) on the docs "
    "it forgot, and split the forgetting into spurious (K shots bring it back) and genuine.",
)
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
@click.option("--quiet", "-q", is_flag=True, help="No sweep progress bar (and fewer library bars).")
def sweep(
    config_file,
    pre,
    post,
    method,
    baseline,
    alphas,
    old_tasks,
    new_tasks,
    include_path,
    limit,
    batch_size,
    device,
    out,
    density,
    drop,
    seed,
    recall_texts,
    recall_samples,
    save_best,
    stream,
    metric,
    filter_,
    choices,
    aggregation,
    selection,
    selection_fraction,
    bootstrap,
    confidence,
    ray_address,
    search,
    copy_files_from,
    eval_dtype,
    backend,
    vllm_args,
    probe,
    quiet,
    beta,
    betas,
    densities,
    drops,
    budget,
    replay_out,
    replay_format,
    replay_all,
    num_fewshot,
    apply_chat_template,
    fewshot_as_multiturn,
    system_instruction,
    gen_kwargs,
    model_args,
    require_verified,
    realign_shots,
    groups,
    modules,
    vector_search,
    trials,
    vector_start,
    vector_prune,
    trial_batch,
):
    """Sweep the merge coefficient alpha between PRE and POST, evaluate old and new skills at every
    alpha (plus pre and post themselves), map sample-level forgetting against pre, and pick the
    alpha with the best harmonic mean. Settings come from flags or a YAML CONFIG_FILE with the
    same keys (flags win); see examples/sweep.yaml.
    """
    from mergekit_lite.audits.report import each_verdict_once
    from mergekit_lite.sweep import load_sweep_file, run_sweep, settings_from_dict
    from mergekit_lite.sweep.samples import check_replay, write_replay

    if quiet:
        from mergekit_lite.cli.main import quiet_third_party

        quiet_third_party()  # TQDM_DISABLE too: the library bars that honour it (lm-eval's request bars do not)
    data = {"method": "linear", **(load_sweep_file(config_file) if config_file else {})}
    data = _flag_values(
        data,
        pre=pre,
        post=post,
        method=method,
        alphas=alphas,
        old_tasks=old_tasks,
        new_tasks=new_tasks,
        include_path=include_path,
        limit=limit,
        batch_size=batch_size,
        device=device,
        out=out,
        density=density,
        drop=drop,
        seed=seed,
        recall_texts=recall_texts,
        recall_samples=recall_samples,
        save_best=save_best,
        stream=stream,
        metric=metric,
        filter=filter_,
        choices=choices,
        aggregation=aggregation,
        selection=selection,
        selection_fraction=selection_fraction,
        bootstrap=bootstrap,
        confidence=confidence,
        ray=ray_address,
        search=search,
        copy_files_from=copy_files_from,
        eval_dtype=eval_dtype,
        backend=backend,
        vllm_args=vllm_args,
        probe=probe,
        beta=beta,
        betas=betas,
        densities=densities,
        drops=drops,
        budget=budget,
        num_fewshot=num_fewshot,
        apply_chat_template=True if apply_chat_template == "default" else apply_chat_template,
        fewshot_as_multiturn=fewshot_as_multiturn,
        system_instruction=system_instruction,
        gen_kwargs=gen_kwargs,
        model_args=model_args,
        realign_shots=realign_shots,
        groups=groups,
        modules=modules,
        vector_search=vector_search,
        trials=trials,
        vector_start=vector_start,
        vector_prune=vector_prune,
        trial_batch=trial_batch,
    )
    listed = data.pop("methods", None)
    methods = listed if listed and not method else [name.strip() for name in data["method"].split(",") if name.strip()]
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
            _warn_nonfinite(result)
        return
    settings = settings_from_dict(data)
    if replay_out:
        check_replay(replay_out, settings)
    _warn_remote_code(settings)
    with _resume_hint(settings.out), each_verdict_once():  # a sweep audits its adapter at each point: one line
        result = run_sweep(settings, progress=not quiet)
    click.echo(summary(result))
    _warn_nonfinite(result)
    if settings.save_best:
        click.echo(f"saved the pick ({result.best.label}) as a model folder: {settings.save_best}")
    if replay_out:
        written, left_out = write_replay(result, replay_out, replay_format, replay_all)
        which = "forgotten by post" if replay_all else "still lost by the pick"
        click.echo(
            f"replay: {written} docs {which} written to {replay_out}; {left_out} left out (no prompt or gold "
            "answer in the point files)",
            err=True,
        )


def _warn_nonfinite(result) -> None:
    """A model that gave NaN or infinite logits is marked in results.json and report.md; say so here too, where the
    command ends with exit 0 and a pick."""
    broken = [point.label for point in (result.pre, result.post, *result.points) if point.nonfinite]
    if broken:
        shown = ", ".join(broken[:5]) + (", ..." if len(broken) > 5 else "")
        click.echo(
            f"warning: {len(broken)} model(s) gave NaN or infinite logits ({shown}): their scores are noise, never the "
            f"pick (see {result.out / 'report.md'}); sweep smaller coefficients",
            err=True,
        )


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
        ]
        if probe
        else []
    )
    return "\n".join(
        [
            f"pre   old {result.pre.old:.4f}  new {result.pre.new:.4f}",
            f"post  old {result.post.old:.4f}  new {result.post.new:.4f}",
            f"best  alpha={best.alpha!r}{second} ({result.settings.coefficient} of {result.settings.method})  "
            f"old {best.old:.4f}  new {best.new:.4f}  harmonic mean {best.harmonic_mean:.4f}",
            f"      {split}; indistinguishable from the pick: {', '.join(map(repr, result.indistinguishable)) or 'none'}",
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
