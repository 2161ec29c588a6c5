#!/usr/bin/env python3
"""Write the same bytes the ordinary way and past the page cache, alternating, and print wall and system time.

The A/B behind `mergekit_lite/io/direct.py` (benchmarks/RESULTS.md, "Writes past the page cache"): one buffer of
random bytes written into files of `--file-mb` each until `--gb` are written, with `open(path, "wb")` ("buffered")
or with `DirectFile` ("direct"), each file synced as it closes, as the merge's shards are. Rounds alternate which
kind goes first; the files of a round are deleted before the next. Scratch space: `--dir` (default
benchmarks/work/write-ab, git-ignored), about `--gb` GB at a time.

    python benchmarks/write_ab.py --gb 4 --rounds 3 [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import time
from pathlib import Path

from mergekit_lite.io.direct import DirectFile

HERE = Path(__file__).resolve().parent


def write_files(folder: Path, payload: memoryview, total: int, file_bytes: int, direct: bool) -> dict:
    """Write `total` bytes as files of `file_bytes`, each synced at close; wall and this process's system time."""
    folder.mkdir(parents=True)
    os.sync()
    started, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    written, index = 0, 0
    while written < total:
        size = min(file_bytes, total - written)
        path = folder / f"part-{index:03d}"
        handle = DirectFile(path) if direct else open(path, "wb")
        with memoryview(payload) as view:
            for begin in range(0, size, len(view)):
                handle.write(view[: min(len(view), size - begin)])
        if not direct:
            handle.flush()
            os.fsync(handle.fileno())
        handle.close()
        written += size
        index += 1
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "wall_s": round(time.perf_counter() - started, 2),
        "sys_s": round(after.ru_stime - before.ru_stime, 2),
        "user_s": round(after.ru_utime - before.ru_utime, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0, help="bytes written per kind and round, in GB")
    parser.add_argument("--file-mb", type=int, default=500, help="size of each file (the merge's shard size)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=HERE / "work" / "write-ab")
    parser.add_argument("--json", type=Path, help="also write the runs and medians here")
    args = parser.parse_args()
    if args.dir.exists():
        raise SystemExit(f"error: {args.dir} exists; give a --dir that does not")
    load_at_start = os.getloadavg()
    payload = memoryview(os.urandom(64 << 20))
    total, file_bytes = int(args.gb * 1e9), args.file_mb * 1_000_000
    runs: dict[str, list[dict]] = {"buffered": [], "direct": []}
    try:
        for round_index in range(args.rounds):
            kinds = ["buffered", "direct"] if round_index % 2 == 0 else ["direct", "buffered"]
            for kind in kinds:
                folder = args.dir / f"{kind}-{round_index}"
                result = write_files(folder, payload, total, file_bytes, direct=kind == "direct")
                shutil.rmtree(folder)
                runs[kind].append(result)
                print(
                    f"round {round_index + 1} {kind:>8}: {result['wall_s']:6.2f} s wall, {result['sys_s']:6.2f} s sys",
                    flush=True,
                )
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    summary = {
        kind: {
            "median_wall_s": statistics.median(r["wall_s"] for r in results),
            "median_sys_s": statistics.median(r["sys_s"] for r in results),
            "runs": results,
        }
        for kind, results in runs.items()
    }
    for kind, numbers in summary.items():
        print(
            f"{kind:>8}: median {numbers['median_wall_s']:.2f} s wall, {numbers['median_sys_s']:.2f} s sys "
            f"({args.gb:g} GB in {args.file_mb} MB files)"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": "python benchmarks/write_ab.py "
                    + " ".join(
                        f"--{k.replace('_', '-')} {v}"
                        for k, v in vars(args).items()
                        if k in ("gb", "file_mb", "rounds")
                    ),
                    "load_at_start": load_at_start,
                    **summary,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
