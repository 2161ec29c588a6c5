"""Write large files past the page cache (O_DIRECT), falling back to ordinary writes where that is refused.

A buffered write copies every byte into freshly allocated page-cache pages. On the machines this project is
measured on, that copy cost 3 to 20 s of system time per 4 GB written, and it was most of a large merge's wall time;
the same 4 GB written with O_DIRECT through a small aligned staging buffer took 2.8-4.2 s of wall time and 0.2-0.4 s
of system time (benchmarks/RESULTS.md, "Writes past the page cache"). Direct writes also leave no dirty pages
behind, so a merge's output is on the device when each shard is closed.

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

from mergekit_lite.io.buffers import aligned

STAGE_BYTES = 16 << 20  # per write call: large enough to stream, small enough to keep in cache


class DirectFile:
    """A new file written front to back, the way `open(path, "wb")` would, but past the page cache.

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
        self._stage = mmap.mmap(-1, STAGE_BYTES) if self.direct else None  # anonymous maps are page-aligned
        self._staged = 0
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
            self._stage[self._staged:self._staged + take] = view[done:done + take]
            self._staged += take
            done += take
            if self._staged == STAGE_BYTES:
                self._flush_stage(STAGE_BYTES)
        return len(view)

    def close(self) -> None:
        """Write what is staged, cut the padding off, sync and close."""
        if self._fd < 0:
            return
        try:
            if self._staged:
                self._flush_stage(aligned(self._staged))  # whole pages: a multiple of any common block size
                os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        finally:
            self._release()

    def abandon(self) -> None:
        """Close without writing what is staged (the file is being thrown away)."""
        self._release()

    def _release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._stage = None  # unmapped once no view of it is left (a failed write's traceback may hold one)

    def _flush_stage(self, nbytes: int) -> None:
        """Write the stage, `nbytes` of it (whole blocks: the staged bytes and, at the end, padding)."""
        try:
            with memoryview(self._stage) as stage:
                _write_all(self._fd, stage[:nbytes])
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            # the filesystem took O_DIRECT at open but refuses these writes (a block size above a page): a failed
            # write wrote nothing, so the staged bytes are written again, the ordinary way, and so is the rest
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False
            with memoryview(self._stage) as stage:
                _write_all(self._fd, stage[:self._staged])
        self._staged = 0


def _write_all(fd: int, view: memoryview) -> None:
    """os.write until every byte is written (a write may be short, and Linux writes at most 2 GiB per call)."""
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])
