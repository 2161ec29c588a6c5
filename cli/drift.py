"""`mergekit-lite drift`: where post-training moved a model, per tensor, decoder layer and module type."""

import json
from pathlib import Path

import click

from mergekit_lite.cli.options import QUIET, json_flag, output_file, settings_options
from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.settings import DriftSettings
from mergekit_lite.io.outputs import check_output_file, write_atomic

EXAMPLES = """
\b
Examples:
  mergekit-lite drift pre/ post/ --heatmap drift.png
  mergekit-lite drift pre/ post-lora/ --texts texts.txt --json > drift.json
"""


@click.command("drift", epilog=EXAMPLES)
@click.argument("pre", type=click.Path(exists=True, file_okay=False))
@click.argument("post", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--texts",
    type=click.Path(exists=True, dir_okay=False),
    metavar="FILE",
    help='Texts (one per line, or .jsonl with a "text" field): adds each layer\'s linear CKA, pre vs post.',
)
@settings_options(DriftSettings)
@output_file(
    "--heatmap",
    "FILE.png",
    "Plot the drift, decoder layers by module type (and 1 - CKA per layer with --texts).",
)
@output_file("--html", "FILE.html", "Write the table and the heat map as one self-contained HTML page.")
@json_flag("{tensors, layers, outside_layers, modules}")
@QUIET
def drift(pre, post, texts, settings, heatmap_out, html_out, as_json, quiet):
    """Relative Frobenius drift ||post - pre|| / ||pre|| of every tensor, per decoder layer and module type
    (attention q/k/v/o, MLP gate/up/down, MoE experts, norms, embeddings, head), streamed one tensor pair at a
    time. POST may be a LoRA adapter trained on PRE (measured without writing the merged model)."""
    from mergekit_lite.evaluate.drift import format_drift_table, model_drift, plot_drift_heatmap
    from mergekit_lite.merge.recall import read_texts

    inputs = [pre, post, texts]
    if heatmap_out:
        if Path(heatmap_out).suffix.lower() != ".png":
            raise InputError(f"--heatmap {heatmap_out}: expected a .png file name")
        check_output_file(heatmap_out, inputs)
        if not Path(heatmap_out).absolute().parent.is_dir():
            raise InputError(f"--heatmap {heatmap_out}: its folder does not exist")
    if html_out:
        check_output_file(html_out, inputs, suffixes={"html", "htm"})
        if heatmap_out and Path(heatmap_out).absolute() == Path(html_out).absolute():
            raise InputError("--heatmap and --html must name different files")
    text_list = read_texts(texts) if texts else None
    report = model_drift(pre, post, text_list, settings)
    if report.nonfinite:
        shown = ", ".join(report.nonfinite[:3]) + (", ..." if len(report.nonfinite) > 3 else "")
        click.echo(
            f"warning: {len(report.nonfinite)} tensor(s) hold NaN or Inf values ({shown}): their drift, and that of "
            "every layer and module holding them, is null",
            err=True,
        )
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2, allow_nan=False))
    else:
        click.echo(format_drift_table(report))
    if heatmap_out:
        write_atomic(heatmap_out, lambda temp: plot_drift_heatmap(report, temp))
        if not quiet:
            click.echo(f"heatmap: written to {heatmap_out}", err=True)
    if html_out:
        from mergekit_lite.evaluate.pages import drift_page

        write_atomic(html_out, drift_page(report, lambda path: plot_drift_heatmap(report, path)))
        if not quiet:
            click.echo(f"html: written to {html_out}", err=True)
