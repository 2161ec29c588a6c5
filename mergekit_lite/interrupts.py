"""Ctrl-C and SIGTERM by design: a flag set by the handler, acted on at safe points.

Python raises KeyboardInterrupt wherever the main thread happens to be, including inside
ThreadPoolExecutor's locks, which can leave a worker waiting forever on a lock the main thread held.
Inside `deferred()` sections (the merge loop, writing and removing output folders) the handlers only
record the signal, and the code calls `check()` between tensors, where nothing is locked. Elsewhere
(lm-eval, forward passes) they raise at once, as Ctrl-C normally does. Either way the exception is
`Interrupted`, which the CLI turns into one line and exit 128 + signal number (130 / 143).

Some Python runs inside C++: the import of pybind11 extensions (torch, matplotlib's `_image`) and
transformers building a model (torch's device modes call back into Python from pybind11). An exception raised
there cannot always unwind through the C++ frames: the process aborts ("terminate called after throwing an
instance of 'pybind11::error_already_set'") or the import fails as "ImportError: initialization failed"
instead of ending in one line. Those sections are deferred too: the imports of `DEFERRED_IMPORTS` by
`install()` (wherever they are first imported), model building by `deferred()` around it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HANDLED = (signal.SIGINT, signal.SIGTERM)
DEFERRED_IMPORTS = frozenset({"torch", "matplotlib"})
_received: int | None = None
_deferring = 0
_starting = False


class Interrupted(KeyboardInterrupt):
    """A handled SIGINT / SIGTERM; a KeyboardInterrupt so libraries stop as they would on Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


def _handler(signum, frame) -> None:
    global _received
    _received = signum
    if not _deferring and not _starting:
        raise Interrupted(signum)


class _DeferredImports(importlib.abc.MetaPathFinder):
    """Finds the given top-level packages as Python would and runs each one's import inside `deferred()`;
    each is deferred once, and the finder steps aside when none is left."""

    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names:
            return None
        self.names.discard(fullname)
        if not self.names:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            run_module = spec.loader.exec_module

            def exec_module(module):
                with deferred():
                    run_module(module)

            spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Route SIGINT and SIGTERM through the flag (main thread only, as `signal` requires).

    Signals stay deferred until `started()`: while the CLI imports its modules, nothing could catch them;
    later, the imports of `DEFERRED_IMPORTS` are deferred wherever they happen. A signal the parent set to be ignored (`nohup`,
    a background job of a script) stays ignored."""
    global _starting
    if threading.current_thread() is threading.main_thread():
        _starting = True
        for signum in HANDLED:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, _handler)
        pending = set(DEFERRED_IMPORTS - sys.modules.keys())
        if pending:
            sys.meta_path.insert(0, _DeferredImports(pending))


def started() -> None:
    """End the start-up deferral of `install()`: from here on a signal outside `deferred()` raises at once."""
    global _starting
    _starting = False
    check()


@contextmanager
def deferred(raise_at_end: bool = True) -> Iterator[None]:
    """Within this block a signal only sets the flag; it is raised at the next `check()` or at the end.

    A block that ends by putting an output in place (a rename) passes `raise_at_end=False` and calls `check()`
    just before it: a signal that arrives during the rename then waits for the next safe point, so a complete
    output is never reported as an interrupted run (and is not left behind one)."""
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    if raise_at_end:
        check()


def finished() -> None:
    """The command's work is done and its outputs are in place: from here to the exit a signal is only recorded,
    so it cannot interrupt the interpreter's shutdown (libraries' atexit callbacks would print "Exception
    ignored") or turn a complete run into a failed one."""
    global _deferring
    _deferring += 1


def received() -> int | None:
    """The handled signal that arrived, if any: a failure after it is the interrupt's doing, whatever its type."""
    return _received


def check() -> None:
    """A safe point: raise `Interrupted` if a handled signal arrived."""
    if _received is not None:
        raise Interrupted(_received)
