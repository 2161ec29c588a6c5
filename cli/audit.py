"""`mergekit-lite audit`: audit LoRA adapters against their base, or write a base's fingerprint.

`audit ADAPTER... --base BASE` and `audit fingerprint BASE` share one name: a group whose first token,
when it is not a subcommand, starts an audit. (An adapter folder literally named `fingerprint` is
written `./fingerprint`.) Heavy modules load inside the commands, so `--help` stays fast.
"""

import json
import sys
from dataclasses import asdict

import click

from cli.types import Number

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


def paper_measures(report) -> tuple[str, str, str, str]:
    """The paper's numbers for one adapter: base-id status, total norm, per-module mean norm, first-token KL."""
    checks = {check.name: check for check in report.checks}
    delta = checks.get("delta")
    behaviour = checks.get("behaviour")
    return (checks["base-id"].status if "base-id" in checks else "-",
            f"{delta.measurements['total_norm']:.3g}" if delta else "-",
            f"{delta.measurements['per_module_mean_norm']:.3g}" if delta else "-",
            f"{behaviour.measurements['mean_kl']:.3g}" if behaviour else "-")


def render_table(reports, verbose: bool) -> str:
    """One row per adapter (verdict, the paper's measures, reasons); with `verbose`, every check under its row."""
    width = max(len("ADAPTER"), *(len(r.adapter) for r in reports))
    lines = [f"{'ADAPTER':<{width}}  {'VERDICT':<8}  {'BASE-ID':<7}  {'NORM':>7}  {'PER-MOD':>7}  {'KL':>7}  REASONS"]
    for report in reports:
        base_id, norm, per_module, kl = paper_measures(report)
        lines.append(f"{report.adapter:<{width}}  {report.verdict:<8}  {base_id:<7}  {norm:>7}  {per_module:>7}  {kl:>7}  "
                     f"{'; '.join(report.reasons) or '-'}")
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
@click.option("--max-contaminated", default=0.01, show_default=True, type=Number(0, 1),
              help="Fail when a larger share of holdout items is found in the training data.")
@click.option("--base-id", help="Hub id of the given base (e.g. meta-llama/Llama-3.1-8B-Instruct) to compare the declared "
              "base_model_name_or_path with [default: the base config's _name_or_path].")
@click.option("--min-delta", default=1e-4, show_default=True, type=Number(min=0),
              help="Reject as a no-op when the largest ||dW||/||W|| is below this.")
@click.option("--min-total-norm", default=1.0, show_default=True, type=Number(min=0),
              help="Reject as a no-op when sqrt(sum ||scaling*B@A||^2) is below this (the paper's rule, for 7-8B models).")
@click.option("--behaviour", is_flag=True, help="Also run the model: first-token KL(base || base+adapter) on probe texts.")
@click.option("--device", default="cpu", show_default=True, help="Device for --behaviour (cpu for tiny models, cuda for real ones).")
@click.option("--max-kl", default=20.0, show_default=True, type=Number(min=0),
              help="With --behaviour: reject above this KL as likely made on another base.")
@click.option("--min-similarity", default=0.95, show_default=True, type=Number(-1, 1),
              help="Reject when any module's similarity to the base fingerprint is below this.")
@click.option("--allow-pickle", is_flag=True, help="Load adapter_model.bin pickles (weights_only=True); reported as a warning.")
@click.option("--json", "as_json", is_flag=True, help="Print the reports as JSON instead of a table.")
@click.option("-v", "--verbose", is_flag=True, help="Show every check with its value, threshold and detail.")
def audit_adapters(adapters, base, fingerprint, train_data, holdout, ngram, max_contaminated, base_id, min_delta,
                   min_total_norm, behaviour, device, max_kl, min_similarity, allow_pickle, as_json, verbose):
    """Audit LoRA adapters against the base they claim: VERIFIED, WARN or REJECTED.

    ADAPTER is a PEFT adapter folder, or a folder of adapter folders; one row each.

    \b
    Checks: format (safetensors, typed config, known options, NaN/Inf), base-id
    (declared base_model_name_or_path vs the base), structure (modules and
    shapes, with the real cause when they differ), tokenizer and signature
    (against a shipped base fingerprint), spectral, delta (the paper's total
    norm and the relative update), behaviour (with --behaviour), leakage (with
    --train-data and --holdout). README.md lists each threshold and its source.

    \b
    Exit status: 0 when no adapter is REJECTED (WARN also exits 0),
    1 when any adapter is REJECTED, 2 for unusable input (missing folder,
    no adapter_config.json, unreadable base or data).

    \b
    Examples:
      mergekit-lite audit adapters/math-lora --base models/pre
      mergekit-lite audit adapters/ --base models/pre --json
      mergekit-lite audit my-lora --base llama31 --base-id meta-llama/Llama-3.1-8B-Instruct --behaviour --device cuda
      mergekit-lite audit my-lora --base models/pre --train-data train.jsonl --holdout eval.jsonl -v
      mergekit-lite audit fingerprint models/pre --out base_fingerprint.json
    """
    from audits.adapter import AuditThresholds, audit_adapter, find_adapters

    thresholds = AuditThresholds(min_fingerprint_similarity=min_similarity, min_delta=min_delta, ngram=ngram,
                                 max_contaminated_share=max_contaminated, min_total_norm=min_total_norm, max_kl=max_kl)
    reports = [audit_adapter(folder, base, fingerprint=fingerprint, train_data=train_data, holdout=holdout,
                             thresholds=thresholds, allow_pickle=allow_pickle, base_id=base_id, behaviour=behaviour,
                             device=device)
               for folder in find_adapters(adapters)]
    if as_json:
        click.echo(json.dumps({"thresholds": asdict(thresholds), "reports": [report.to_dict() for report in reports]},
                              indent=2))
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
@click.option("--behaviour/--no-behaviour", default=True, show_default=True,
              help="Run the base once to record its first-token outputs on the probes.")
@click.option("--device", default="cpu", show_default=True, help="Device for --behaviour.")
@click.option("--quiet", "-q", is_flag=True, help="No loading bars or logs from the libraries on stderr.")
def fingerprint(base, out, top_k, behaviour, device, quiet):
    """Write BASE's fingerprint (spectra, signature, tokenizer, outputs) to ship inside adapter folders."""
    if quiet:
        from cli.main import quiet_third_party

        quiet_third_party()
    from audits.fingerprint import compute_fingerprint, fingerprint_destination, write_fingerprint

    fingerprint_destination(out, base)
    result = compute_fingerprint(base, top_k, behaviour=behaviour, device=device)
    write_fingerprint(result, out, base_dir=base)
    click.echo(f"wrote {out}: {len(result['modules'])} weight matrices (top-{top_k} singular values and a probe each), "
               f"signature {result['signature']['digest']} over {len(result['signature']['samples'])} tensors"
               + (", first-token outputs on the probes" if "behaviour" in result else ""))
