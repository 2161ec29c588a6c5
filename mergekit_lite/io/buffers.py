"""A fixed arena of reused memory, handed out first in, first out, shared between a producer and a consumer thread.

Allocating a fresh buffer per tensor costs a page fault per 4 KB on first touch (above glibc's mmap threshold
every large allocation is a new mapping), which at a few GB per merge was as much system time as the math took.
One arena, touched once and reused for every tensor, removes that cost and bounds memory by its capacity.
"""

from __future__ import annotations

import os
import threading
from collections import deque

import torch

ALIGNMENT = 4096  # page-aligned blocks: aligned for any dtype and for vectorized loads


class RingClosed(RuntimeError):
    """The ring was closed while a thread waited for space: the merge is being torn down."""


class BufferRing:
    """Blocks of one byte arena, taken and released in the same order (a ring buffer).

    `take` waits until the block fits behind the oldest live block, so a reader thread that runs ahead stalls
    instead of growing memory; `close` wakes every waiter with RingClosed, so a failed merge never hangs.
    `pin` page-locks the arena (CUDA only), which lets host-to-device copies run asynchronously.
    """

    def __init__(self, capacity: int, pin: bool = False):
        self.capacity = aligned(max(capacity, 1))
        storage = torch.empty(self.capacity + ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
        self._arena = storage[-storage.data_ptr() % ALIGNMENT :][: self.capacity]  # torch aligns to 64 bytes only
        self._live: deque[tuple[int, int]] = deque()  # (begin, end) of taken blocks, oldest first
        self._changed = threading.Condition()
        self._closed = False

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 block of `nbytes`, waiting for older blocks to be released if the arena is full."""
        size = aligned(max(nbytes, 1))
        if size > self.capacity:
            raise ValueError(f"block of {nbytes} bytes exceeds the ring's {self.capacity}")
        with self._changed:
            while (begin := self._free_offset(size)) is None:
                if self._closed:
                    raise RingClosed("buffer ring closed")
                self._changed.wait()
            if self._closed:
                raise RingClosed("buffer ring closed")
            self._live.append((begin, begin + size))
            return self._arena[begin : begin + nbytes]

    def release(self, block: torch.Tensor) -> None:
        """Give back the oldest live block (blocks are released in the order they were taken)."""
        # by storage offset, not data_ptr(): an empty block (a zero-size tensor's) has data_ptr() 0
        begin = block.storage_offset() - self._arena.storage_offset()
        with self._changed:
            if not self._live or self._live[0][0] != begin:
                raise RuntimeError("ring blocks must be released oldest first")
            self._live.popleft()
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _free_offset(self, size: int) -> int | None:
        """Where a block of `size` fits after the newest live block without overrunning the oldest."""
        if not self._live:
            return 0
        oldest, newest_end = self._live[0][0], self._live[-1][1]
        if newest_end > oldest:  # live blocks do not wrap: room at the end, else at the start
            if self.capacity - newest_end >= size:
                return newest_end
            return 0 if oldest >= size else None
        return newest_end if oldest - newest_end >= size else None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)
SMALL_ALLOCATION_LIMIT = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
KEPT_FREE_MEMORY = 1 << 30


def reuse_freed_memory() -> bool:
    """Make glibc serve the chunk loop's temporaries (a few MB each, thousands per GB) from memory it keeps.

    By default glibc maps any allocation above a threshold that it adjusts as the program runs, and unmaps it
    on free; whether the chunk temporaries land above or below it varied from run to run, and when above, every
    one of them was a fresh mapping: 1-5 million page faults instead of 0.16 million, and up to 3x the system
    time, for a 1 GB DARE merge (benchmarks/RESULTS.md, allocator A/B). Fixing the threshold at its ceiling and
    keeping up to KEPT_FREE_MEMORY of freed heap makes every run take the fast path; larger allocations are still
    mapped and returned, so peak memory is unchanged. The engine's threads (reader, writer, statistician, math,
    helpers) then share one arena per usable core instead of glibc's up to eight per core, each arena keeping its
    own freed temporaries (less peak RSS for TIES, whose threshold counts allocate on four threads: benchmarks/
    RESULTS.md). False where the C library has no mallopt (musl, macOS): nothing changes there.
    """
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return (
        bool(mallopt(M_MMAP_THRESHOLD, SMALL_ALLOCATION_LIMIT))
        and bool(mallopt(M_TRIM_THRESHOLD, KEPT_FREE_MEMORY))
        and bool(mallopt(M_ARENA_MAX, len(os.sched_getaffinity(0))))
    )


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to whole pages."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT
