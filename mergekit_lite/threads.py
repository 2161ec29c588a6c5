"""torch's intra-op thread count, set for a block of work and restored after it."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(count: int):
    """Run the block with `count` intra-op threads, then restore the caller's setting.

    The engine's I/O-bound chunk loop and checks leave a core to its reader and writer threads; tiny models train
    fastest on one thread (on a busy 2-core machine, two threads ran 10-20x slower from contention).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
