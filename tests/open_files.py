"""What a test needs to see that code closes the files it opens: the process's open and mapped files as the kernel
lists them, and a block that must neither leave new ones open nor leave them for the garbage collector to close."""

import gc
import os
import warnings
from contextlib import contextmanager
from pathlib import Path


def files_open_under(*folders: Path) -> list[str]:
    """This process's open files inside `folders`, as the kernel lists them."""
    roots = [str(Path(folder).resolve()) for folder in folders]
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the fd of the listing itself, closed already
            continue
        found += [target for root in roots if target.startswith(root + os.sep)]
    return found


def mapped_files() -> set[str]:
    """The files this process has mapped, as the kernel lists them."""
    return {
        line.split(maxsplit=5)[5]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if len(line.split(maxsplit=5)) == 6
    }


@contextmanager
def closes_what_it_opens(*folders: Path):
    """The block leaves open no file under `folders` that was not open before it, and none of the files it opened
    was closed by the garbage collector instead (a ResourceWarning: closed only when its object was freed, which
    in a reference cycle may be much later, or never in a long-lived process)."""
    gc.collect()
    before = sorted(files_open_under(*folders))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        yield
        gc.collect()
    unclosed = [str(warning.message) for warning in caught if issubclass(warning.category, ResourceWarning)]
    assert not unclosed, unclosed
    assert sorted(files_open_under(*folders)) == before
