"""`mergekit-lite extract`: a LoRA adapter (PEFT format) from a base and its fine-tune, streamed."""

import click

EXAMPLES = """
\b
Examples:
  # rank-16 adapter of post/ over pre/ (linear layers factored, changed norms/embeddings stored whole)
  mergekit-lite extract --base pre/ --model post/ --rank 16 --out post-lora/
\b
  # mergekit-extract-lora's flags work as they are
  mergekit-lite extract --base-model pre/ --model post/ --out-path post-lora/ --max-rank 32 -e lm_head
"""


@click.command(epilog=EXAMPLES)
@click.option("--base", "--base-model", "base", required=True, help="Base model folder the adapter applies to.")
@click.option("--model", required=True, help="Fine-tuned model folder (same architecture as the base).")
@click.option("--out", "--out-path", "out", required=True, type=click.Path(file_okay=False),
              help="Adapter folder to write (atomically): adapter_config.json, adapter_model.safetensors and the "
                   "base's base_fingerprint.json (for `mergekit-lite audit`).")
@click.option("--rank", "--max-rank", "rank", type=int, default=128, show_default=True,
              help="Largest LoRA rank; layers smaller than it are factored exactly.")
@click.option("--include", "--include-regex", "-i", "include", multiple=True,
              help="Only factor linear layers whose name matches this regex (repeatable).")
@click.option("--exclude", "--exclude-regex", "-e", "exclude", multiple=True,
              help="Leave out modules whose name matches this regex (repeatable).")
@click.option("--linear-only", is_flag=True,
              help="Only low-rank factors: do not store changed embeddings, head or norms at full rank.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--quiet", "-q", is_flag=True, help="No loading bars or logs from the libraries on stderr.")
def extract(base, model, out, rank, include, exclude, linear_only, overwrite, quiet):
    """Extract a LoRA adapter: the truncated SVD of (fine-tune - base) for every linear layer.

    PEFT loads the result (PeftModel.from_pretrained); at a rank as large as the layers, merging it gives
    back the fine-tune. One weight pair is in memory at a time.
    """
    from mergekit_lite.audited import extract_lora

    result = extract_lora(base, model, out, rank=rank, include=tuple(include), exclude=tuple(exclude),
                          linear_only=linear_only, overwrite=overwrite)
    click.echo(f"wrote {out}: {len(result.factored)} linear layers factored (rank <= {rank}), "
               f"{len(result.saved)} modules stored whole")
    if result.dropped:
        click.echo(f"not in the adapter (--linear-only): changes to {', '.join(result.dropped)}", err=True)
