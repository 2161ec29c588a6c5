"""`mergekit-lite merge`: flags or a YAML config in, a merged model folder out."""

import click

from mergekit_lite.cli import method_flags
from mergekit_lite.cli.mergekit_flags import MergekitFlags, mergekit_options
from mergekit_lite.cli.types import SafeSuggestions
from mergekit_lite.errors import InputError
from mergekit_lite.io.checkpoints import in_training_order
from mergekit_lite.merge import methods
from mergekit_lite.merge.config import DTYPES, OUT_QUANTS

EXAMPLES = """
\b
Examples:
  # LERP: 30% of the way from pre to post
  mergekit-lite merge --method linear --base pre/ --model post/ --alpha 0.3 --out merged/
\b
  # TIES over two fine-tunes, keep 50% of each task vector, bf16 shards of 2GB
  mergekit-lite merge --method ties --base pre/ --model a/:1 --model b/:0.5 \\
      --density 0.5 --dtype bf16 --out-shard-size 2GB --out merged/
\b
  # subtract a task vector (negative coefficient), preview without writing
  mergekit-lite merge --method task_arithmetic --base pre/ --model toxic/:-1 --out m/ --dry-run
\b
  # LiNeS: the task vector scaled from 0.3 in the first layer to 1.0 in the last
  mergekit-lite merge --method lines --base pre/ --model post/ --alpha 0.3 --beta 0.7 --out merged/
  # EMA of a training run's checkpoints (their checkpoint-N names give the order only with --order step)
  mergekit-lite merge --method ema --decay 0.9 --model run/checkpoint-500 --model run/checkpoint-1000 \\
      --model run/checkpoint-1500 --out ema/
  mergekit-lite merge --method ema --decay 0.9 --model run/ --order step --out ema/
\b
  # a YAML config (see examples/), flags override its values
  mergekit-lite merge examples/ties.yaml merged/
\b
  # a mergekit-yaml command line: only the program name changes (docs/mergekit.md)
  mergekit-lite merge config.yml ./out --cuda --copy-tokenizer --allow-crimes --out-shard-size 1B
"""


def _model_option(value: str) -> dict:
    """PATH or PATH:WEIGHT (the suffix counts as a weight only when it parses as a number)."""
    path, _, suffix = value.rpartition(":")
    try:
        return {"model": path, "weight": float(suffix)} if path else {"model": value}
    except ValueError:
        return {"model": value}


def _output_folder(out_path: str | None, out: str | None) -> str:
    """OUT_PATH (mergekit-yaml's second argument) or --out: one of them."""
    if out_path and out and out_path != out:
        raise click.UsageError(f"two output folders: OUT_PATH {out_path!r} and --out {out!r} (give one)")
    if not (out_path or out):
        raise click.UsageError("give the output folder: CONFIG_FILE OUT_PATH, or --out")
    return out_path or out


def _seed(seed: int | None, random_seed: int | None) -> int | None:
    """--seed, or mergekit's name for it, --random-seed."""
    if seed is not None and random_seed is not None and seed != random_seed:
        raise click.UsageError(f"--seed {seed} and --random-seed {random_seed} name two seeds (give one)")
    return random_seed if random_seed is not None else seed


# The command's own options (what is no method parameter): its inputs first, then the run's options; the method
# flags sit between them (cli/method_flags.py, generated from the registry), mergekit's after them
INPUTS = (
    click.argument("config_file", required=False, type=click.Path(dir_okay=False)),
    click.argument("out_path", required=False, type=click.Path(file_okay=False)),
    click.option(
        "--out",
        "-o",
        type=click.Path(file_okay=False),
        help="Output model folder (written atomically); or give it as OUT_PATH after the CONFIG_FILE.",
    ),
    click.option(
        "--base", "--pre", "base", help="Base (pre-trained) model: the start of LERP/SLERP, the origin of task vectors."
    ),
    click.option(
        "--model",
        "models",
        multiple=True,
        metavar="PATH[:WEIGHT]",
        help="A model folder, .safetensors file or LoRA adapter folder; repeat for several.",
    ),
)
RUN_OPTIONS = (
    click.option(
        "--order",
        type=click.Choice(["step"]),
        help="ema: take a folder of checkpoint-N subfolders in the order "
        "of N (without it such a folder is refused: its order is not given).",
    ),
    click.option("--recall-texts", type=click.Path(dir_okay=False), help="recall: typical samples, one per line."),
    click.option("--recall-samples", type=int, help="recall: how many typical samples k-means picks (default 8)."),
    click.option(
        "--embed-rule",
        type=click.Choice(["nearest", "average", "base", "reference"]),
        help="recall: weights for embeddings and head (default nearest layer).",
    ),
    click.option("--seed", type=int, help="Seed for DARE's random drop (default 0): same seed, same bytes."),
    click.option(
        "--dtype", type=click.Choice(sorted(DTYPES)), help="Stored dtype (default: the base's). Math is float32."
    ),
    click.option(
        "--out-quant",
        type=click.Choice(OUT_QUANTS),
        help="Write the merge re-quantized to its FP8 input's block scheme (default: dense, quantization_config "
        "dropped).",
    ),
    click.option("--copy-files-from", help="Model folder whose config/tokenizer files are copied (default: the base)."),
    click.option(
        "--tokenizer-source",
        help="Output vocabulary when the inputs' differ: base, union or a model (rows aligned by token).",
    ),
    click.option(
        "--mergekit-compat/--no-mergekit-compat",
        default=None,
        help="mergekit's defaults and rules (the default for mergekit-format configs).",
    ),
    click.option("--skip", multiple=True, help="Copy tensors whose name contains this text from the base unchanged."),
    click.option(
        "--device",
        type=str,
        help="Where the math runs: cpu (default), cuda, cuda:N, or auto (cuda where there is one). I/O stays on the CPU.",
    ),
    click.option(
        "--allow-pickle", is_flag=True, default=None, help="Accept pickle .bin weights (unsafe for untrusted files)."
    ),
    click.option(
        "--allow-nonfinite", is_flag=True, default=None, help="Merge inputs that contain NaN/Inf instead of stopping."
    ),
    click.option("--force", is_flag=True, default=None, help="Merge LoRA adapters even if their audit REJECTS them."),
    click.option(
        "--require-verified",
        is_flag=True,
        help="Merge LoRA adapters only when their audit VERIFIES them: a WARN "
        "stops the merge too (exit 1). Each adapter's verdict is printed on stderr either way.",
    ),
    click.option("--overwrite", is_flag=True, help="Replace an existing output folder."),
    click.option(
        "--dry-run",
        is_flag=True,
        help="Print the plan (tensors, shapes, bytes, parameters) and its estimated wall "
        "time and peak memory on this machine, and write no output (the first one measures this machine's "
        "rates in a few seconds and caches them in ~/.cache/mergekit-lite/rates.json).",
    ),
    click.option("--calibrate", is_flag=True, help="With --dry-run: measure this machine's rates again."),
    click.option("--quiet", "-q", is_flag=True, help="No progress bar."),
)

ABOUT = """Merge checkpoints tensor by tensor, never holding a whole model in memory.

Give either a YAML CONFIG_FILE (ours or mergekit's) or flags; flags win where both say something. Each method
parameter is a flag (--alpha, --density, ...; a model's weight is --model PATH:WEIGHT) and a config key under
parameters: alike, with the bounds and defaults its method declares. mergekit-yaml's flags work with mergekit's meaning (docs/mergekit.md).
"""


def merge_command() -> click.Command:
    """`merge` as the method registry stands: the command's own options, a flag per method parameter
    (cli/method_flags.py) and mergekit's shared flags; `--help` lists the methods and what each takes."""
    flagged = tuple(method_flags.flagged_parameters(methods.REGISTRY))

    def merge(**given):
        _merge(parameters={name: given.pop(name) for name in flagged}, **given)

    method = click.option(
        "--method", "-m", type=click.Choice(tuple(methods.REGISTRY)), help="Merge method (see the list above)."
    )
    options = (*INPUTS[:3], method, *INPUTS[3:], *method_flags.method_options(methods.REGISTRY), *RUN_OPTIONS)
    merge = mergekit_options(merge)  # the first applied is the last listed in --help
    for option in reversed(options):
        merge = option(merge)
    help_text = f"{ABOUT}\n{method_flags.methods_help(methods.REGISTRY)}"
    return click.command("merge", cls=SafeSuggestions, help=help_text, epilog=EXAMPLES)(merge)


def _merge(
    config_file,
    out_path,
    out,
    method,
    base,
    models,
    parameters,
    order,
    recall_texts,
    recall_samples,
    embed_rule,
    seed,
    dtype,
    out_quant,
    copy_files_from,
    tokenizer_source,
    mergekit_compat,
    skip,
    device,
    allow_pickle,
    allow_nonfinite,
    force,
    require_verified,
    overwrite,
    dry_run,
    calibrate,
    quiet,
    **mergekit,
):
    """The merge the flags describe: `parameters` are the method flags' values by parameter name (None where
    not given), `mergekit` mergekit's shared flags (cli/mergekit_flags.py)."""
    from mergekit_lite.io.outputs import check_free_space, check_output_folder
    from mergekit_lite.merge.schema import config_from_dict, load_config

    flags = MergekitFlags(**mergekit)
    flags.refusals()
    out = _output_folder(out_path, out)
    seed = _seed(seed, flags.random_seed)
    device = flags.device(device)
    out_shard_size = flags.out_shard_size
    data = load_config(config_file).to_dict() if config_file else {"parameters": {}, "recall": {}}
    data["parameters"].update({k: v for k, v in parameters.items() if v is not None})
    recall = {"texts": recall_texts, "samples": recall_samples, "embed_rule": embed_rule}
    data["recall"].update({k: v for k, v in recall.items() if v is not None})
    options = {
        "method": method,
        "base": base,
        "seed": seed,
        "dtype": dtype,
        "out_quant": out_quant,
        "out_shard_size": out_shard_size,
        "copy_files_from": copy_files_from,
        "device": device,
        "mergekit_compat": mergekit_compat,
        "allow_pickle": allow_pickle,
        "allow_nonfinite": allow_nonfinite,
        "force": force,
    }
    data.update({k: v for k, v in options.items() if v is not None})
    if tokenizer_source:
        data["tokenizer"] = {
            "source": tokenizer_source,
            "pad_to_multiple_of": (data.get("tokenizer") or {}).get("pad_to_multiple_of"),
        }
    if models:
        data["models"] = [_model_option(value) for value in models]
    if skip:
        data["skip"] = list(skip)
    if "method" not in data:
        raise click.UsageError("give --method or a CONFIG_FILE")
    if calibrate and not dry_run:
        raise click.UsageError("--calibrate goes with --dry-run")
    given = [entry["model"] for entry in data.get("models") or []]  # a run folder among them is read too
    if methods.method(data["method"]).orders_checkpoints:
        paths = in_training_order(given, order)
        data["models"] = [{"model": path} for path in paths]
    elif order:
        raise InputError("--order applies to --method ema (checkpoints in training order)")
    config = config_from_dict(data)
    for note in flags.notes():
        click.echo(note, err=True)
    flags.apply()
    config.resolve_references()
    if not dry_run:
        check_output_folder(out, [*config.read_paths, *given], overwrite)
    # torch loads only now, once the arguments, the config and the paths are known to be usable
    from mergekit_lite.audited import run_merge
    from mergekit_lite.merge.plan import plan_merge

    if dry_run:
        from mergekit_lite.merge import cost

        with plan_merge(config) as plan:
            click.echo(plan.describe())
            click.echo(check_free_space(out, plan.total_bytes, refuse=False).describe())
            rates, where = cost.load_rates(
                refresh=calibrate, say=lambda line: click.echo(line, err=True), methods=[config.method]
            )
            click.echo(cost.estimate(plan, rates).describe(where))
        return
    if quiet:
        from mergekit_lite.cli.main import quiet_third_party

        quiet_third_party()
    result = run_merge(
        config,
        out,
        overwrite=overwrite,
        progress=not quiet,
        copy_tokenizer=flags.copy_tokenizer,
        model_card=flags.write_model_card,
        require_verified=require_verified,
    )
    if not quiet:
        click.echo(
            f"wrote {result.out} ({result.plan.total_bytes / 1e6:.1f} MB, {len(result.plan.steps)} tensors, "
            f"{result.seconds:.1f} s)"
        )
        for note in result.plan.notes:
            click.echo(f"note: {note}")


merge = merge_command()
