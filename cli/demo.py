"""`mergekit-lite demo`: the README's main job, offline on tiny models."""

import click

from mergekit_lite.cli.types import SEED


@click.command()
@click.option(
    "--out",
    "-o",
    default="demo-run",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder for models, adapters, sweeps and the summary (finished stages are reused).",
)
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed for data, training and DARE.")
@click.option(
    "--methods",
    default="linear,ties,recall,recall_lerp",
    show_default=True,
    help="Comma-separated merge methods to sweep (any of linear, ties, recall, recall_lerp).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
def demo(out, seed, methods, quiet):
    """Build a tiny Llama, teach it an old skill, post-train it on a new one until it forgets, audit LoRA
    adapters of the fine-tune, sweep the merge coefficient for several methods, and report.

    \b
    Example:
      mergekit-lite demo --out demo-run
      cat demo-run/SUMMARY.md
    """
    from mergekit_lite.demo import DEMO_SWEEPS, run_demo, summary_lines
    from mergekit_lite.errors import InputError

    if quiet:
        from mergekit_lite.cli.main import quiet_third_party

        quiet_third_party()
    chosen = tuple(m.strip() for m in methods.split(",") if m.strip())
    unknown = [m for m in chosen if m not in DEMO_SWEEPS]
    if unknown or not chosen:
        raise InputError(f"demo methods must be among {', '.join(DEMO_SWEEPS)}, got {methods!r}")
    result = run_demo(out, seed=seed, methods=chosen, progress=not quiet, echo=click.echo)
    click.echo("\n".join(["", *summary_lines(result.sweeps), f"report: {result.summary_file}"]))
