#!/usr/bin/env python3
"""How mergekit-lite's wall/CPU time reacts to a busy core and to its own thread count.

On a 2-core machine shared with other jobs, identical runs varied 5x. This runs one merge under
{no extra load, one core kept busy by a spinning process} x {OMP_NUM_THREADS=2, 1}, alternating, so the
cause can be told apart from plain noise. Use the project venv:

    python benchmarks/thread_contention.py --ckpt benchmarks/work/ckpt-1gb --method linear [--lite-src DIR]
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_vs_mergekit import WORK, lite_command, timed_run  # noqa: E402

SPIN = "import time\nend = time.time() + 900\nwhile time.time() < end: pass\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, default=WORK / "ckpt-1gb")
    parser.add_argument("--method", default="linear")
    parser.add_argument("--lite-src", type=Path)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results = []
    out = WORK / "out-contention"
    for rep in range(args.repeat):
        for busy in (False, True):
            spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
            try:
                time.sleep(0.5 if busy else 0)
                for threads in ("2", "1"):
                    env = {**os.environ, "OMP_NUM_THREADS": threads}
                    if args.lite_src:
                        env["PYTHONPATH"] = str(args.lite_src.resolve())
                    subprocess.call(["rm", "-rf", str(out)])
                    run = timed_run(lite_command(args.method, args.ckpt, out), WORK / "contention.log", env=env)
                    row = {"rep": rep, "busy_core": busy, "threads": int(threads), **{k: run.get(k) for k in (
                        "rc", "wall_s", "cpu_s", "user_s", "sys_s", "peak_rss_mb", "involuntary_switches")}}
                    results.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                if spinner:
                    spinner.kill()
                    spinner.wait()
    subprocess.call(["rm", "-rf", str(out)])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
