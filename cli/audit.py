"""`mergekit-lite audit`: audit LoRA adapters against their base, or write a base's fingerprint.

`audit ADAPTER... --base BASE` and `audit fingerprint BASE` share one name: a group whose first token,
when it is not a subcommand, starts an audit. (An adapter folder literally named `fingerprint` is
written `./fingerprint`.) Heavy modules load inside the commands, so `--help` stays fast.
"""

import json
import sys
from contextlib import closing

import click

from mergekit_lite.audits.thresholds import AuditThresholds
from mergekit_lite.cli.options import QUIET, settings_options

# audits.fingerprint.FINGERPRINT_FILE, named here to keep torch out of --help
SHIPPED_FINGERPRINT = "base_fingerprint.json"


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


def paper_measures(report) -> tuple[str, str, str, str]:
    """The paper's numbers for one adapter: base-id status, total norm, per-module mean norm, first-token KL."""
    checks = {check.name: check for check in report.checks}
    delta = checks.get("delta")
    behaviour = checks.get("behaviour")
    return (
        checks["base-id"].status if "base-id" in checks else "-",
        f"{delta.measurements['total_norm']:.3g}" if delta else "-",
        f"{delta.measurements['per_module_mean_norm']:.3g}" if delta else "-",
        f"{behaviour.measurements['mean_kl']:.3g}" if behaviour else "-",
    )


VARIANT_WIDTH = 15


def table_header(width: int) -> str:
    return (
        f"{'ADAPTER':<{width}}  {'VERDICT':<8}  {'BASE-ID':<7}  {'NORM':>7}  {'PER-MOD':>7}  {'KL':>7}  "
        f"{'VARIANT':<{VARIANT_WIDTH}}  {'PEFT-WEIGHTED':<13}  {'MERGE-ADAPTERS':<14}  REASONS"
    )


def variant_cells(report, missing: str = "-") -> tuple[str, str, str]:
    """The adapter's variant, whether PEFT's add_weighted_adapter of it is right, what merge-adapters does."""
    variant = report.variant
    if variant is None:
        return missing, missing, missing
    return variant.label, variant.peft_weighted, variant.merge_adapters


def table_row(report, width: int, verbose: bool) -> str:
    """One adapter's row (verdict, the paper's measures, the variant, reasons); with `verbose`, every check under it
    and what its variant means for combining it."""
    base_id, norm, per_module, kl = paper_measures(report)
    label, peft, ours = variant_cells(report)
    lines = [
        f"{report.adapter:<{width}}  {report.verdict:<8}  {base_id:<7}  {norm:>7}  {per_module:>7}  {kl:>7}  "
        f"{label:<{VARIANT_WIDTH}}  {peft:<13}  {ours:<14}  {'; '.join(report.reasons) or '-'}"
    ]
    if verbose:
        lines.extend(
            f"    {check.status:<4}  {check.name:<9}  {_measured(check)}  {check.detail}" for check in report.checks
        )
        if report.variant is not None:
            lines.append(f"    variant {label}: PEFT add_weighted_adapter {peft} ({report.variant.peft_weighted_why})")
            lines.append(f"    variant {label}: merge-adapters {ours} ({report.variant.merge_adapters_why})")
    return "\n".join(lines)


def table_summary(reports) -> str:
    counts = {verdict: sum(r.verdict == verdict for r in reports) for verdict in ("VERIFIED", "WARN", "REJECTED")}
    return ", ".join(f"{count} {verdict}" for verdict, count in counts.items())


CHECK_ORDER = ("format", "base-id", "structure", "tokenizer", "signature", "spectral", "delta", "behaviour", "leakage")


def render_csv(reports) -> str:
    """One line per adapter: verdict, reasons, and each check's status, value and threshold (empty: not run)."""
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(
        [
            "adapter",
            "base",
            "verdict",
            *(f"{name}_{part}" for name in CHECK_ORDER for part in ("status", "value", "threshold")),
            "variant",
            "peft_weighted",
            "merge_adapters",
            "reasons",
        ]
    )
    for report in reports:
        checks = {check.name: check for check in report.checks}
        cells = []
        for name in CHECK_ORDER:
            check = checks.get(name)
            cells += ["", "", ""] if check is None else [check.status, _number(check.value), _number(check.threshold)]
        writer.writerow(
            [report.adapter, report.base, report.verdict, *cells, *variant_cells(report, ""), "; ".join(report.reasons)]
        )
    return buffer.getvalue().rstrip("\n")


def _number(value) -> str:
    return "" if value is None else repr(float(value))


def _measured(check) -> str:
    value = "-" if check.value is None else f"{check.value:.4g}"
    return value if check.threshold is None else f"{value} (threshold {check.threshold:g})"


@click.command(cls=_AdaptersCommand)
@click.argument("adapters", metavar="ADAPTER...", nargs=-1, type=click.Path())
@click.option(
    "--from-file",
    "from_file",
    type=click.Path(dir_okay=False),
    help="Also audit the adapters listed in FILE: one folder or hub id per line, # comments.",
)
@click.option(
    "--base",
    required=True,
    help="The base model the adapters claim: a folder, a .safetensors file or a hub id org/name[@revision].",
)
@click.option(
    "--fingerprint",
    type=click.Path(dir_okay=False),
    help=f"Base fingerprint to check the base against [default: {SHIPPED_FINGERPRINT} inside each adapter folder].",
)
@click.option(
    "--train-data",
    type=click.Path(dir_okay=False),
    help='Training data for the leakage check: .jsonl with a "text" field (and optional "id"), or one text per line.',
)
@click.option(
    "--holdout", type=click.Path(dir_okay=False), help="Evaluation holdout, same formats; needs --train-data."
)
@click.option(
    "--base-id",
    help="Hub id of the given base (e.g. meta-llama/Llama-3.1-8B-Instruct) to compare the declared "
    "base_model_name_or_path with [default: --base when it is a hub id, else the base config's _name_or_path].",
)
@settings_options(AuditThresholds, into="thresholds")
@click.option(
    "--behaviour", is_flag=True, help="Also run the model: first-token KL(base || base+adapter) on probe texts."
)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="Device for --behaviour (cpu for tiny models, cuda for real ones).",
)
@click.option(
    "--allow-pickle",
    is_flag=True,
    help="Load adapter_model.bin pickles of local folders (weights_only=True); "
    "reported as a warning. A hub adapter's pickle is never downloaded.",
)
@click.option(
    "--require-verified",
    is_flag=True,
    help="Exit 1 unless every adapter is VERIFIED (a WARN counts as a refusal, for scripts).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the reports as JSON instead of a table.")
@click.option(
    "--csv", "as_csv", is_flag=True, help="Print one CSV line per adapter: every check's status, value and threshold."
)
@click.option("-v", "--verbose", is_flag=True, help="Show every check with its value, threshold and detail.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar, loading bars or library logs on stderr.")
def audit_adapters(
    adapters,
    from_file,
    base,
    fingerprint,
    train_data,
    holdout,
    base_id,
    thresholds,
    behaviour,
    device,
    allow_pickle,
    require_verified,
    as_json,
    as_csv,
    verbose,
    quiet,
):
    """Audit LoRA adapters against the base they claim: VERIFIED, WARN or REJECTED.

    ADAPTER is a PEFT adapter folder, a folder of adapter folders, or a hub id
    org/name[@revision] (a local path always wins); one row each, printed as
    each adapter finishes. The base is opened and measured once for all.

    \b
    Checks: format (safetensors, typed config, known options, NaN/Inf), base-id
    (the declared base_model_name_or_path against the base: its weights when
    it is a local folder or a cached hub snapshot, else its name), structure (modules and
    shapes, with the real cause when they differ), tokenizer and signature
    (against a shipped base fingerprint), spectral, delta (the paper's total
    norm and the relative update), behaviour (with --behaviour), leakage (with
    --train-data and --holdout). docs/audit.md lists each threshold and its source.

    \b
    Exit status:
      0  every adapter VERIFIED, or some WARN (each WARN row says why)
      1  some adapter REJECTED; with --require-verified, also some WARN
      2  unusable input (missing folder, no adapter_config.json,
         unreadable base or data): one line "error: ..."
    WARN means nothing proves the adapter was made on this base (no
    declared base or fingerprint to compare with) or a check found
    something to look at; it is not a pass: scripts that merge only
    proven adapters use --require-verified.

    \b
    Examples:
      mergekit-lite audit adapters/math-lora --base models/pre
      mergekit-lite audit someorg/some-lora@v1 --base meta-llama/Llama-3.2-1B
      mergekit-lite audit adapters/ --from-file more.txt --base models/pre --csv > audit.csv
      mergekit-lite audit my-lora --base llama31 --base-id meta-llama/Llama-3.1-8B-Instruct --behaviour --device cuda
      mergekit-lite audit my-lora --base models/pre --train-data train.jsonl --holdout eval.jsonl -v
      mergekit-lite audit fingerprint models/pre --out base_fingerprint.json
    """
    if as_json and as_csv:
        raise click.UsageError("give --json or --csv, not both")
    if quiet:
        from mergekit_lite.cli.main import quiet_third_party

        quiet_third_party()
    from mergekit_lite.audits.adapter import audit_batch, find_adapters, read_adapter_list
    from mergekit_lite.audits.base import AuditBase

    names = [*adapters, *(read_adapter_list(from_file) if from_file else [])]
    if not names:
        raise click.UsageError("name at least one ADAPTER (or --from-file FILE)")
    found = find_adapters(names)
    reports = []
    width = max(len("ADAPTER"), *(len(ref.name) for ref in found))
    streaming = not (as_json or as_csv)
    with closing(AuditBase.open(base, allow_pickle)) as audit_base:
        if streaming:
            click.echo(table_header(width))
        bar = _progress(len(found), quiet)
        for report in audit_batch(
            found,
            audit_base,
            fingerprint=fingerprint,
            train_data=train_data,
            holdout=holdout,
            thresholds=thresholds,
            allow_pickle=allow_pickle,
            base_id=base_id,
            behaviour=behaviour,
            device=device,
        ):
            reports.append(report)
            if streaming:
                bar.write(table_row(report, width, verbose), file=sys.stdout)
            bar.update()
        bar.close()
    if as_json:
        click.echo(
            json.dumps(
                {"thresholds": thresholds.model_dump(), "reports": [report.to_dict() for report in reports]},
                indent=2,
                allow_nan=False,
            )
        )
    elif as_csv:
        click.echo(render_csv(reports))
    else:
        click.echo(table_summary(reports))
    refused = ("REJECTED", "WARN") if require_verified else ("REJECTED",)
    if any(report.verdict in refused for report in reports):
        sys.exit(1)


def _progress(total: int, quiet: bool):
    """A bar on stderr, only when stderr is a terminal and not -q (tqdm.write keeps rows on stdout whole)."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="adapter",
        desc="audit",
        file=sys.stderr,
        leave=False,
        disable=quiet or not sys.stderr.isatty(),
    )


@click.group(cls=AuditGroup, default_command=audit_adapters, context_settings={"ignore_unknown_options": True})
def audit():
    """Audit LoRA adapters before merging."""


@audit.command("fingerprint")
@click.argument("base", type=click.Path())
@click.option(
    "--out",
    default=SHIPPED_FINGERPRINT,
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Where to write the fingerprint JSON.",
)
@click.option(
    "--top-k", default=8, show_default=True, type=click.IntRange(min=1), help="Singular values kept per weight matrix."
)
@click.option(
    "--behaviour/--no-behaviour",
    default=True,
    show_default=True,
    help="Run the base once to record its first-token outputs on the probes.",
)
@click.option("--device", default="cpu", show_default=True, help="Device for --behaviour.")
@QUIET
def fingerprint(base, out, top_k, behaviour, device, quiet):
    """Write BASE's fingerprint (spectra, signature, tokenizer, outputs) to ship inside adapter folders."""
    if quiet:
        from mergekit_lite.cli.main import quiet_third_party

        quiet_third_party()
    from mergekit_lite.audits.fingerprint import compute_fingerprint, fingerprint_destination, write_fingerprint

    fingerprint_destination(out, base)
    result = compute_fingerprint(base, top_k, behaviour=behaviour, device=device)
    write_fingerprint(result, out, base_dir=base)
    click.echo(
        f"wrote {out}: {len(result['modules'])} weight matrices (top-{top_k} singular values and a probe each), "
        f"signature {result['signature']['digest']} over {len(result['signature']['samples'])} tensors"
        + (", first-token outputs on the probes" if "behaviour" in result else "")
    )
