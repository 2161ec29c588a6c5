"""Per-point merge time of a sweep: how long one alpha takes to become the model the evaluation scores.

Three ways, on the demo pair (`mergekit_lite.toy`, built or reused under benchmarks/work/toy), on a
random Llama pair of --hidden size (8 layers, post = pre + noise, under benchmarks/work/), or on any
--pre/--post pair; median of --repeat points per method after one warm-up:
- state dict: the engine merges every tensor into a new state dict, which is loaded into the model
  (what the sweep did in memory before the resident pair);
- streamed: the merge is written to a folder and the model loaded from it with from_pretrained
  (the sweep's path for models that do not fit in memory);
- in place: the resident pair writes the point into the model's parameters (the sweep's path now).
The model is in the sweep's evaluation dtype (--eval-dtype, default float32 on CPU).

    python benchmarks/sweep_point_merge.py [--hidden 1024 | --pre DIR --post DIR] [--repeat 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mergekit_lite.audited import merge_state_dict, run_merge
from mergekit_lite.io.sources import open_inputs
from mergekit_lite.sweep import SweepSettings
from mergekit_lite.sweep.models import ModelLoader, ResidentPair
from mergekit_lite.toy import build_toy_pair

METHODS = {"linear": {}, "task_arithmetic": {}, "ties": {"density": 0.5}, "dare_ties": {"drop": 0.5}}


def seconds(action, repeat: int) -> float:
    """Median wall time of `repeat` calls, after one warm-up call."""
    action()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def random_pair(hidden: int) -> tuple[str, str]:
    """A float32 Llama of `hidden` size, 8 layers, and the same plus N(0, 0.002^2) noise: built once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = Path(__file__).parent / "work" / f"sweep-llama-{hidden}"
    pre, post = root / "pre", root / "post"
    if not (post / "config.json").is_file():
        torch.manual_seed(0)
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=8000,
                hidden_size=hidden,
                intermediate_size=hidden * 8 // 3,
                num_hidden_layers=8,
                num_attention_heads=hidden // 64,
                num_key_value_heads=hidden // 256 or 1,
                tie_word_embeddings=False,
            )
        )
        model.save_pretrained(pre)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.002)
        model.save_pretrained(post)
    return str(pre), str(post)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pre")
    parser.add_argument("--post")
    parser.add_argument("--hidden", type=int, help="benchmark a random Llama pair of this hidden size instead")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--eval-dtype", default=None)
    args = parser.parse_args()
    if args.hidden:
        args.pre, args.post = random_pair(args.hidden)
    elif not args.pre:
        pair = build_toy_pair(Path(__file__).parent / "work" / "toy", seed=0)
        args.pre, args.post = str(pair.pre_dir), str(pair.post_dir)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="sweep-point-"))
    try:
        print(f"pre {args.pre}\npost {args.post}\n")
        print(
            "| method | state dict + load_state_dict (s) | streamed + from_pretrained (s) | in place (s) | speed-up vs state dict |"
        )
        print("|---|---|---|---|---|")
        for method, options in METHODS.items():
            settings = SweepSettings(
                args.pre,
                args.post,
                method,
                [0.5],
                ["old"],
                ["new"],
                None,
                str(work / "run"),
                eval_dtype=args.eval_dtype,
                **options,
            )
            config = settings.merge_config(0.5)
            sources = open_inputs([args.pre, args.post], args.pre, allow_pickle=False)
            loader = ModelLoader(args.pre, getattr(torch, settings.eval_dtype), "cpu")
            resident = ResidentPair(loader, settings, sources, config)
            model = resident.model

            def via_state_dict():
                model.load_state_dict(merge_state_dict(config, sources), strict=False)

            def streamed():
                run_merge(config, work / "merged", overwrite=True)
                loader.from_folder(work / "merged")

            before = seconds(via_state_dict, args.repeat)
            disk = seconds(streamed, args.repeat)
            now = seconds(lambda: resident.write(config), args.repeat)
            print(f"| {method} | {before:.4f} | {disk:.4f} | {now:.4f} | {before / now:.1f}x |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
