"""A batch audit: 50 real PEFT adapters on one base, seconds per adapter and peak memory against the batch size.

    . .venv/bin/activate && python benchmarks/bench_audit_batch.py            # --adapters 50 --hidden 256

Builds a seeded Llama (hidden --hidden, 4 layers), ships its fingerprint, trains --adapters PEFT LoRA adapters on it
(q/k/v/o/up/down, one Adam step each, so every one is a real non-zero update), then runs the CLI
(`mergekit-lite audit DIR --base BASE --json -q`) in a fresh process on the first 1, 10 and all of them. Each run's
peak RSS is the child's own (resource.getrusage(RUSAGE_CHILDREN) of an intermediate process that only waits on it).
Flat memory means the peak does not grow with the number of adapters. Writes benchmarks/work/audit-batch/ (git-ignored)
and prints a Markdown table for RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

WORK = Path(__file__).resolve().parent / "work" / "audit-batch"
CLI = Path(sys.executable).parent / "mergekit-lite"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
WAIT_AND_MEASURE = (
    "import resource, subprocess, sys; run = subprocess.run(sys.argv[1:], capture_output=True); "
    "print(run.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def build(count: int, hidden: int) -> tuple[Path, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from mergekit_lite.audits.fingerprint import FINGERPRINT_FILE, compute_fingerprint, write_fingerprint

    base_dir, adapters = WORK / "base", WORK / "adapters"
    if WORK.exists():
        shutil.rmtree(WORK)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(base_dir)
    write_fingerprint(compute_fingerprint(base_dir, behaviour=False), WORK / FINGERPRINT_FILE)
    for index in range(count):
        model = get_peft_model(
            LlamaForCausalLM.from_pretrained(base_dir), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)
        )
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(index))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        folder = adapters / f"adapter-{index:03d}"
        model.save_pretrained(folder)
        shutil.copy(WORK / FINGERPRINT_FILE, folder / FINGERPRINT_FILE)
    return base_dir, adapters


def audit(base_dir: Path, adapters: list[Path]) -> tuple[float, int, int]:
    """(seconds, peak RSS in MiB, exit status) of one CLI run over these adapters."""
    command = [str(CLI), "audit", *map(str, adapters), "--base", str(base_dir), "--min-total-norm", "0", "--json", "-q"]
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", WAIT_AND_MEASURE, *command], capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - started
    status, peak_kib = map(int, run.stdout.split())
    return seconds, peak_kib // 1024, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    base_dir, adapter_root = build(args.adapters, args.hidden)
    adapters = sorted(adapter_root.iterdir())
    rows = []
    for count in sorted({1, min(10, len(adapters)), len(adapters)}):
        seconds, peak, status = audit(base_dir, adapters[:count])
        rows.append(
            {
                "adapters": count,
                "seconds": seconds,
                "seconds_per_adapter": seconds / count,
                "peak_rss_mib": peak,
                "exit": status,
            }
        )
    one = rows[0]["seconds"]
    (WORK / "results.json").write_text(json.dumps(rows, indent=2))
    print(f"base: Llama hidden {args.hidden}, 4 layers; adapters: r=8 on {', '.join(TARGETS)}")
    print("| adapters | wall s | s per adapter | s per added adapter (vs 1) | peak RSS MiB | exit |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        added = "-" if row["adapters"] == 1 else f"{(row['seconds'] - one) / (row['adapters'] - 1):.3f}"
        print(
            f"| {row['adapters']} | {row['seconds']:.1f} | {row['seconds_per_adapter']:.3f} | {added} | "
            f"{row['peak_rss_mib']} | {row['exit']} |"
        )


if __name__ == "__main__":
    main()
