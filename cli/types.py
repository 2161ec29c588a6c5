"""Option types shared by the commands."""

import math
import re

import click

from mergekit_lite.errors import InputError


def flag_name(name: str) -> str:
    """The command line's name of a setting or parameter: its name with dashes (`select_topk` -> `--select-topk`)."""
    return "--" + name.replace("_", "-")


class Number(click.FloatRange):
    """A float option, within bounds when given. NaN is refused where it is read: every comparison with it is
    false, so it passes any range check and would switch off the check it sets (`--min-delta nan`)."""

    name = "number"

    def _describe_range(self) -> str:
        """The bounds for --help, or nothing where there are none (click would print `x<=None`)."""
        return "" if self.min is None and self.max is None else super()._describe_range()

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if math.isnan(number):
            option = param.opts[0] if param is not None and param.opts else "value"
            raise InputError(f"{option}: expected a number, got {value!r}")
        return number


# A seed option: numpy's generators take only seeds >= 0 and torch's only those below 2**64, so a negative or huge
# one is refused as the flag's value rather than deep inside a draw (after models were scored)
SEED = click.IntRange(0, 2**63 - 1)

# Flags that lower a safety check: never offered as the correction of a mistyped flag (click suggests the closest
# names, and `--lazy-unpickle` once came out as "Did you mean '--allow-pickle'?").
UNSAFE_FLAGS = frozenset(
    {
        "--allow-pickle",
        "--allow-nonfinite",
        "--force",
        "--overwrite",
        "--trust-remote-code",
        "--allow-crimes",
        "--unsafe-truncate-embeddings",
        "--no-safe-serialization",
    }
)


class SafeSuggestions(click.Command):
    """A command whose unknown-option error never suggests a flag from UNSAFE_FLAGS."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as error:
            error.possibilities = [name for name in error.possibilities or () if name not in UNSAFE_FLAGS]
            raise


class ShardSize(click.ParamType):
    """--out-shard-size in mergekit's units or in bytes.

    mergekit's units: a count with an optional K, M or B suffix (thousand, million, billion: `1B` is 10^9).
    mergekit's help calls the count parameters, but its writer (mergekit 0.1.5, io/tensor_writer.py) adds each
    tensor's bytes against it, so counting bytes gives mergekit's shard boundaries whatever the dtype. A byte unit
    (KB, MB, GB, TB; KiB, MiB, GiB, TiB) is read as bytes: `2GB` is 2*10^9 bytes.
    """

    name = "size"
    MERGEKIT_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9}

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip()
        counted = re.fullmatch(r"(\d+(?:\.\d+)?)([KMB]?)", text, re.IGNORECASE)
        if counted:
            size = int(float(counted[1]) * self.MERGEKIT_SUFFIXES[counted[2].upper()])
            if size <= 0:
                self.fail(f"{value!r} must be positive", param, ctx)
            return size
        from mergekit_lite.io.validation import parse_size

        try:
            return parse_size(text)
        except InputError:
            self.fail(
                f"{value!r} is no size (mergekit's 1B, 500M, 20K, a count, or bytes: 2GB, 500MB, 5GiB)", param, ctx
            )
