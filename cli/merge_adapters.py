"""`mergekit-lite merge-adapters`: several LoRA adapters into one PEFT adapter, with PEFT's combination types."""

import click

from mergekit_lite.cli.options import QUIET, settings_options
from mergekit_lite.cli.types import SafeSuggestions
from mergekit_lite.merge.lora_settings import AdapterMergeSettings

EXAMPLES = """
\b
Examples:
  # exact: the factors side by side (rank = sum of the ranks)
  mergekit-lite merge-adapters math-lora/ code-lora/ --weights 0.7,0.3 --combination cat --out mix-lora/
\b
  # the best rank-16 adapter of the weighted sum, SVDs on the GPU
  mergekit-lite merge-adapters a/ b/ c/ --weights 1,1,-0.5 --combination svd --rank 16 --device cuda --out mix/
"""


@click.command(cls=SafeSuggestions, epilog=EXAMPLES)
@click.argument("adapters", nargs=-1, required=True)
@settings_options(AdapterMergeSettings)
@click.option("--base", help="Base model (folder or hub id); default: the one the adapters declare.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Adapter folder to write (atomically).")
@click.option("--force", is_flag=True, help="Merge adapters the audit REJECTED (not unreadable or misfitting ones).")
@click.option("--require-verified", is_flag=True, help="Merge only adapters whose audit is VERIFIED (exit 1 if not).")
@click.option("--allow-pickle", is_flag=True, help="Read adapter_model.bin pickles (weights_only=True).")
@click.option("--overwrite", is_flag=True, help="Replace an output folder this tool wrote.")
@QUIET
def merge_adapters(adapters, settings, base, out, force, require_verified, allow_pickle, overwrite, quiet):
    """Merge LoRA adapters into one LoRA adapter (PEFT format), each audited first.

    The base comes from the adapters' adapter_config.json (or --base); adapters on different bases are refused.
    Every adapter's scaling (rsLoRA, lora_alpha, rank patterns) is carried into the factors and the written
    adapter has scaling 1, so PEFT applies what was computed. The relative error against the dense truth
    (base + sum of weight * each adapter's merged update) is printed.
    """
    from mergekit_lite.audited import merge_adapters as run
    from mergekit_lite.devices import usable_device

    settings = settings.model_copy(update={"device": str(usable_device(settings.device))})
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
        f"wrote {out}: {result.modules} modules, rank <= {result.rank}, {settings.combination} ({kind}); relative error "
        f"against the weighted sum of the adapters' updates {result.error:.3g}{floor}"
    )
    if result.dora:
        click.echo(f"DoRA adapters folded against the base: {', '.join(result.dora)}", err=True)
