#!/usr/bin/env python3
"""mergekit-lite vs mergekit, side by side in one run: builds the checkpoints, runs both tools, checks that the
outputs agree, measures the I/O and start-up bound, asks `--dry-run` what each merge will cost, prints the ratio
table (the predictions beside the measurements) and writes one small summary JSON.

    MERGEKIT_VENV=/path/to/venv python benchmarks/bench_vs_mergekit.py                  # 1 GB and 4 GB
    python benchmarks/bench_vs_mergekit.py --sizes 1gb --methods linear,ties --repeat 1  # quicker

mergekit runs from MERGEKIT_VENV (or --mergekit-venv; `pip install mergekit==0.1.5 torch==2.13.0` there), once
with its usual `dtype: bfloat16` config and once with `dtype: float32` (mergekit-lite's math dtype); without
it the run measures mergekit-lite alone and says so. Every run is a fresh process under /usr/bin/time -v;
tools alternate going first; the table shows medians of --repeat runs (runs slower than --repeat-below seconds
run once). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work"
METHODS = ("linear", "slerp", "task_arithmetic", "ties", "dare_ties")
MERGEKIT_DTYPES = ("bfloat16", "float32")
LITE_SHARD, MERGEKIT_SHARD = "500MB", "500M"  # the protocol; mergekit counts parameters: 500M bf16 = 1 GB
STARTUP = "import torch, yaml, tqdm, mergekit_lite.merge.engine, mergekit_lite.cli.merge"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


# ---------------------------------------------------------------- commands


def merge_inputs(method: str, ckpt: Path) -> list[Path]:
    return [ckpt / "base", ckpt / "ft1"] + ([] if method in ("linear", "slerp") else [ckpt / "ft2"])


def lite_command(method: str, ckpt: Path, out: Path) -> list[str]:
    b, f1, f2 = (str(ckpt / n) for n in ("base", "ft1", "ft2"))
    args = {
        "linear": ["--method", "linear", "--model", f"{b}:0.5", "--model", f"{f1}:0.5"],
        "slerp": ["--method", "slerp", "--base", b, "--model", f1, "--t", "0.5"],
        "task_arithmetic": [
            "--method",
            "task_arithmetic",
            "--base",
            b,
            "--model",
            f"{f1}:1",
            "--model",
            f"{f2}:1",
            "--lambda",
            "1",
        ],
        "ties": [
            "--method",
            "ties",
            "--base",
            b,
            "--model",
            f"{f1}:1",
            "--model",
            f"{f2}:1",
            "--density",
            "0.5",
            "--normalize",
        ],
        "dare_ties": [
            "--method",
            "dare_ties",
            "--base",
            b,
            "--model",
            f"{f1}:1",
            "--model",
            f"{f2}:1",
            "--drop",
            "0.5",
            "--normalize",
        ],
    }[method]
    return [
        str(Path(sys.executable).parent / "mergekit-lite"),
        "merge",
        *args,
        "--out",
        str(out),
        "--out-shard-size",
        LITE_SHARD,
        "--quiet",
    ]


ESTIMATE = re.compile(r"estimate on this machine: wall ([\d.]+) s .*peak RSS (\d+) MB")


def predicted(method: str, ckpt: Path, calibrate: bool) -> dict:
    """`--dry-run`'s estimate for the merge, parsed from its own line: what a user sees."""
    command = [arg for arg in lite_command(method, ckpt, WORK / "never") if arg != "--quiet"]
    result = subprocess.run(
        [*command, "--dry-run", *(["--calibrate"] if calibrate else [])],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
    )
    match = ESTIMATE.search(result.stdout)
    return {
        "wall_s": float(match.group(1)),
        "rss_mb": int(match.group(2)),
        "line": result.stdout[match.start() :].splitlines()[0],
    }


def mergekit_config(method: str, ckpt: Path, dtype: str) -> dict:
    """The same merge for mergekit: `dtype` is what it loads and computes in; it stores bf16 like the inputs."""
    b, f1, f2 = (str(ckpt / n) for n in ("base", "ft1", "ft2"))
    common = {"dtype": dtype, "out_dtype": "bfloat16"}
    if method == "linear":
        return {
            "merge_method": "linear",
            "models": [{"model": b, "parameters": {"weight": 0.5}}, {"model": f1, "parameters": {"weight": 0.5}}],
            **common,
        }
    if method == "slerp":
        return {
            "merge_method": "slerp",
            "base_model": b,
            "models": [{"model": b}, {"model": f1}],
            "parameters": {"t": 0.5},
            **common,
        }
    per_model = {"weight": 1.0, **({"density": 0.5} if method in ("ties", "dare_ties") else {})}
    config = {
        "merge_method": method,
        "base_model": b,
        "models": [{"model": f1, "parameters": dict(per_model)}, {"model": f2, "parameters": dict(per_model)}],
        "parameters": {"lambda": 1.0},
        **common,
    }
    if method in ("ties", "dare_ties"):
        config["parameters"]["normalize"] = True
    return config


def mergekit_command(venv: Path, config_file: Path, out: Path) -> list[str]:
    return [
        str(venv / "bin" / "mergekit-yaml"),
        str(config_file),
        str(out),
        "--lazy-unpickle",
        "--out-shard-size",
        MERGEKIT_SHARD,
        "--no-copy-tokenizer",
        "--no-write-model-card",
        "--quiet",
        "--random-seed",
        "0",
    ]


def mergekit_version(venv: Path | None) -> str | None:
    if venv is None or not (venv / "bin" / "mergekit-yaml").exists():
        return None
    return subprocess.check_output(
        [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version('mergekit'))"], text=True
    ).strip()


# ---------------------------------------------------------------- measuring


def timed_run(command: list[str], log_file: Path) -> dict:
    """One fresh process under /usr/bin/time -v: wall, peak RSS of the process, user/sys CPU, minor faults."""
    stats = log_file.with_suffix(".time")
    os.sync()  # no dirty pages left over from the previous run
    with open(log_file, "w") as out:
        started = time.perf_counter()
        rc = subprocess.call(
            ["/usr/bin/time", "-v", "-o", str(stats), *command],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        wall = time.perf_counter() - started
    text = stats.read_text()

    def field(label):
        return re.search(rf"{re.escape(label)}: (.+)", text).group(1).strip()

    run = {
        "rc": rc,
        "wall_s": round(wall, 2),
        "rss_mb": round(int(field("Maximum resident set size (kbytes)")) / 1024),
        "user_s": float(field("User time (seconds)")),
        "sys_s": float(field("System time (seconds)")),
        "minor_faults": int(field("Minor (reclaiming a frame) page faults")),
        "load": load_average()[0],
    }
    if rc:
        run["error"] = log_file.read_text()[-1500:]
    return run


def best_of(seconds, repeat: int = 3) -> float:
    return round(min(seconds() for _ in range(repeat)), 3)


def read_seconds(models: list[Path]) -> float:
    """Reading the inputs once from the page cache (`cat > /dev/null`; the first, warming pass not counted)."""
    files = [str(f) for m in models for f in sorted(m.glob("*.safetensors"))]

    def cat():
        subprocess.check_call(["cat", *files], stdout=subprocess.DEVNULL)

    cat()
    return best_of(lambda: timed(cat))


def write_seconds(nbytes: int) -> dict[str, float]:
    """Writing `nbytes` from memory into 500 MB files durably, each synced as it closes as a merge's shards are:
    through the page cache (`open`, `fsync`) and past it (`DirectFile`, as mergekit-lite writes); the bound takes
    the faster. The unsynced write into the page cache (as mergekit writes: its bytes are still in memory when it
    exits) is measured too and reported beside it, not used in the bound."""
    from mergekit_lite.io.direct import DirectFile

    folder, block = WORK / "write-bound", memoryview(os.urandom(500 * 10**6))

    def write(open_file, sync=False):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for index, begin in enumerate(range(0, nbytes, len(block))):
            handle = open_file(folder / f"shard-{index}")
            handle.write(block[: min(len(block), nbytes - begin)])
            if sync:
                handle.flush()
                os.fsync(handle.fileno())
            handle.close()

    seconds = {
        "buffered": best_of(lambda: timed(lambda: write(lambda path: open(path, "wb"), sync=True))),
        "direct": best_of(lambda: timed(lambda: write(DirectFile))),
        "unsynced": best_of(lambda: timed(lambda: write(lambda path: open(path, "wb")))),
    }
    shutil.rmtree(folder, ignore_errors=True)
    return seconds


def startup_seconds() -> float:
    """A fresh interpreter importing torch and the merge path: what any Python merge pays before reading a byte."""
    return best_of(lambda: timed(lambda: subprocess.check_call([sys.executable, "-c", STARTUP], cwd=REPO)))


def copy_gb_per_s() -> float:
    """Memory bandwidth as one core sees it: GB/s of a 512 MB copy (bytes read + bytes written), timed in the
    thread's own CPU seconds so that other processes on the machine do not inflate it."""
    import torch

    torch.set_num_threads(1)
    source = torch.ones(512 * 2**20, dtype=torch.uint8)
    target = torch.ones_like(source)

    def cpu_seconds():
        started = time.thread_time()
        target.copy_(source)
        return time.thread_time() - started

    seconds = best_of(cpu_seconds)
    return round(2 * source.numel() / seconds / 1e9, 1)


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


# ---------------------------------------------------------------- agreement


def agreement(method: str, lite_out: Path, mergekit_out: Path, base: Path) -> dict:
    """Tensor by tensor, in bf16 steps at the larger value; DARE (other RNG) and TIES (other tie rules,
    RESULTS.md) also by the share of entries left equal to the base and the std of (merged - base)."""
    import torch
    from safetensors import safe_open

    def reader(folder):
        """name -> tensor, read on demand (a 4 GB output is never held whole)."""
        handles = [safe_open(str(file), "pt") for file in sorted(folder.glob("*.safetensors"))]
        where = {name: handle for handle in handles for name in handle.keys()}
        return where, lambda name: where[name].get_tensor(name)

    lite_names, lite = reader(lite_out)
    mergekit_names, mergekit = reader(mergekit_out)
    base_names, base_tensor = reader(base)
    differs = sorted(set(lite_names) ^ set(mergekit_names))
    if differs:
        return {"tensor_names_differ": differs[:5]}
    compare_to_base = method in ("ties", "dare_ties")
    steps, differing, total, base_equal, spread = 0.0, 0, 0, {"lite": 0, "mergekit": 0}, {"lite": 0.0, "mergekit": 0.0}
    for name in sorted(lite_names):
        a, b = lite(name).to(torch.float32), mergekit(name).to(torch.float32)
        diff = (a - b).abs()
        spacing = torch.ldexp(torch.ones_like(a), torch.frexp(torch.maximum(a.abs(), b.abs())).exponent - 8)
        steps = max(steps, (diff / spacing.clamp_min_(2.0**-133)).max().item())
        differing += int(torch.count_nonzero(diff))
        total += diff.numel()
        if compare_to_base:
            origin = base_tensor(name).to(torch.float32)
            for tool, merged in (("lite", a), ("mergekit", b)):
                delta = merged - origin
                base_equal[tool] += int(torch.count_nonzero(delta == 0))
                spread[tool] += delta.double().std().item() * delta.numel()
    result = {"max_diff_bf16_steps": round(steps, 2), "share_differing": round(differing / max(total, 1), 5)}
    if compare_to_base:
        result.update({f"{tool}_share_equal_to_base": round(base_equal[tool] / total, 4) for tool in base_equal})
        result.update({f"{tool}_std_of_delta": round(spread[tool] / total, 6) for tool in spread})
    return result


# ---------------------------------------------------------------- the run


def run_size(size: str, methods: list[str], args, venv: Path | None, summary: dict) -> None:
    ckpt = WORK / f"ckpt-{size}"
    log(f"checkpoints {ckpt}")
    subprocess.check_call([sys.executable, str(HERE / "make_checkpoints.py"), "--size", size, "--out", str(ckpt)])
    output_bytes = sum(f.stat().st_size for f in (ckpt / "base").glob("*.safetensors"))
    writes = write_seconds(output_bytes)
    bounds = {
        "startup_s": startup_seconds(),
        "write_s": min(writes["buffered"], writes["direct"]),
        "write_buffered_s": writes["buffered"],
        "write_direct_s": writes["direct"],
        "write_unsynced_s": writes["unsynced"],
        "copy_gb_per_s": copy_gb_per_s(),
    }
    entry = summary["sizes"][size] = {
        "checkpoint_gb": round(output_bytes / 1e9, 2),
        "bounds": bounds,
        "methods": {},
        "command": summary["command"],
        "started": time.strftime("%H:%M:%S"),
        "load_at_start": load_average(),
    }
    tools = ["lite"] + ([f"mergekit-{dtype}" for dtype in args.mergekit_dtypes] if venv else [])
    for method in methods:
        inputs = merge_inputs(method, ckpt)
        read = read_seconds(inputs)
        moved = (len(inputs) + 1) * output_bytes  # every input byte read once, every output byte written once
        row = {
            "read_s": read,
            "bound_s": round(read + bounds["write_s"] + bounds["startup_s"], 2),
            "unsynced_bound_s": round(read + bounds["write_unsynced_s"] + bounds["startup_s"], 2),
            "bandwidth_s": round(moved / (bounds["copy_gb_per_s"] * 1e9), 2),
            "runs": {tool: [] for tool in tools},
        }
        row["predicted"] = predicted(method, ckpt, args.calibrate)
        args.calibrate = False  # the rates measured once, before the first dry run
        commands = {}
        for tool in tools:
            out = WORK / f"out-{size}-{method}-{tool}"
            if tool == "lite":
                commands[tool] = (out, lite_command(method, ckpt, out))
            else:
                config = WORK / f"{tool}-{method}.yml"
                config.write_text(json.dumps(mergekit_config(method, ckpt, tool.split("-", 1)[1])))
                commands[tool] = (out, mergekit_command(venv, config, out))
        for rep in range(args.repeat):
            for tool in tools if rep % 2 == 0 else tools[::-1]:
                runs = row["runs"][tool]
                if runs and (runs[0]["rc"] or runs[0]["wall_s"] > args.repeat_below):
                    continue
                out, command = commands[tool]
                shutil.rmtree(out, ignore_errors=True)
                run = timed_run(command, WORK / f"{size}-{method}-{tool}-{rep}.log")
                runs.append(run)
                log(
                    f"{size} {method:<15} {tool:<17} wall {run['wall_s']:7.2f} s  rss {run['rss_mb']:5d} MB  "
                    f"user {run['user_s']:6.2f}  sys {run['sys_s']:5.2f}  load {run['load']:.1f}  rc {run['rc']}"
                )
                if run["rc"]:
                    log(run["error"])
        for tool, runs in row["runs"].items():
            good = [r for r in runs if r["rc"] == 0]
            row[tool] = {
                "wall_s": statistics.median(r["wall_s"] for r in good) if good else None,
                "rss_mb": statistics.median(r["rss_mb"] for r in good) if good else None,
                "cpu_s": round(statistics.median(r["user_s"] + r["sys_s"] for r in good), 2) if good else None,
                "sys_s": statistics.median(r["sys_s"] for r in good) if good else None,
                "runs": len(good),
                "walls": [r["wall_s"] for r in runs],
                "loads": [r["load"] for r in runs],
            }
        reference = "mergekit-float32" if "mergekit-float32" in tools else (tools[1] if len(tools) > 1 else None)
        if reference and not args.skip_compare and row["lite"]["runs"] and row[reference]["runs"]:
            log(f"{size} {method}: comparing with {reference}")
            row["agreement_with_" + reference] = agreement(
                method, commands["lite"][0], commands[reference][0], ckpt / "base"
            )
        del row["runs"]
        for out, _ in commands.values():
            shutil.rmtree(out, ignore_errors=True)
        entry["methods"][method] = row
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    entry["load_at_end"] = load_average()
    if not args.keep_checkpoints:
        shutil.rmtree(ckpt, ignore_errors=True)


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def error_of(guess, measured) -> str:
    """A prediction beside its error against the measurement."""
    return f"{guess} ({guess / measured - 1:+.0%})" if guess is not None and measured else "-"


def print_table(summary: dict) -> None:
    for size, entry in summary["sizes"].items():
        bounds = entry["bounds"]
        print(
            f"\n{size} ({entry['checkpoint_gb']} GB per checkpoint): start-up {bounds['startup_s']} s, "
            f"write {bounds['write_s']} s synced ({bounds['write_unsynced_s']} s unsynced), copy "
            f"{bounds['copy_gb_per_s']} GB/s; bound = read + synced write + start-up (unsynced: with the unsynced "
            f"write); bw = inputs + output at copy speed"
        )
        dtypes = [d for d in MERGEKIT_DTYPES if f"mergekit-{d}" in next(iter(entry["methods"].values()), {})]
        header = [
            "method",
            "lite s",
            "lite cpu",
            "lite MB",
            "dry run s",
            "dry run MB",
            "bound s",
            "lite/bound",
            "lite/unsynced",
            "bw s",
            "lite/bw",
        ]
        for dtype in dtypes:
            tag = {"bfloat16": "mk-bf16", "float32": "mk-fp32"}[dtype]
            header += [f"{tag} s", f"{tag} cpu", f"{tag} MB", f"wall/{tag}", f"cpu/{tag}", f"rss/{tag}"]
        header.append("agreement")
        rows = [header]
        for method, row in entry["methods"].items():
            lite = row["lite"]
            guess = row.get("predicted", {})
            cells = [
                method,
                str(lite["wall_s"]),
                str(lite["cpu_s"]),
                str(lite["rss_mb"]),
                error_of(guess.get("wall_s"), lite["wall_s"]),
                error_of(guess.get("rss_mb"), lite["rss_mb"]),
                str(row["bound_s"]),
                ratio(lite["wall_s"], row["bound_s"]),
                ratio(lite["wall_s"], row["unsynced_bound_s"]),
                str(row["bandwidth_s"]),
                ratio(lite["wall_s"], row["bandwidth_s"]),
            ]
            for dtype in dtypes:
                mk = row[f"mergekit-{dtype}"]
                cells += [
                    str(mk["wall_s"]),
                    str(mk["cpu_s"]),
                    str(mk["rss_mb"]),
                    ratio(lite["wall_s"], mk["wall_s"]),
                    ratio(lite["cpu_s"], mk["cpu_s"]),
                    ratio(lite["rss_mb"], mk["rss_mb"]),
                ]
            agree = next((v for k, v in row.items() if k.startswith("agreement")), {})
            cells.append(
                f"max {agree['max_diff_bf16_steps']} bf16 steps, {agree['share_differing']:.2%} differ"
                if agree
                else "-"
            )
            rows.append(cells)
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for cells in rows:
            print(
                "  ".join(
                    c.ljust(w) if i in (0, len(header) - 1) else c.rjust(w)
                    for i, (c, w) in enumerate(zip(cells, widths, strict=True))
                )
            )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1gb,4gb", help="checkpoint sizes, comma-separated (1gb, 4gb, tiny)")
    parser.add_argument("--methods", default=",".join(METHODS), help="subset of " + ",".join(METHODS))
    parser.add_argument("--repeat", type=int, default=3, help="runs per tool and merge; medians (default 3)")
    parser.add_argument(
        "--repeat-below",
        type=float,
        default=60.0,
        help="repeat only runs whose first run took less than this many seconds (default 60)",
    )
    parser.add_argument(
        "--mergekit-venv",
        type=Path,
        default=os.environ.get("MERGEKIT_VENV"),
        help="venv with mergekit-yaml (default: $MERGEKIT_VENV)",
    )
    parser.add_argument("--mergekit-dtypes", default=",".join(MERGEKIT_DTYPES), help="mergekit configs to run")
    parser.add_argument("--skip-compare", action="store_true", help="do not compare the outputs")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep benchmarks/work/ckpt-SIZE afterwards")
    parser.add_argument("--json", type=Path, default=HERE / "results.json", help="summary file (default results.json)")
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's rates before the first dry run (`--dry-run --calibrate`)",
    )
    args = parser.parse_args(argv)
    args.mergekit_dtypes = [d for d in args.mergekit_dtypes.split(",") if d]
    methods = [m for m in args.methods.split(",") if m]
    if set(methods) - set(METHODS) or set(args.mergekit_dtypes) - set(MERGEKIT_DTYPES):
        parser.error("unknown method or mergekit dtype")
    WORK.mkdir(parents=True, exist_ok=True)
    venv = Path(args.mergekit_venv) if args.mergekit_venv else None
    version = mergekit_version(venv)
    if version is None:
        log("mergekit not found (set MERGEKIT_VENV or --mergekit-venv); measuring mergekit-lite alone")
        venv = None
    import torch

    commit = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()
    summary = {
        "command": " ".join(["python", "benchmarks/bench_vs_mergekit.py", *(argv or sys.argv[1:])]),
        "commit": commit,
        "mergekit": version,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_at_start": load_average(),
        "sizes": {},
    }
    if args.json.exists():  # sizes measured by an earlier invocation stay, each with its own command and times
        earlier = json.loads(args.json.read_text())
        summary["earlier_runs"] = [*earlier.pop("earlier_runs", []), {k: v for k, v in earlier.items() if k != "sizes"}]
        summary["sizes"] = earlier.get("sizes", {})
    for size in [s for s in args.sizes.split(",") if s]:
        run_size(size, methods, args, venv, summary)
    summary["load_at_end"] = load_average()
    summary["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print_table(summary)
    log(f"summary: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
