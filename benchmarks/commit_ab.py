#!/usr/bin/env python3
"""The same merges by mergekit-lite at several commits, alternating, each a fresh process: what an engine change bought.

Each commit is checked out into its own git worktree (benchmarks/work/commit-ab/, git-ignored) and run with this
venv's interpreter, its own code first on the import path (the editable install's finder is set aside, and the
run checks which files it imported); a commit with compiled kernels (mergekit_lite/merge/kernels.c) has them built
in its worktree first, and a failed build stops the run rather than time torch's slower code. Rounds rotate which
commit goes first. The merges are bench_vs_mergekit.py's, on its checkpoints (made if absent); every commit's
output must hash the same as the first commit's, which is what "the bytes did not change" means here. Outputs
are deleted once hashed.

    PYTHONPATH=$PWD python benchmarks/commit_ab.py --commits 2f74885,HEAD --size 4gb --methods linear,ties --rounds 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_vs_mergekit import LITE_SHARD, REPO, WORK, lite_command, timed_run  # noqa: E402

# A checkout's cli/ is imported as the install names it (mergekit_lite.cli), or as `cli` in trees made before that.
RUN_AT = """import importlib.util, os, sys
checkout = sys.argv[1]
sys.meta_path = [finder for finder in sys.meta_path if "editable" not in repr(finder)]
sys.path.insert(0, checkout)
import mergekit_lite
assert mergekit_lite.__file__.startswith(checkout), mergekit_lite.__file__
with open(os.path.join(checkout, "pyproject.toml")) as pyproject:
    mapped = '"mergekit_lite.cli" = "cli"' in pyproject.read()
if mapped:
    for name in ("audits", "cli"):
        folder = os.path.join(checkout, name)
        spec = importlib.util.spec_from_file_location(f"mergekit_lite.{name}", os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])
        sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    from mergekit_lite.cli.main import main
else:
    from cli.main import main
sys.argv = ["mergekit-lite", *sys.argv[2:]]
sys.exit(main())
"""


def worktree(commit: str, folder: Path) -> tuple[str, Path]:
    sha = subprocess.check_output(["git", "rev-parse", "--short", commit], cwd=REPO, text=True).strip()
    path = folder / sha
    if not path.exists():
        subprocess.check_call(["git", "worktree", "add", "--detach", "--quiet", str(path), sha], cwd=REPO)
        if (path / "mergekit_lite" / "merge" / "kernels.c").is_file():
            subprocess.check_call(
                [sys.executable, "-c", "from setuptools import setup; setup()", "--quiet", "build_ext", "--inplace"],
                cwd=path,
            )
            if not list((path / "mergekit_lite" / "merge").glob("_kernels*")):
                raise SystemExit(f"error: the kernels of {sha} did not build")
    return sha, path


def output_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as handle:
            while block := handle.read(64 << 20):
                digest.update(block)
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", required=True, help="comma-separated revisions, e.g. 2f74885,HEAD")
    parser.add_argument("--size", default="4gb", choices=("1gb", "4gb"))
    parser.add_argument("--methods", default="linear")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    folder = WORK / "commit-ab"
    folder.mkdir(parents=True, exist_ok=True)
    checkouts = [worktree(commit, folder) for commit in args.commits.split(",")]
    ckpt = WORK / f"ckpt-{args.size}"
    subprocess.check_call([sys.executable, str(HERE / "make_checkpoints.py"), "--size", args.size, "--out", str(ckpt)])
    results: dict = {}
    try:
        for method in args.methods.split(","):
            for round_index in range(args.rounds):
                shift = round_index % len(checkouts)
                for sha, path in checkouts[shift:] + checkouts[:shift]:
                    out = folder / f"out-{sha}"
                    command = lite_command(method, ckpt, out)[1:]  # the CLI's arguments, without the console script
                    run = timed_run([sys.executable, "-c", RUN_AT, str(path), *command], folder / f"{sha}.log")
                    if run["rc"]:
                        raise SystemExit(f"error: {method} at {sha} failed: {run['error']}")
                    run["sha256"] = output_hash(out)
                    shutil.rmtree(out)
                    results.setdefault(method, {}).setdefault(sha, []).append(run)
                    print(
                        f"{method:>16} {sha}: wall {run['wall_s']:6.2f} s  user {run['user_s']:6.2f}  "
                        f"sys {run['sys_s']:5.2f}  rss {run['rss_mb']} MB  load {run['load']}  {run['sha256']}",
                        flush=True,
                    )
            hashes = {run["sha256"] for runs in results[method].values() for run in runs}
            print(f"{method:>16}: {'same bytes at every commit' if len(hashes) == 1 else 'OUTPUTS DIFFER'}")
    finally:
        for _, path in checkouts:
            subprocess.call(["git", "worktree", "remove", "--force", str(path)], cwd=REPO)
    summary = {
        method: {
            sha: {
                "median_wall_s": statistics.median(r["wall_s"] for r in runs),
                "median_user_s": statistics.median(r["user_s"] for r in runs),
                "median_sys_s": statistics.median(r["sys_s"] for r in runs),
                "runs": runs,
            }
            for sha, runs in by_sha.items()
        }
        for method, by_sha in results.items()
    }
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "shard": LITE_SHARD, "results": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
