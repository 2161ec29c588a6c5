"""Tiny real models shared by the tests: seeded Llamas and PEFT adapters trained a few real steps."""

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 100


def tiny_llama(seed: int = 0, hidden_size: int = 32, **overrides) -> LlamaForCausalLM:
    """A 2-layer Llama with untied head, seeded: same seed, same weights."""
    torch.manual_seed(seed)
    settings = dict(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(LlamaConfig(**{**settings, **overrides}))


def save_tiny_llama(seed: int, folder: Path, max_shard_size: str | None = "20KB", **overrides) -> Path:
    """Save a tiny Llama, sharded by default so streaming code sees several shards and an index."""
    options = {"max_shard_size": max_shard_size} if max_shard_size else {}
    tiny_llama(seed, **overrides).save_pretrained(folder, **options)
    return Path(folder)


def train_lora(peft_model, steps: int, seed: int, batch: tuple[int, int] = (2, 12)):
    """A few Adam steps on random tokens so lora_B is non-zero (0 steps: B stays zero, a no-op adapter)."""
    optimizer = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, batch, generator=generator)
        peft_model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return peft_model
