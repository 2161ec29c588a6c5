#!/usr/bin/env python3
"""Make synthetic Llama-shaped bf16 checkpoints for the merge benchmark.

Writes a base model and N fine-tunes (base + small random task vectors) as HF model folders:
config.json of a LlamaForCausalLM, sharded safetensors and model.safetensors.index.json.

Nothing holds a whole model: every tensor is generated from its own seed (derived from the checkpoint
size, the tensor name and the role), so a fine-tune's tensor is regenerated from the same base values
instead of being kept around. At most one output shard is in memory at a time.

    python benchmarks/make_checkpoints.py --size 1gb --out benchmarks/work/ckpt-1gb
    python benchmarks/make_checkpoints.py --size 4gb --out benchmarks/work/ckpt-4gb

Sizes (bf16, hidden 2048, 16 heads / 4 KV heads, intermediate 5632, vocab 32000, untied head):
  1gb: 8 layers  -> 0.98 GB per checkpoint
  4gb: 42 layers -> 4.06 GB per checkpoint (same tensor shapes, more layers: the largest
       tensor is the same, so a streaming merge's peak memory should not change)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

PRESETS = {
    "1gb": dict(hidden=2048, layers=8, intermediate=5632, vocab=32000, heads=16, kv_heads=4),
    "4gb": dict(hidden=2048, layers=42, intermediate=5632, vocab=32000, heads=16, kv_heads=4),
    "tiny": dict(hidden=256, layers=2, intermediate=688, vocab=1000, heads=4, kv_heads=2),
}
WEIGHT_STD = 0.02  # base weights ~ N(0, 0.02^2), like an initialized Llama
DELTA_STD = 0.002  # task vectors: 10% of the weights' scale (survives bf16 rounding)
SHARED = 0.5  # share of each task vector common to all fine-tunes (partial sign agreement)


def llama_tensors(hidden, layers, intermediate, vocab, heads, kv_heads) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and shapes in HF's order for LlamaForCausalLM."""
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    names = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (intermediate, hidden)),
            (p + "mlp.up_proj.weight", (intermediate, hidden)),
            (p + "mlp.down_proj.weight", (hidden, intermediate)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    names += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return names


def llama_config(hidden, layers, intermediate, vocab, heads, kv_heads) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "initializer_range": WEIGHT_STD,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "transformers_version": "4.45.0",
    }


def _generator(*parts) -> torch.Generator:
    digest = hashlib.sha256("\0".join(map(str, parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def make_tensor(tag: str, name: str, shape: tuple[int, ...], finetune: int) -> torch.Tensor:
    """Checkpoint `finetune` (0 = base) of one tensor, in bf16. Deterministic per (tag, name, finetune)."""
    is_norm = len(shape) == 1
    if is_norm:
        value = torch.ones(shape, dtype=torch.float32)
    else:
        value = torch.randn(shape, generator=_generator(tag, name, "base"), dtype=torch.float32).mul_(WEIGHT_STD)
    if finetune:
        scale = DELTA_STD * (5 if is_norm else 1)
        shared = torch.randn(shape, generator=_generator(tag, name, "shared"), dtype=torch.float32)
        own = torch.randn(shape, generator=_generator(tag, name, "own", finetune), dtype=torch.float32)
        # shared*a + own*b with a^2 + b^2 = 1: unit variance, correlation SHARED between fine-tunes
        value.add_(shared.mul_(math.sqrt(SHARED)).add_(own, alpha=math.sqrt(1 - SHARED)), alpha=scale)
        del shared, own
    return value.to(torch.bfloat16)


def split_shards(tensors, max_bytes: int):
    shards, filled = [[]], 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * 2
        if shards[-1] and filled + nbytes > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].append((name, shape))
        filled += nbytes
    return shards


def write_checkpoint(folder: Path, tag: str, finetune: int, dims: dict, shard_bytes: int) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = llama_tensors(**dims)
    shards = split_shards(tensors, shard_bytes)
    count = len(shards)
    weight_map, total = {}, 0
    for index, shard in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        state = {name: make_tensor(tag, name, shape, finetune) for name, shape in shard}
        total += sum(t.numel() * 2 for t in state.values())
        save_file(state, str(folder / file_name), metadata={"format": "pt"})
        del state
        weight_map.update({name: file_name for name, _ in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(llama_config(**dims), indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(PRESETS), default="1gb", help="checkpoint size preset (default 1gb)")
    parser.add_argument("--layers", type=int, help="override the preset's layer count")
    parser.add_argument("--finetunes", type=int, default=2, help="fine-tunes besides the base (default 2)")
    parser.add_argument("--shard-size-mb", type=int, default=300, help="largest input shard in MB (default 300)")
    parser.add_argument("--out", required=True, type=Path, help="folder for base/, ft1/, ft2/ ...")
    parser.add_argument("--force", action="store_true", help="rewrite checkpoints that already exist")
    args = parser.parse_args(argv)

    torch.set_num_threads(max(1, torch.get_num_threads()))
    dims = dict(PRESETS[args.size])
    if args.layers:
        dims["layers"] = args.layers
    tag = json.dumps(dims, sort_keys=True)
    stamp = {
        "dims": dims,
        "finetunes": args.finetunes,
        "shard_size_mb": args.shard_size_mb,
        "weight_std": WEIGHT_STD,
        "delta_std": DELTA_STD,
        "shared": SHARED,
    }
    stamp_file = args.out / "checkpoints.json"
    if not args.force and stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        print(f"{args.out}: checkpoints already made ({stamp_file}); --force rewrites them")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    stamp_file.unlink(missing_ok=True)
    for finetune in range(args.finetunes + 1):
        folder = args.out / ("base" if finetune == 0 else f"ft{finetune}")
        started = time.perf_counter()
        total = write_checkpoint(folder, tag, finetune, dims, args.shard_size_mb * 10**6)
        print(f"{folder}: {total / 1e9:.3f} GB in {time.perf_counter() - started:.1f} s", flush=True)
    stamp_file.write_text(json.dumps(stamp, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
