#!/usr/bin/env python3
"""mergekit-lite vs mergekit on the same merges of synthetic Llama-shaped bf16 checkpoints.

    . .venv/bin/activate && python benchmarks/bench_vs_mergekit.py            # 1 GB, all five methods
    python benchmarks/bench_vs_mergekit.py --size 4gb --lite-only --repeat 1   # RSS flatness at 4 GB

What it does (see benchmarks/README.md):
1. makes base + 2 fine-tunes (benchmarks/make_checkpoints.py) under benchmarks/work/ckpt-SIZE;
2. installs mergekit into its own venv benchmarks/.venv-mergekit (torch==2.13.0 CPU first, then
   mergekit==0.1.5, else the newest mergekit pip resolves against that torch); if that fails mergekit is
   skipped with a message and only mergekit-lite is measured;
3. measures the bounds: reading each merge's inputs from the page cache (`cat > /dev/null`, best of 3),
   writing the output's size (page-cache write, and fsync'd), both best of 3;
4. runs every merge with both tools, each run a fresh process under `/usr/bin/time -v` (wall, peak RSS,
   user+sys CPU), alternating which tool goes first, best of --repeat;
5. compares outputs tensor by tensor (max |diff|; DARE by distribution since the RNGs differ);
6. prints a ratio table and writes the raw results to benchmarks/results-SIZE.json.

Runs with the project venv's Python (it needs torch and safetensors for the comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORK = HERE / "work"
MERGEKIT_VENV = HERE / ".venv-mergekit"
TORCH_PIN = "torch==2.13.0"
MERGEKIT_PIN = "mergekit==0.1.5"
METHODS = ("linear", "slerp", "task_arithmetic", "ties", "dare_ties")
TARGETS = {"time_ratio": 0.2, "rss_ratio": 0.5, "linear_vs_rw_bound": 3.0}
LITE_SHARD = "500MB"


# ---------------------------------------------------------------- setup

def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def mergekit_yaml() -> Path:
    return MERGEKIT_VENV / "bin" / "mergekit-yaml"


def ensure_mergekit() -> tuple[bool, str]:
    """Install mergekit into its own venv (torch pinned first); (ok, version or reason)."""
    pip = MERGEKIT_VENV / "bin" / "pip"
    if not mergekit_yaml().exists():
        log(f"installing mergekit into {MERGEKIT_VENV} (a few minutes)")
        setup_log = WORK / "setup_mergekit.log"
        with open(setup_log, "a") as out:
            steps = [["python3", "-m", "venv", str(MERGEKIT_VENV)],
                     [str(pip), "install", TORCH_PIN]]
            for step in steps:
                if subprocess.call(step, stdout=out, stderr=subprocess.STDOUT) != 0:
                    return False, f"'{' '.join(step)}' failed (see {setup_log})"
            installed = False
            for spec in (MERGEKIT_PIN, "mergekit"):
                if subprocess.call([str(pip), "install", spec, TORCH_PIN], stdout=out, stderr=subprocess.STDOUT) == 0:
                    installed = True
                    break
            if not installed:
                return False, f"pip could not install mergekit with {TORCH_PIN} (see {setup_log})"
            subprocess.call([str(pip), "install", "py-spy", TORCH_PIN], stdout=out, stderr=subprocess.STDOUT)
    try:
        version = subprocess.check_output([str(MERGEKIT_VENV / "bin" / "python"), "-c",
                                           "import importlib.metadata as m; print(m.version('mergekit'), m.version('torch'))"],
                                          text=True).split()
    except (subprocess.CalledProcessError, OSError) as error:
        return False, f"mergekit venv is broken ({error})"
    if not version[1].startswith("2.13.0"):
        return False, f"mergekit venv has torch {version[1]}, not 2.13.0"
    return True, version[0]


def make_checkpoints(size: str) -> Path:
    folder = WORK / f"ckpt-{size}"
    subprocess.check_call([sys.executable, str(HERE / "make_checkpoints.py"), "--size", size, "--out", str(folder)])
    return folder


# ---------------------------------------------------------------- measuring

TIME_V = Path("/usr/bin/time")
WRAPPER = r"""
import json, resource, subprocess, sys, time
started = time.perf_counter()
code = subprocess.call(sys.argv[2:])
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
json.dump({"rc": code, "wall_s": time.perf_counter() - started, "peak_rss_mb": usage.ru_maxrss / 1024,
           "user_s": usage.ru_utime, "sys_s": usage.ru_stime}, open(sys.argv[1], "w"))
"""


def timed_run(command: list[str], log_file: Path, env: dict | None = None) -> dict:
    """Run one command in a fresh process; wall, peak RSS (MB), user/sys CPU, exit code."""
    stats_file = log_file.with_suffix(".time")
    os.sync()  # start every run with no dirty pages left over from the previous one
    with open(log_file, "w") as out:
        if TIME_V.exists():
            started = time.perf_counter()
            rc = subprocess.call([str(TIME_V), "-v", "-o", str(stats_file), *command], stdout=out,
                                 stderr=subprocess.STDOUT, env=env)
            wall = time.perf_counter() - started
            text = stats_file.read_text()
            field = lambda label: re.search(rf"{re.escape(label)}: (.+)", text).group(1).strip()
            result = {"rc": rc, "wall_s": wall, "peak_rss_mb": int(field("Maximum resident set size (kbytes)")) / 1024,
                      "user_s": float(field("User time (seconds)")), "sys_s": float(field("System time (seconds)")),
                      "minor_page_faults": int(field("Minor (reclaiming a frame) page faults")),
                      "involuntary_switches": int(field("Involuntary context switches")),
                      "measured_by": "/usr/bin/time -v"}
        else:
            rc = subprocess.call([sys.executable, "-c", WRAPPER, str(stats_file), *command], stdout=out,
                                 stderr=subprocess.STDOUT, env=env)
            result = json.loads(stats_file.read_text()) if stats_file.exists() else {"rc": rc}
            result["measured_by"] = "getrusage(RUSAGE_CHILDREN)"
    result["cpu_s"] = round(result.get("user_s", 0) + result.get("sys_s", 0), 2)
    for key in ("wall_s", "peak_rss_mb", "user_s", "sys_s"):
        if key in result:
            result[key] = round(result[key], 2)
    if result["rc"] != 0:
        result["error_tail"] = log_file.read_text()[-2000:]
    return result


def weight_files(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def read_bound(models: list[Path], repeat: int = 3) -> float:
    """Seconds to read the inputs once with `cat > /dev/null`, from the page cache (best of `repeat`)."""
    files = [str(f) for m in models for f in weight_files(m)]
    subprocess.check_call(["cat", *files], stdout=subprocess.DEVNULL)  # warm the cache
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.check_call(["cat", *files], stdout=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - started)
    return round(best, 3)


def write_bound(nbytes: int, shard: int = 500 * 10**6, fsync: bool = False, repeat: int = 3) -> float:
    """Seconds to write `nbytes` in 500 MB files from memory (page-cache write; fsync'd if asked)."""
    folder = WORK / "write-bound"
    block = bytearray(os.urandom(1 << 20)) * 16  # 16 MiB of incompressible bytes
    best = float("inf")
    for _ in range(repeat):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        os.sync()
        started = time.perf_counter()
        left, index = nbytes, 0
        while left > 0:
            with open(folder / f"shard-{index}", "wb") as handle:
                written = 0
                while written < min(shard, left):
                    chunk = min(len(block), shard - written, left)
                    handle.write(memoryview(block)[:chunk])
                    written += chunk
                left -= written
                if fsync:
                    handle.flush()
                    os.fsync(handle.fileno())
            index += 1
        best = min(best, time.perf_counter() - started)
    shutil.rmtree(folder, ignore_errors=True)
    os.sync()
    return round(best, 3)


# ---------------------------------------------------------------- the merges

def merge_inputs(method: str, ckpt: Path) -> list[Path]:
    if method in ("linear", "slerp"):
        return [ckpt / "base", ckpt / "ft1"]
    return [ckpt / "base", ckpt / "ft1", ckpt / "ft2"]


def lite_command(method: str, ckpt: Path, out: Path) -> list[str]:
    exe = shutil.which("mergekit-lite", path=str(Path(sys.executable).parent)) or shutil.which("mergekit-lite")
    b, f1, f2 = (str(ckpt / n) for n in ("base", "ft1", "ft2"))
    args = {
        "linear": ["--method", "linear", "--model", f"{b}:0.5", "--model", f"{f1}:0.5"],
        "slerp": ["--method", "slerp", "--base", b, "--model", f1, "--t", "0.5"],
        "task_arithmetic": ["--method", "task_arithmetic", "--base", b, "--model", f"{f1}:1", "--model", f"{f2}:1",
                            "--lambda", "1"],
        "ties": ["--method", "ties", "--base", b, "--model", f"{f1}:1", "--model", f"{f2}:1", "--density", "0.5",
                 "--normalize"],
        "dare_ties": ["--method", "dare_ties", "--base", b, "--model", f"{f1}:1", "--model", f"{f2}:1", "--drop", "0.5",
                      "--normalize"],
    }[method]
    return [exe, "merge", *args, "--out", str(out), "--out-shard-size", LITE_SHARD, "--quiet"]


def mergekit_config(method: str, ckpt: Path, dtype: str) -> dict:
    b, f1, f2 = (str(ckpt / n) for n in ("base", "ft1", "ft2"))
    # dtype: the dtype mergekit loads and computes in; out_dtype: what it stores (bf16, like the inputs)
    common = {"dtype": dtype, "out_dtype": "bfloat16"}
    if method == "linear":
        return {"merge_method": "linear", "models": [{"model": b, "parameters": {"weight": 0.5}},
                                                     {"model": f1, "parameters": {"weight": 0.5}}], **common}
    if method == "slerp":
        return {"merge_method": "slerp", "base_model": b, "models": [{"model": b}, {"model": f1}],
                "parameters": {"t": 0.5}, **common}
    per_model = {"weight": 1.0}
    if method in ("ties", "dare_ties"):
        per_model["density"] = 0.5
    config = {"merge_method": method, "base_model": b,
              "models": [{"model": f1, "parameters": dict(per_model)}, {"model": f2, "parameters": dict(per_model)}],
              "parameters": {"lambda": 1.0}, **common}
    if method in ("ties", "dare_ties"):
        config["parameters"]["normalize"] = True
    return config


def mergekit_command(config_file: Path, out: Path, shard: str) -> list[str]:
    return [str(mergekit_yaml()), str(config_file), str(out), "--lazy-unpickle", "--out-shard-size", shard,
            "--no-copy-tokenizer", "--no-write-model-card", "--quiet", "--random-seed", "0"]


# ---------------------------------------------------------------- comparing outputs

def _open_output(folder: Path):
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(str(folder / "model.safetensors"), "pt") as handle:
            weight_map = {name: "model.safetensors" for name in handle.keys()}
    handles = {}

    def load(name):
        file = weight_map[name]
        if file not in handles:
            handles[file] = safe_open(str(folder / file), "pt")
        return handles[file].get_tensor(name)

    return sorted(weight_map), load


def compare_outputs(method: str, lite_out: Path, mk_out: Path, base: Path) -> dict:
    """Tensor by tensor: exact methods by max |diff|; DARE by distribution of (merged - base)."""
    import torch

    lite_names, lite = _open_output(lite_out)
    mk_names, mk = _open_output(mk_out)
    if lite_names != mk_names:
        return {"error": f"tensor names differ: {sorted(set(lite_names) ^ set(mk_names))[:5]}"}
    base_names, base_load = _open_output(base)
    result = {"tensors": len(lite_names), "dtype_mismatch": []}
    max_abs, worst, differing, total, max_ref = 0.0, None, 0, 0, 0.0
    max_ulp = 0.0
    dare_rows = []
    for name in lite_names:
        a, b = lite(name), mk(name)
        if a.shape != b.shape:
            return {"error": f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"}
        if a.dtype != b.dtype:
            result["dtype_mismatch"].append(f"{name}: {a.dtype} vs {b.dtype}")
        a32, b32 = a.to(torch.float32), b.to(torch.float32)
        diff = (a32 - b32).abs()
        tensor_max = diff.max().item()
        if tensor_max > max_abs:
            max_abs, worst = tensor_max, name
        differing += int((diff > 0).sum())
        total += diff.numel()
        max_ref = max(max_ref, b32.abs().max().item())
        # difference in units of the bf16 spacing at the reference value
        # (spacing at the larger of the two values: a 0 against a tiny value is one step, not 1e30)
        bigger = torch.maximum(a32.abs(), b32.abs())
        spacing = torch.ldexp(torch.ones_like(bigger), torch.frexp(bigger).exponent - 8).clamp_min_(2.0 ** -133)
        max_ulp = max(max_ulp, (diff / spacing).max().item())
        del diff, spacing, bigger
        if method in ("dare_ties", "ties"):
            origin = base_load(name).to(torch.float32)
            row = {"name": name, "numel": a.numel()}
            for tag, merged in (("lite", a32), ("mergekit", b32)):
                delta = merged - origin
                row[f"{tag}_frac_base_equal"] = (delta == 0).double().mean().item()
                row[f"{tag}_delta_mean"] = delta.double().mean().item()
                row[f"{tag}_delta_std"] = delta.double().std().item()
            dare_rows.append(row)
    result.update({"max_abs_diff": max_abs, "worst_tensor": worst, "max_abs_value": max_ref,
                   "max_diff_bf16_ulps": round(max_ulp, 2), "frac_elements_differing": differing / max(total, 1)})
    if dare_rows:
        weight = sum(r["numel"] for r in dare_rows)
        summary = {}
        for tag in ("lite", "mergekit"):
            summary[f"{tag}_frac_base_equal"] = sum(r[f"{tag}_frac_base_equal"] * r["numel"] for r in dare_rows) / weight
            summary[f"{tag}_mean_delta_std"] = sum(r[f"{tag}_delta_std"] * r["numel"] for r in dare_rows) / weight
        summary["max_tensor_gap_frac_base_equal"] = max(abs(r["lite_frac_base_equal"] - r["mergekit_frac_base_equal"]) for r in dare_rows)
        summary["max_tensor_rel_gap_delta_std"] = max(abs(r["lite_delta_std"] - r["mergekit_delta_std"]) / max(r["mergekit_delta_std"], 1e-30)
                                                      for r in dare_rows)
        summary["max_tensor_gap_delta_mean"] = max(abs(r["lite_delta_mean"] - r["mergekit_delta_mean"]) for r in dare_rows)
        result["distribution"] = summary
        result["per_tensor"] = dare_rows
    return result


def output_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in weight_files(folder))


# ---------------------------------------------------------------- main

def source_digest(root: Path) -> str:
    """sha256 over mergekit-lite's merge-path sources, to tell which code a result measured."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(list((root / "mergekit_lite").glob("*.py")) + list((root / "cli").glob("*.py"))):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def machine_info() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        info["mergekit_lite_commit"] = subprocess.check_output(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                                               text=True).strip()
        info["mergekit_lite_dirty"] = bool(subprocess.check_output(
            ["git", "-C", str(REPO), "status", "--porcelain", "mergekit_lite", "cli"], text=True).strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        cpu = Path("/proc/cpuinfo").read_text()
        info["cpu_model"] = re.search(r"model name\s*:\s*(.+)", cpu).group(1).strip()
        mem = Path("/proc/meminfo").read_text()
        info["mem_gib"] = round(int(re.search(r"MemTotal:\s*(\d+)", mem).group(1)) / 2**20, 1)
        info["loadavg_at_start"] = Path("/proc/loadavg").read_text().split()[:3]
    except (OSError, AttributeError):
        pass
    return info


def best(runs: list[dict], key: str):
    values = [r[key] for r in runs if r.get("rc") == 0 and key in r]
    return min(values) if values else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1gb", choices=("1gb", "4gb", "tiny"))
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--repeat", type=int, default=2, help="runs per tool and method, best taken (default 2)")
    parser.add_argument("--repeat-below", type=float, default=90.0,
                        help="only repeat runs that took less than this many seconds (default 90)")
    parser.add_argument("--lite-only", action="store_true", help="do not run mergekit")
    parser.add_argument("--mergekit-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="mergekit's compute dtype (default float32, as mergekit-lite computes; output is bf16)")
    parser.add_argument("--mergekit-shard", default="500M",
                        help="mergekit --out-shard-size (PARAMETERS, not bytes: 500M = 1 GB of bf16; default 500M)")
    parser.add_argument("--lite-src", type=Path,
                        help="run mergekit-lite from this copy of the source (a folder holding mergekit_lite/ and cli/, "
                             "put first on PYTHONPATH), to pin the code while others edit the tree")
    parser.add_argument("--skip-compare", action="store_true", help="do not compare the outputs (saves minutes at 4 GB)")
    parser.add_argument("--keep-outputs", action="store_true", help="keep the merged folders in benchmarks/work")
    parser.add_argument("--json", type=Path, help="raw results file (default benchmarks/results-SIZE.json)")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}")
    WORK.mkdir(parents=True, exist_ok=True)
    json_path = args.json or HERE / f"results-{args.size}.json"

    results = {"size": args.size, "machine": machine_info(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "targets": TARGETS, "methods": {}}
    mergekit_ok, mergekit_note = (False, "--lite-only") if args.lite_only else ensure_mergekit()
    if not mergekit_ok and not args.lite_only:
        log(f"SKIPPING mergekit: {mergekit_note}; measuring mergekit-lite only")
    results["mergekit"] = {"available": mergekit_ok, "version_or_reason": mergekit_note,
                           "dtype": args.mergekit_dtype, "out_shard_size": args.mergekit_shard}
    import torch
    results["torch"] = torch.__version__
    log(f"mergekit: {'version ' + mergekit_note if mergekit_ok else 'skipped (' + mergekit_note + ')'}; torch {torch.__version__}")

    lite_env = None
    if args.lite_src:
        lite_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(args.lite_src.resolve()), os.environ.get("PYTHONPATH", "")])}
        results["lite_src"] = {"path": str(args.lite_src), "sha256": source_digest(args.lite_src)}
    else:
        results["lite_src"] = {"path": str(REPO), "sha256": source_digest(REPO)}
    log(f"mergekit-lite source: {results['lite_src']}")

    ckpt = make_checkpoints(args.size)
    results["checkpoint_gb"] = round(sum(output_bytes(ckpt / "base") for _ in [0]) / 1e9, 3)
    results["bounds"] = {}
    out_size = output_bytes(ckpt / "base")
    log("measuring the write bound")
    results["bounds"]["write_s"] = write_bound(out_size)
    results["bounds"]["write_fsync_s"] = write_bound(out_size, fsync=True)
    results["bounds"]["output_bytes"] = out_size

    for method in methods:
        inputs = merge_inputs(method, ckpt)
        entry = {"inputs": [str(p) for p in inputs], "lite": [], "mergekit": []}
        entry["read_bound_s"] = read_bound(inputs)
        entry["read_plus_write_bound_s"] = round(entry["read_bound_s"] + results["bounds"]["write_s"], 3)
        config_file = WORK / f"mergekit-{method}.yml"
        if mergekit_ok:
            import yaml
            config_file.write_text(yaml.safe_dump(mergekit_config(method, ckpt, args.mergekit_dtype), sort_keys=False))
            entry["mergekit_config"] = config_file.read_text()
        outs = {"lite": WORK / f"out-lite-{method}", "mergekit": WORK / f"out-mergekit-{method}"}
        tools = ["lite"] + (["mergekit"] if mergekit_ok else [])
        for rep in range(args.repeat):
            order = tools if rep % 2 == 0 else tools[::-1]
            for tool in order:
                runs = entry[tool]
                if rep > 0 and (not runs or runs[0].get("rc") != 0 or runs[0]["wall_s"] >= args.repeat_below):
                    continue
                out = outs[tool] if rep == 0 else outs[tool].with_name(outs[tool].name + "-rep")
                shutil.rmtree(out, ignore_errors=True)
                command = lite_command(method, ckpt, out) if tool == "lite" else \
                    mergekit_command(config_file, out, args.mergekit_shard)
                run = timed_run(command, WORK / f"{tool}-{method}-{rep}.log", env=lite_env if tool == "lite" else None)
                run["command"] = " ".join(command)
                runs.append(run)
                log(f"{method:<16} {tool:<8} rep {rep}: wall {run.get('wall_s')} s  rss {run.get('peak_rss_mb')} MB  "
                    f"cpu {run.get('cpu_s')} s  rc {run['rc']}")
                if run["rc"] != 0:
                    log(run.get("error_tail", "")[-600:])
                if rep > 0:
                    shutil.rmtree(out, ignore_errors=True)
        for tool in tools:
            entry[f"{tool}_best_wall_s"] = best(entry[tool], "wall_s")
            entry[f"{tool}_best_cpu_s"] = best(entry[tool], "cpu_s")
            entry[f"{tool}_peak_rss_mb"] = best(entry[tool], "peak_rss_mb")
        if not args.skip_compare and mergekit_ok and entry["lite"] and entry["mergekit"] and entry["lite"][0]["rc"] == 0 and entry["mergekit"][0]["rc"] == 0:
            log(f"{method}: comparing outputs")
            entry["agreement"] = compare_outputs(method, outs["lite"], outs["mergekit"], ckpt / "base")
            summary = {k: v for k, v in entry["agreement"].items() if k not in ("per_tensor",)}
            log(f"{method}: {json.dumps(summary)}")
        if not args.keep_outputs:
            for out in outs.values():
                shutil.rmtree(out, ignore_errors=True)
        results["methods"][method] = entry
        json_path.write_text(json.dumps(results, indent=2) + "\n")

    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    results["machine"]["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    log(f"raw results: {json_path}")
    return 0


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def print_table(results: dict) -> None:
    rows = []
    header = ("method", "lite s", "mk s", "lite/mk", "lite cpu", "mk cpu", "cpu l/mk", "lite MB", "mk MB", "rss l/mk",
              "read s", "r+w s", "lite/(r+w)", "max|diff|")
    for method, e in results["methods"].items():
        agreement = e.get("agreement", {})
        if "distribution" in agreement:
            d = agreement["distribution"]
            diff = f"base-eq {d['lite_frac_base_equal']:.3f}/{d['mergekit_frac_base_equal']:.3f}" if method == "dare_ties" \
                else f"{agreement.get('max_abs_diff', float('nan')):.2e}"
        else:
            diff = f"{agreement['max_abs_diff']:.2e}" if "max_abs_diff" in agreement else "-"
        rows.append((method, e.get("lite_best_wall_s"), e.get("mergekit_best_wall_s"),
                     ratio(e.get("lite_best_wall_s"), e.get("mergekit_best_wall_s")),
                     e.get("lite_best_cpu_s"), e.get("mergekit_best_cpu_s"),
                     ratio(e.get("lite_best_cpu_s"), e.get("mergekit_best_cpu_s")),
                     e.get("lite_peak_rss_mb"), e.get("mergekit_peak_rss_mb"),
                     ratio(e.get("lite_peak_rss_mb"), e.get("mergekit_peak_rss_mb")),
                     e["read_bound_s"], e["read_plus_write_bound_s"],
                     ratio(e.get("lite_best_wall_s"), e["read_plus_write_bound_s"]), diff))
    cells = [[("-" if c is None else str(c)) for c in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print()
    print(f"size {results['size']}  (targets: lite/mk time <= {TARGETS['time_ratio']}, rss <= {TARGETS['rss_ratio']}, "
          f"linear lite/(r+w) <= {TARGETS['linear_vs_rw_bound']})")
    for row in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print(f"write bound {results['bounds']['write_s']} s (page cache), {results['bounds']['write_fsync_s']} s (fsync) "
          f"for {results['bounds']['output_bytes'] / 1e9:.2f} GB")


if __name__ == "__main__":
    sys.exit(main())
