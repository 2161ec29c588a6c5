"""torch's intra-op thread count, set for a block of work and restored after it; work started on the other cores."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


@contextmanager
def torch_threads(count: int):
    """Run the block with `count` intra-op threads, then restore the caller's setting.

    The engine's I/O-bound chunk loop and checks leave a core to its reader and writer threads; tiny models train
    fastest on one thread (on a busy 2-core machine, two threads ran 10-20x slower from contention).
    """
    import torch  # here, so that what imports this module (the method declarations) stays free of torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def start_on_other_cores(job: Callable[[Item], Result], items: Iterable[Item]) -> list[Future]:
    """Start `job` on each item on a process-wide pool of one thread per core, each on one intra-op thread, and
    return their futures, so the caller works meanwhile (DARE's draws for the next chunk beside this one's math).

    torch's OpenMP backend keeps the thread count per OS thread, so a worker's setting leaves the caller's alone.
    """

    def on_one_thread(item: Item) -> Result:
        with torch_threads(1):
            return job(item)

    return [_pool().submit(on_one_thread, item) for item in items]


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """Kept for the process: starting threads for every chunk would cost more than the work they take over."""
    return ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0)), thread_name_prefix="other-cores")
