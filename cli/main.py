"""The `mergekit-lite` command: a group whose subcommands load on demand, so `--help` stays fast."""

import importlib
import sys

import click

from mergekit_lite.errors import InputError

SUBCOMMANDS = {
    "merge": ("cli.merge", "merge", "Merge checkpoints (streamed, tensor by tensor)."),
    "audit": ("cli.audit", "audit", "Audit LoRA adapters before merging: VERIFIED / REJECTED / WARN."),
    "sweep": ("cli.sweep", "sweep", "Sweep the merge coefficient, evaluate old/new skills, pick by harmonic mean."),
    "extract": ("cli.extract", "extract", "Extract a LoRA adapter (PEFT) from a base and its fine-tune by truncated SVD."),
    "forgetting": ("cli.forgetting", "forgetting", "Sample-level forgetting map from two lm-eval --log_samples outputs."),
    "demo": ("cli.demo", "demo", "The whole story offline on tiny models: train, forget, audit, sweep, report."),
}


class LazyGroup(click.Group):
    """Imports a subcommand's module only when it runs, and turns user errors into one line + exit code."""

    def list_commands(self, ctx):
        return list(SUBCOMMANDS)

    def get_command(self, ctx, name):
        if name not in SUBCOMMANDS:
            return None
        module, attribute, _ = SUBCOMMANDS[name]
        return getattr(importlib.import_module(module), attribute)

    def format_commands(self, ctx, formatter):
        rows = [(name, help_text) for name, (_, _, help_text) in SUBCOMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except InputError as error:
            click.echo(f"error: {error}", err=True)
            sys.exit(error.exit_code)
        except OSError as error:
            where = f" ({error.filename})" if getattr(error, "filename", None) else ""
            click.echo(f"error: {error.strerror or error}{where}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mergekit-lite")
def main():
    """Recover what a model forgot in post-training by merging checkpoints.

    \b
    Quick start (offline, builds its own tiny models):
      mergekit-lite demo --out demo-run
    """
