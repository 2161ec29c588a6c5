"""`mergekit-lite merge-adapters`: several LoRA adapters into one PEFT adapter, with PEFT's combination types."""

import click

from mergekit_lite.cli.types import Number, SafeSuggestions

COMBINATIONS = (
    "svd",
    "linear",
    "cat",
    "ties",
    "ties_svd",
    "dare_linear",
    "dare_ties",
    "dare_linear_svd",
    "dare_ties_svd",
    "magnitude_prune",
    "magnitude_prune_svd",
)

EXAMPLES = """
\b
Examples:
  # exact: the factors side by side (rank = sum of the ranks)
  mergekit-lite merge-adapters math-lora/ code-lora/ --weights 0.7,0.3 --combination cat --out mix-lora/
\b
  # the best rank-16 adapter of the weighted sum, SVDs on the GPU
  mergekit-lite merge-adapters a/ b/ c/ --weights 1,1,-0.5 --combination svd --rank 16 --device cuda --out mix/
"""


def parse_weights(text: str) -> tuple[float, ...]:
    """`0.7,0.3` -> (0.7, 0.3); each a finite number."""
    import math

    from mergekit_lite.errors import InputError

    try:
        weights = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise InputError(f"--weights {text}: not a comma-separated list of numbers") from None
    if not all(math.isfinite(weight) for weight in weights):
        raise InputError(f"--weights {text}: every weight must be a finite number")
    return weights


@click.command(cls=SafeSuggestions, epilog=EXAMPLES)
@click.argument("adapters", nargs=-1, required=True)
# merge-adapters flags
@click.option("--weights", required=True, help="One weight per adapter, comma-separated (negative subtracts).")
@click.option(
    "--combination",
    type=click.Choice(COMBINATIONS),
    default="svd",
    show_default=True,
    help="PEFT's add_weighted_adapter type: cat is exact; svd types give the rank-K optimum of the combined "
    "update; linear/ties/dare_*/magnitude_prune combine the factors themselves (approximate). See docs/methods.md.",
)
@click.option("--rank", type=int, help="Output rank of the svd types (default: the largest input rank).")
@click.option(
    "--density", type=Number(min=0, max=1), help="Share of entries kept by ties, dare_* and magnitude_prune types."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of DARE's random drops.")
@click.option("--base", help="Base model (folder or hub id); default: the one the adapters declare.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Adapter folder to write (atomically).")
@click.option("--device", help="Where the SVDs run: cpu (default), cuda, cuda:N or auto.")
@click.option("--force", is_flag=True, help="Merge adapters the audit REJECTED (not unreadable or misfitting ones).")
@click.option("--require-verified", is_flag=True, help="Merge only adapters whose audit is VERIFIED (exit 1 if not).")
@click.option("--allow-pickle", is_flag=True, help="Read adapter_model.bin pickles (weights_only=True).")
@click.option("--overwrite", is_flag=True, help="Replace an output folder this tool wrote.")
@click.option("--quiet", "-q", is_flag=True, help="No loading bars or logs from the libraries on stderr.")
def merge_adapters(
    adapters,
    weights,
    combination,
    rank,
    density,
    seed,
    base,
    out,
    device,
    force,
    require_verified,
    allow_pickle,
    overwrite,
    quiet,
):
    """Merge LoRA adapters into one LoRA adapter (PEFT format), each audited first.

    The base comes from the adapters' adapter_config.json (or --base); adapters on different bases are refused.
    Every adapter's scaling (rsLoRA, lora_alpha, rank patterns) is carried into the factors and the written
    adapter has scaling 1, so PEFT applies what was computed. The relative error against the dense truth
    (base + sum of weight * each adapter's merged update) is printed.
    """
    from mergekit_lite.audited import merge_adapters as run
    from mergekit_lite.devices import usable_device
    from mergekit_lite.merge.adapters import AdapterMergeSettings

    settings = AdapterMergeSettings(
        combination, parse_weights(weights), rank, density, seed, str(usable_device(device or "cpu"))
    )
    result = run(
        list(adapters),
        out,
        settings,
        base=base,
        force=force,
        allow_pickle=allow_pickle,
        overwrite=overwrite,
        require_verified=require_verified,
    )
    kind = "exact" if result.exact else "approximate"
    floor = f" (best rank-{result.rank} error {result.best_error:.3g})" if result.best_error is not None else ""
    click.echo(
        f"wrote {out}: {result.modules} modules, rank <= {result.rank}, {combination} ({kind}); relative error "
        f"against the weighted sum of the adapters' updates {result.error:.3g}{floor}"
    )
    if result.dora:
        click.echo(f"DoRA adapters folded against the base: {', '.join(result.dora)}", err=True)
