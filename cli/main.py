"""The `mergekit-lite` command: a group whose subcommands load on demand, so `--help` stays fast."""

import signal  # noqa: I001  (handlers go in first, so Ctrl-C during the imports is handled too)

from mergekit_lite import interrupts

interrupts.install()

import datetime  # noqa: E402
import importlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
import unicodedata  # noqa: E402
from pathlib import Path  # noqa: E402

import click  # noqa: E402

from mergekit_lite.errors import InputError  # noqa: E402

BAD_INPUT_ERRORS = {
    RecursionError: "input nested too deeply",
    MemoryError: "out of memory (an input far larger than it should be?)",
    OverflowError: "a number too large",
}

SUBCOMMANDS = {
    "merge": (".merge", "merge", "Merge checkpoints (streamed, tensor by tensor)."),
    "audit": (".audit", "audit", "Audit LoRA adapters before merging: VERIFIED / REJECTED / WARN."),
    "sweep": (".sweep", "sweep", "Sweep the merge coefficient, evaluate old/new skills, pick by harmonic mean."),
    "merge-adapters": (".merge_adapters", "merge_adapters", "Merge LoRA adapters into one adapter (PEFT's types)."),
    "extract": (".extract", "extract", "Extract a LoRA adapter (PEFT) from a base and its fine-tune by truncated SVD."),
    "forgetting": (".forgetting", "forgetting", "Sample-level forgetting map from two lm-eval --log_samples outputs."),
    "drift": (".drift", "drift", "Where post-training moved a model: relative drift per layer and module, CKA."),
    "demo": (".demo", "demo", "The whole story offline on tiny models: train, forget, audit, sweep, report."),
}


class LazyGroup(click.Group):
    """Imports a subcommand's module only when it runs, and turns user errors into one line + exit code."""

    def list_commands(self, ctx):
        return list(SUBCOMMANDS)

    def get_command(self, ctx, name):
        if name not in SUBCOMMANDS:
            return None
        module, attribute, _ = SUBCOMMANDS[name]
        # Deferred: torch's import runs Python inside C++ (pybind11), where an exception raised by the handler
        # cannot unwind and aborts the process (terminate called after error_already_set); raised right after
        with interrupts.deferred():
            return getattr(importlib.import_module(module, __package__), attribute)

    def format_commands(self, ctx, formatter):
        rows = [(name, help_text) for name, (_, _, help_text) in SUBCOMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """click's own errors (an unknown option, a value its types refuse) as one line too, with the command's
        --help named where its usage would have been printed."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as error:  # a bare command: its help, as click shows it
            error.show()
            sys.exit(error.exit_code)
        except click.exceptions.UsageError as error:
            hint = f" (see '{error.ctx.command_path} --help')" if error.ctx is not None else ""
            click.echo(one_line(f"error: {error.format_message()}{hint}"), err=True)
            sys.exit(error.exit_code)
        except click.exceptions.ClickException as error:
            click.echo(one_line(f"error: {error.format_message()}"), err=True)
            sys.exit(error.exit_code)
        except click.exceptions.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)  # an int is click's Exit code (--help, --version: 0)

    def invoke(self, ctx):
        """The last line of defence: every failure ends in one line on stderr and a fixed exit code."""
        if {"-q", "--quiet"} & set(sys.argv[1:]):
            quiet_third_party()
        try:
            interrupts.started()
            result = super().invoke(ctx)
            interrupts.finished()
            return result
        except InputError as error:
            click.echo(one_line(f"error: {error}"), err=True)
            sys.exit(error.exit_code)
        except OSError as error:
            where = f" ({error.filename})" if getattr(error, "filename", None) else ""
            click.echo(one_line(f"error: {error.strerror or error}{where}"), err=True)
            sys.exit(2)
        except interrupts.Interrupted as interrupt:
            click.echo(f"interrupted ({signal.Signals(interrupt.signum).name})", err=True)
            sys.exit(interrupt.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted (SIGINT)", err=True)
            sys.exit(130)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as error:
            signum = interrupts.received()
            if signum is not None:  # a library failed because the signal reached it (a C++ frame, a worker)
                click.echo(f"interrupted ({signal.Signals(signum).name})", err=True)
                sys.exit(128 + signum)
            if isinstance(error, tuple(BAD_INPUT_ERRORS)):
                click.echo(
                    one_line(
                        f"error: {BAD_INPUT_ERRORS.get(type(error), error)} "
                        f"({type(error).__name__}{_saved_traceback()})"
                    ),
                    err=True,
                )
                sys.exit(2)
            # a bug: one line for the user, the traceback in a file for the report
            message = " ".join(str(error).split())[:300]
            click.echo(
                one_line(f"error: internal error: {type(error).__name__}: {message}{_saved_traceback()}"), err=True
            )
            sys.exit(1)


def one_line(text: str) -> str:
    """`text` as one terminal line: control characters and line separators (a newline in a path or a tensor
    name) are written as escapes, the way repr() writes them, so an error is always exactly one line."""
    return "".join(repr(char)[1:-1] if unicodedata.category(char) in ("Cc", "Zl", "Zp") else char for char in text)


def _saved_traceback() -> str:
    """Write the current exception's traceback under the user cache (or the temp folder); say where."""
    candidates = [
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mergekit-lite",
        Path(tempfile.gettempdir()),
    ]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for folder in candidates:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"crash-{stamp}-{os.getpid()}.txt"
            with open(path, "x") as handle:
                handle.write(f"mergekit-lite {' '.join(sys.argv[1:])}\n\n{traceback.format_exc()}")
            return f"; traceback saved to {path}"
        except OSError:
            continue
    return ""


# what quiets the libraries' bars and logs in this process and the ones it starts (lm-eval workers, Ray actors)
QUIET_ENVIRONMENT = {
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "DATASETS_VERBOSITY": "error",
}


def quiet_third_party() -> None:
    """-q: no loading bars or info logs from transformers / huggingface_hub / lm-eval / datasets on stderr."""
    import logging

    os.environ.update(QUIET_ENVIRONMENT)
    for name in ("transformers", "huggingface_hub", "lm-eval", "lm_eval", "datasets", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # transformers' loading bars follow this switch when it is imported
    if "transformers" in sys.modules:  # already imported: it read the switch then
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mergekit-lite")
def main():
    """Recover what a model forgot in post-training by merging checkpoints.

    \b
    Quick start (offline, builds its own tiny models):
      mergekit-lite demo --out demo-run
    """
