"""User-facing errors: one line, a clear cause, a fixed exit code."""


class InputError(Exception):
    """Bad input the user can fix (a file, a tensor, a flag). The CLI prints it as one line and exits 2."""

    exit_code = 2
