"""Option types shared by the commands."""

import math

import click

from mergekit_lite.errors import InputError


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
