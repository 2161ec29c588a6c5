"""`mergekit-lite extract`: a LoRA adapter (PEFT format) from a base and its fine-tune, streamed."""

import click

from mergekit_lite.cli.mergekit_flags import MergekitFlags, mergekit_options
from mergekit_lite.cli.options import QUIET, settings_options
from mergekit_lite.cli.types import SafeSuggestions, flag_name
from mergekit_lite.merge.lora_settings import ExtractSettings

# mergekit's shared flags that have no part in an extraction: a note when given (mergekit reads them and does nothing)
NOT_EXTRACTION = {
    "out_shard_size": "the adapter is one file, as mergekit-extract-lora writes it",
    "copy_tokenizer": "an adapter carries no tokenizer, as mergekit-extract-lora's",
    "random_seed": "an SVD draws nothing at random",
}

EXAMPLES = """
\b
Examples:
  # rank-16 adapter of post/ over pre/ (linear layers factored, changed norms/embeddings stored whole)
  mergekit-lite extract --base pre/ --model post/ --rank 16 --out post-lora/
\b
  # mergekit-extract-lora's flags work as they are
  mergekit-lite extract --base-model pre/ --model post/ --out-path post-lora/ --max-rank 32 -e lm_head
\b
  # rank by singular values above 0.01 (at most 64), embeddings and head factored too
  mergekit-lite extract --base-model pre/ --model post/ --out-path lora/ --max-rank 64 --sv-epsilon 0.01 --embed-lora
"""


@click.command(cls=SafeSuggestions, epilog=EXAMPLES)
@click.option("--base", "--base-model", "base", required=True, help="Base model folder the adapter applies to.")
@click.option("--model", required=True, help="Fine-tuned model folder (same architecture as the base).")
@click.option(
    "--out",
    "--out-path",
    "out",
    required=True,
    type=click.Path(file_okay=False),
    help="Adapter folder to write (atomically): adapter_config.json, adapter_model.safetensors and the "
    "base's base_fingerprint.json (for `mergekit-lite audit`).",
)
@settings_options(ExtractSettings)
@click.option("--device", help="Where the SVDs run: cpu (default), cuda, cuda:N or auto.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@QUIET
@mergekit_options
@click.pass_context
def extract(ctx, base, model, out, settings, device, overwrite, quiet, **mergekit):
    """Extract a LoRA adapter: the truncated SVD of (fine-tune - base) for every linear layer.

    PEFT loads the result (PeftModel.from_pretrained); at a rank as large as the layers, merging it gives
    back the fine-tune. One weight pair is in memory at a time. mergekit-extract-lora's flags work with
    mergekit's meaning (docs/mergekit.md).
    """
    from mergekit_lite.audited import extract_lora
    from mergekit_lite.devices import usable_device

    flags = MergekitFlags(**mergekit)
    flags.refusals()
    device = usable_device(flags.device(device) or "cpu")
    given = [
        name for name in NOT_EXTRACTION if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
    ]
    for note in flags.notes() + [f"note: {flag_name(name)}: {NOT_EXTRACTION[name]}" for name in given]:
        click.echo(note, err=True)
    flags.apply()
    result = extract_lora(
        base, model, out, settings, device=str(device), overwrite=overwrite, model_card=flags.write_model_card
    )
    click.echo(
        f"wrote {out}: {len(result.factored)} linear layers factored (rank <= {settings.rank}), "
        f"{len(result.saved)} modules stored whole"
    )
    if result.dropped:
        click.echo(f"not in the adapter: changes to {', '.join(result.dropped)}", err=True)
