"""Write large files past the page cache (O_DIRECT), falling back to ordinary writes where that is refused.

A buffered write copies every byte into freshly allocated page-cache pages. On the machines this project is
measured on, 4 GB written that way and synced took 3.8-11.9 s of wall time and 2.7-10.4 s of system time from one
round to the next; written with O_DIRECT through two aligned 32 MB stages, 3.5-3.7 s and 0.75 s
(benchmarks/write_ab.py; benchmarks/RESULTS.md, "Writes past the page cache"). Direct writes also leave no dirty
pages behind, so a merge's output is on the device when each shard is closed.

O_DIRECT needs the buffer, the length and the file offset aligned to the device's block size. Bytes are staged in
page-aligned memory and written in whole stages; the last, partial stage is padded and the file cut back to its
true size. Filesystems without O_DIRECT (tmpfs, some network filesystems) refuse it at open or at the first write
with EINVAL, and the file is then written the ordinary way.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor

from mergekit_lite.io.buffers import aligned

STAGE_BYTES = 32 << 20  # per write call: large requests keep the device streaming; two such stages per file


class DirectFile:
    """A new file written front to back, the way `open(path, "wb")` would, but past the page cache.

    Two stages alternate: while one is written to the device by a background thread, the caller copies into the
    other, so the copying and the device's time overlap instead of adding up. One write is in flight at a time,
    so the file is written in order. The first stage is written in the caller's thread: it is where a filesystem
    that took O_DIRECT at open may still refuse it, and the fallback must happen before anything else is written.
    `close` makes the bytes durable (fsync): with direct writes that costs only the metadata.
    """

    def __init__(self, path: str | os.PathLike):
        self.name = str(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            self._fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o666)
            self.direct = hasattr(os, "O_DIRECT")
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            self._fd = os.open(path, flags, 0o666)
            self.direct = False
        # anonymous maps are page-aligned
        self._stages = [mmap.mmap(-1, STAGE_BYTES), mmap.mmap(-1, STAGE_BYTES)] if self.direct else []
        self._flusher = ThreadPoolExecutor(max_workers=1) if self.direct else None
        self._in_flight: Future | None = None
        self._filling = 0  # which stage is being filled
        self._staged = 0
        self._flushed_once = False
        self._size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._size += len(view)
        if not self.direct:
            _write_all(self._fd, view)
            return len(view)
        done = 0
        while done < len(view):
            take = min(len(view) - done, STAGE_BYTES - self._staged)
            stage = self._stages[self._filling]
            stage[self._staged : self._staged + take] = view[done : done + take]
            self._staged += take
            done += take
            if self._staged == STAGE_BYTES:
                self._hand_off(STAGE_BYTES)
        return len(view)

    def close(self) -> None:
        """Write what is staged, cut the padding off, sync and close."""
        if self._fd < 0:
            return
        try:
            padded = self._staged > 0
            if padded:
                self._hand_off(aligned(self._staged))  # whole pages: a multiple of any common block size
            self._wait_for_flush()
            if padded:
                os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        finally:
            self._release()

    def abandon(self) -> None:
        """Close without writing what is staged (the file is being thrown away)."""
        self._release()

    def _release(self) -> None:
        if self._flusher is not None:
            self._flusher.shutdown(wait=True)  # a write in flight uses the descriptor: it must end before close
            self._flusher = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._stages = []  # unmapped once no view of them is left (a failed write's traceback may hold one)

    def _hand_off(self, nbytes: int) -> None:
        """Write the filled stage (`nbytes` of it: the staged bytes and, at the end, padding) and switch stages.

        The other stage is free once the write in flight, which was its own, has finished.
        """
        self._wait_for_flush()
        stage, staged = self._stages[self._filling], self._staged
        if self._flushed_once and self.direct:
            self._in_flight = self._flusher.submit(self._flush, stage, nbytes, staged)
        else:
            self._flush(stage, nbytes, staged)
            self._flushed_once = True
        self._filling ^= 1
        self._staged = 0

    def _wait_for_flush(self) -> None:
        """Wait for the write in flight; its error (a full disk) is raised here, in the caller's thread."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def _flush(self, stage: mmap.mmap, nbytes: int, staged: int) -> None:
        """Write `nbytes` of a stage (whole blocks), of which `staged` are data."""
        try:
            with memoryview(stage) as view:
                _write_all(self._fd, view[:nbytes])
        except OSError as error:
            if error.errno != errno.EINVAL or self._flushed_once:
                raise
            # the filesystem took O_DIRECT at open but refuses these writes (a block size above a page): a failed
            # write wrote nothing, so the staged bytes are written again, the ordinary way, and so is the rest
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False
            with memoryview(stage) as view:
                _write_all(self._fd, view[:staged])


def _write_all(fd: int, view: memoryview) -> None:
    """os.write until every byte is written (a write may be short, and Linux writes at most 2 GiB per call)."""
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])
