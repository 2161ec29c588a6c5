"""Tiny real models shared by the tests: seeded Llamas and PEFT adapters trained a few real steps."""

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 100


def tiny_llama(seed: int = 0, hidden_size: int = 32, **overrides) -> LlamaForCausalLM:
    """A 2-layer Llama with untied head, seeded: same seed, same weights."""
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(LlamaConfig(**{**settings, **overrides}))


def save_tiny_llama(seed: int, folder: Path, max_shard_size: str | None = "20KB", **overrides) -> Path:
    """Save a tiny Llama, sharded by default so streaming code sees several shards and an index."""
    options = {"max_shard_size": max_shard_size} if max_shard_size else {}
    tiny_llama(seed, **overrides).save_pretrained(folder, **options)
    return Path(folder)


def save_random_pair(root: Path, n_tensors: int, shape: tuple[int, int]) -> tuple[Path, Path]:
    """Two seeded single-file models of `n_tensors` float32 layer weights, big enough to interrupt midway."""
    paths = []
    for seed, name in enumerate(("a", "b")):
        generator = torch.Generator().manual_seed(seed)
        (root / name).mkdir()
        save_file(
            {f"model.layers.{i}.mlp.weight": torch.randn(*shape, generator=generator) for i in range(n_tensors)},
            root / name / "model.safetensors",
            metadata={"format": "pt"},
        )
        paths.append(root / name)
    return paths[0], paths[1]


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


def _text(**extra) -> dict:
    """Tiny decoder settings every architecture below shares: hidden 16, 2 layers, vocab VOCAB."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )


def _gemma3_multimodal():
    from transformers import Gemma3Config

    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14
    )
    return Gemma3Config(
        text_config=_text(head_dim=8, sliding_window=8),
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=97,
        eoi_token_index=98,
        image_token_index=99,
    )


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2)


def _config(class_name: str, **extra):
    def build():
        import transformers

        return getattr(transformers, class_name)(**_text(**extra))

    return build


# architecture -> (model class name, config factory): one tiny random-initialised model each
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", _config("LlamaConfig", tie_word_embeddings=False)),
    "qwen2_tied": ("Qwen2ForCausalLM", _config("Qwen2Config", tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", _config("Qwen3Config", head_dim=8, tie_word_embeddings=False)),
    "mistral": ("MistralForCausalLM", _config("MistralConfig", tie_word_embeddings=False)),
    "gemma2": ("Gemma2ForCausalLM", _config("Gemma2Config", head_dim=8, sliding_window=8)),
    "gemma3_multimodal": ("Gemma3ForConditionalGeneration", _gemma3_multimodal),
    "phi3": ("Phi3ForCausalLM", _config("Phi3Config", tie_word_embeddings=False)),
    "gpt2": ("GPT2LMHeadModel", _gpt2),
    "olmo2": ("Olmo2ForCausalLM", _config("Olmo2Config", tie_word_embeddings=False)),
    "mixtral": (
        "MixtralForCausalLM",
        _config("MixtralConfig", num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        _config(
            "Qwen2MoeConfig",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            tie_word_embeddings=False,
        ),
    ),
}


def tiny_model(architecture: str, seed: int = 0, shift: float = 0.0):
    """A seeded tiny model of `architecture`; `shift` > 0 adds seeded noise of that scale to every weight
    (a stand-in fine-tune of the seed-0 model with the same tying)."""
    import transformers

    class_name, make_config = ARCHITECTURES[architecture]
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(make_config())
    if shift:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * shift)
    return model.eval()
