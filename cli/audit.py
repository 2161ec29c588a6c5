"""`mergekit-lite audit`: audit LoRA adapters against their base, or write a base's fingerprint.

`audit ADAPTER... --base BASE` and `audit fingerprint BASE` share one name: a group whose first token,
when it is not a subcommand, starts an audit. (An adapter folder literally named `fingerprint` is
written `./fingerprint`.) Heavy modules load inside the commands, so `--help` stays fast.
"""

import json
import sys

import click

SHIPPED_FINGERPRINT = "base_fingerprint.json"  # audits.fingerprint.FINGERPRINT_FILE, named here to keep torch out of --help


class _InPlaceOfGroup(click.Context):
    """The audit runs in place of the group, so its usage line reads `mergekit-lite audit [OPTIONS] ADAPTER...`."""

    @property
    def command_path(self) -> str:
        return self.parent.command_path


class _AdaptersCommand(click.Command):
    context_class = _InPlaceOfGroup


class AuditGroup(click.Group):
    """Subcommands by name; anything else (an adapter path, an option) goes to the adapters command."""

    def __init__(self, *args, default_command: click.Command, **kwargs):
        super().__init__(*args, **kwargs)
        self.default_command = default_command

    def resolve_command(self, ctx, args):
        if args and args[0] in self.commands:
            return super().resolve_command(ctx, args)
        return None, self.default_command, args

    def format_help(self, ctx, formatter):
        self.default_command.format_help(ctx, formatter)
        self.format_commands(ctx, formatter)


def render_table(reports, verbose: bool) -> str:
    """One row per adapter (verdict, reasons); with `verbose`, every check under its row."""
    width = max(len("ADAPTER"), *(len(r.adapter) for r in reports))
    lines = [f"{'ADAPTER':<{width}}  {'VERDICT':<8}  REASONS"]
    for report in reports:
        lines.append(f"{report.adapter:<{width}}  {report.verdict:<8}  {'; '.join(report.reasons) or '-'}")
        if verbose:
            lines.extend(f"    {check.status:<4}  {check.name:<9}  {_measured(check)}  {check.detail}" for check in report.checks)
    counts = {verdict: sum(r.verdict == verdict for r in reports) for verdict in ("VERIFIED", "WARN", "REJECTED")}
    lines.append(", ".join(f"{count} {verdict}" for verdict, count in counts.items()))
    return "\n".join(lines)


def _measured(check) -> str:
    value = "-" if check.value is None else f"{check.value:.4g}"
    return value if check.threshold is None else f"{value} (threshold {check.threshold:g})"


@click.command(cls=_AdaptersCommand)
@click.argument("adapters", metavar="ADAPTER...", nargs=-1, required=True, type=click.Path())
@click.option("--base", required=True, type=click.Path(), help="The base model the adapters claim (HF folder or .safetensors file).")
@click.option("--fingerprint", type=click.Path(dir_okay=False),
              help=f"Base fingerprint to check the base against [default: {SHIPPED_FINGERPRINT} inside each adapter folder].")
@click.option("--train-data", type=click.Path(dir_okay=False),
              help='Training data for the leakage check: .jsonl with a "text" field (and optional "id"), or one text per line.')
@click.option("--holdout", type=click.Path(dir_okay=False), help="Evaluation holdout, same formats; needs --train-data.")
@click.option("--ngram", default=13, show_default=True, type=click.IntRange(min=1), help="Leakage n-gram length (whitespace words).")
@click.option("--max-contaminated", default=0.01, show_default=True, type=click.FloatRange(0, 1),
              help="Fail when a larger share of holdout items is found in the training data.")
@click.option("--min-delta", default=1e-4, show_default=True, type=click.FloatRange(min=0),
              help="Reject as a no-op when the largest ||dW||/||W|| is below this.")
@click.option("--min-similarity", default=0.95, show_default=True, type=click.FloatRange(-1, 1),
              help="Reject when any module's similarity to the base fingerprint is below this.")
@click.option("--allow-pickle", is_flag=True, help="Load adapter_model.bin pickles (weights_only=True); reported as a warning.")
@click.option("--json", "as_json", is_flag=True, help="Print the reports as JSON instead of a table.")
@click.option("-v", "--verbose", is_flag=True, help="Show every check with its value, threshold and detail.")
def audit_adapters(adapters, base, fingerprint, train_data, holdout, ngram, max_contaminated, min_delta,
                   min_similarity, allow_pickle, as_json, verbose):
    """Audit LoRA adapters against the base they claim: VERIFIED, WARN or REJECTED.

    ADAPTER is a PEFT adapter folder, or a folder of adapter folders; one row each.

    \b
    Checks: format (safetensors, config, NaN/Inf), structure (modules and shapes
    match the base), spectral (base fingerprint; without one, whether the update
    lives in the base's top singular subspace, a warning at most), delta (not a
    no-op; effective rank), leakage (with --train-data and --holdout).

    \b
    Exit status: 0 when no adapter is REJECTED (WARN also exits 0),
    1 when any adapter is REJECTED, 2 for unusable input (missing folder,
    no adapter_config.json, unreadable base or data).

    \b
    Examples:
      mergekit-lite audit adapters/math-lora --base models/pre
      mergekit-lite audit adapters/ --base models/pre --json
      mergekit-lite audit my-lora --base models/pre --train-data train.jsonl --holdout eval.jsonl -v
      mergekit-lite audit fingerprint models/pre --out base_fingerprint.json
    """
    from audits.adapter import AuditThresholds, audit_adapter, find_adapters

    thresholds = AuditThresholds(min_fingerprint_similarity=min_similarity, min_delta=min_delta, ngram=ngram,
                                 max_contaminated_share=max_contaminated)
    reports = [audit_adapter(folder, base, fingerprint=fingerprint, train_data=train_data, holdout=holdout,
                             thresholds=thresholds, allow_pickle=allow_pickle)
               for folder in find_adapters(adapters)]
    if as_json:
        click.echo(json.dumps({"reports": [report.to_dict() for report in reports]}, indent=2))
    else:
        click.echo(render_table(reports, verbose))
    if any(report.verdict == "REJECTED" for report in reports):
        sys.exit(1)


@click.group(cls=AuditGroup, default_command=audit_adapters, context_settings={"ignore_unknown_options": True})
def audit():
    """Audit LoRA adapters before merging."""


@audit.command("fingerprint")
@click.argument("base", type=click.Path())
@click.option("--out", default=SHIPPED_FINGERPRINT, show_default=True, type=click.Path(dir_okay=False),
              help="Where to write the fingerprint JSON.")
@click.option("--top-k", default=8, show_default=True, type=click.IntRange(min=1), help="Singular values kept per weight matrix.")
def fingerprint(base, out, top_k):
    """Write BASE's spectral fingerprint, to ship inside adapter folders as base_fingerprint.json."""
    from audits.fingerprint import compute_fingerprint, write_fingerprint

    result = compute_fingerprint(base, top_k)
    write_fingerprint(result, out, base_dir=base)
    click.echo(f"wrote {out}: {len(result['modules'])} weight matrices (top-{top_k} singular values and a probe each)")
