"""Shards written past the page cache: the same bytes as an ordinary write, whatever the filesystem allows."""

import errno
import fcntl
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mergekit_lite.io.direct import STAGE_BYTES, DirectFile
from mergekit_lite.io.safetensors import PlannedTensor, ShardedWriter

SHM = Path("/dev/shm")


def pieces() -> list[bytes]:
    """Odd sizes that straddle the stage's boundaries, one larger than a whole stage, and an empty one."""
    sizes = [8, 1234, STAGE_BYTES - 1242, 1, STAGE_BYTES + 4097, 0, 77]
    return [os.urandom(size) for size in sizes]


def write_in_pieces(path: Path, data: list[bytes]) -> DirectFile:
    handle = DirectFile(path)
    for piece in data:
        assert handle.write(memoryview(piece)) == len(piece)
    handle.close()
    return handle


def test_direct_writes_give_the_exact_bytes_and_size(tmp_path):
    data = pieces()
    handle = write_in_pieces(tmp_path / "file", data)
    assert (tmp_path / "file").read_bytes() == b"".join(data)
    filesystem = subprocess.run(["stat", "-f", "-c", "%T", tmp_path], capture_output=True, text=True).stdout.strip()
    if filesystem in ("ext2/ext3", "xfs", "btrfs"):  # these take O_DIRECT: the fast path must be the one taken
        assert handle.direct, filesystem


@pytest.mark.skipif(not SHM.is_dir() or not os.access(SHM, os.W_OK), reason="no writable /dev/shm")
def test_tmpfs_gets_the_exact_bytes():
    """tmpfs took O_DIRECT only from Linux 6.6; older kernels refuse it at open, and either way the bytes match."""
    path = SHM / f"mergekit-lite-direct-{os.getpid()}"
    try:
        data = pieces()
        write_in_pieces(path, data)
        assert path.read_bytes() == b"".join(data)
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_a_filesystem_refusing_o_direct_is_written_the_ordinary_way(tmp_path, monkeypatch, refused_at):
    """Filesystems without O_DIRECT answer EINVAL, at open (older tmpfs, some network filesystems) or at the first
    write (some FUSE filesystems). This machine's filesystems all take it, so the refusal is injected."""
    real_open, real_write = os.open, os.write

    def refusing_open(path, flags, *args):
        if refused_at == "open" and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def refusing_write(fd, data):
        if refused_at == "write" and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(os, "write", refusing_write)
    data = pieces()
    handle = write_in_pieces(tmp_path / "file", data)
    assert not handle.direct
    assert (tmp_path / "file").read_bytes() == b"".join(data)


def test_an_abandoned_shard_is_closed_and_its_writer_reusable(tmp_path):
    """Leaving the writer on an error closes the shard's descriptor and frees its stage (no leak per failed merge)."""
    tensors = [torch.arange(10, dtype=torch.float32), torch.ones(3, 4, dtype=torch.bfloat16)]
    planned = [PlannedTensor(f"t{i}", tuple(t.shape), t.dtype) for i, t in enumerate(tensors)]
    descriptors = len(os.listdir("/proc/self/fd"))
    with pytest.raises(RuntimeError, match="stop"), ShardedWriter(tmp_path / "a", planned, 2**40) as writer:
        (tmp_path / "a").mkdir()
        writer.write("t0", tensors[0])
        raise RuntimeError("stop")
    assert len(os.listdir("/proc/self/fd")) == descriptors
    (tmp_path / "b").mkdir()
    with ShardedWriter(tmp_path / "b", planned, 2**40) as writer:
        for i, tensor in enumerate(tensors):
            writer.write(f"t{i}", tensor)
        writer.close()
    loaded = load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(loaded[f"t{i}"], tensor) for i, tensor in enumerate(tensors))


def test_a_failed_background_write_is_raised_in_the_writer_and_names_the_file(tmp_path, monkeypatch):
    """Stages after the first are written by a background thread; a full disk there must still stop the caller,
    with the shard's name, and leave no descriptor open."""
    real_write, direct_writes = os.write, []

    def filling_write(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            direct_writes.append(len(data))
            if len(direct_writes) == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    probe = DirectFile(tmp_path / "probe")
    probe.abandon()
    if not probe.direct:
        pytest.skip("this filesystem refuses O_DIRECT: no background writes")
    monkeypatch.setattr(os, "write", filling_write)
    tensor = torch.zeros(4 * STAGE_BYTES // 4, dtype=torch.float32)
    planned = [PlannedTensor("big", tuple(tensor.shape), tensor.dtype)]
    descriptors = len(os.listdir("/proc/self/fd"))
    (tmp_path / "out").mkdir()
    with (
        pytest.raises(OSError, match="No space left") as raised,
        ShardedWriter(tmp_path / "out", planned, 2**40) as writer,
    ):
        writer.write("big", tensor)
        writer.close()
    assert raised.value.filename == str(tmp_path / "out" / "model.safetensors")
    assert len(direct_writes) == 3
    assert len(os.listdir("/proc/self/fd")) == descriptors
