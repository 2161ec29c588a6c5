"""`mergekit-lite extract`: a LoRA adapter (PEFT format) from a base and its fine-tune, streamed."""

import click

from mergekit_lite.cli.mergekit_flags import MergekitFlags, mergekit_options
from mergekit_lite.cli.types import Number, SafeSuggestions

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
@click.option(
    "--rank",
    "--max-rank",
    "rank",
    type=int,
    default=128,
    show_default=True,
    help="Largest LoRA rank; layers smaller than it are factored exactly.",
)
@click.option(
    "--include",
    "--include-regex",
    "-i",
    "include",
    multiple=True,
    help="Only factor linear layers whose name matches this regex (repeatable).",
)
@click.option(
    "--exclude",
    "--exclude-regex",
    "-e",
    "exclude",
    multiple=True,
    help="Leave out modules whose name matches this regex (repeatable).",
)
@click.option(
    "--linear-only",
    is_flag=True,
    help="Only low-rank factors: do not store changed embeddings, head or norms at full rank.",
)
@click.option(
    "--distribute-scale/--no-distribute-scale",
    default=True,
    help="Split the singular values evenly between A and B (default), or put them all in A.",
)
@click.option(
    "--embed-lora/--no-embed-lora",
    default=False,
    help="Factor the embeddings and output head too (PEFT's lora_embedding_A/B), instead of storing them "
    "whole in modules_to_save.",
)
@click.option(
    "--save-module",
    "save_modules",
    multiple=True,
    help="Store this module whole (modules_to_save), changed or not: a full name or its last part "
    "(lm_head); repeatable.",
)
@click.option(
    "--sv-epsilon",
    type=Number(min=0),
    default=0.0,
    show_default=True,
    help="Drop singular values at or below this: a module's rank is how many are above (at most the rank).",
)
@click.option(
    "--skip-undecomposable",
    is_flag=True,
    help="Leave out changed modules that are neither linear nor embeddings (norms) instead of storing them whole.",
)
@click.option("--device", help="Where the SVDs run: cpu (default), cuda, cuda:N or auto.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--quiet", "-q", is_flag=True, help="No loading bars or logs from the libraries on stderr.")
@mergekit_options
@click.pass_context
def extract(
    ctx,
    base,
    model,
    out,
    rank,
    include,
    exclude,
    linear_only,
    distribute_scale,
    embed_lora,
    save_modules,
    sv_epsilon,
    skip_undecomposable,
    device,
    overwrite,
    quiet,
    **mergekit,
):
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
    for note in flags.notes() + [f"note: --{name.replace('_', '-')}: {NOT_EXTRACTION[name]}" for name in given]:
        click.echo(note, err=True)
    flags.apply()
    result = extract_lora(
        base,
        model,
        out,
        rank=rank,
        include=tuple(include),
        exclude=tuple(exclude),
        linear_only=linear_only,
        overwrite=overwrite,
        save_modules=tuple(save_modules),
        skip_undecomposable=skip_undecomposable,
        embed_lora=embed_lora,
        sv_epsilon=sv_epsilon,
        distribute_scale=distribute_scale,
        device=str(device),
        model_card=flags.write_model_card,
    )
    click.echo(
        f"wrote {out}: {len(result.factored)} linear layers factored (rank <= {rank}), "
        f"{len(result.saved)} modules stored whole"
    )
    if result.dropped:
        click.echo(f"not in the adapter: changes to {', '.join(result.dropped)}", err=True)
