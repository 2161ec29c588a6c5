"""Run the model: what the adapter does to the base's next-token distribution on a few probe inputs.

Aharon et al., App. I ("output divergence"): the mean first-token KL between base and base+adapter over a
fixed set of prompts; below ~1e-3 the adapter is a no-op, very large (20 nats in the authors' code)
suggests it was made for another base. The direction is theirs, KL(base || base+adapter) (the authors'
src/audit_checks.py, check_output_divergence: base probabilities weight the log-ratio), which is what their
1e-3 and 20-nat thresholds were read on; KL is not symmetric, and on a confident base the other direction
can pass the 20-nat limit where the paper's stays below it (tests/test_audit.py), so it would call real
adapters "another base" long before the paper does. The other direction is kept as a measurement only.
We do the arithmetic in float32 with log-softmax (their code adds 1e-12 to bf16 probabilities, which can
give a negative KL).

Stronger than the paper (ours): a base fingerprint also records the base's own first-token distribution
on the same probe token ids (its top tokens). On tiny models we measured that an adapter made on another
base moves the given base no more than a real one does (see tests/test_audit.py), so the adapter's KL
alone cannot tell a wrong base; the base's divergence from the fingerprinted base's recorded
distribution can.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from mergekit_lite import interrupts
from mergekit_lite.errors import InputError

# Short, varied prompts (facts, arithmetic, code, dialogue, prose); the same for every adapter so the numbers compare.
PROBE_TEXTS = (
    "The capital city of Japan is",
    "Seven plus five equals",
    "def add(a, b):\n    return",
    "User: Can you help me plan a trip?\nAssistant:",
    "In the morning the river was calm and",
    "Water boils at a temperature of",
    "import numpy as",
    "The opposite of hot is",
)
SEEDED_PROBE_LENGTH = 8  # tokens per probe when the base has no tokenizer: seeded ids instead of texts
PROBE_SEED = 0
REFERENCE_TOP_K = 32  # tokens of the base's distribution a fingerprint records per probe


@dataclass
class Divergence:
    """Per-probe first-token KL(base || base+adapter) (the paper's direction), the reverse KL (recorded only), and
    whether the greedy token stayed the same."""

    kl: list[float]
    same_top1: list[bool]
    base_vs_reference_kl: list[float] | None  # the given base against the fingerprinted one, if recorded
    reverse_kl: list[float] | None = None  # KL(base+adapter || base): reported, never held to a threshold

    @property
    def mean_kl(self) -> float:
        return sum(self.kl) / len(self.kl)

    @property
    def mean_reverse_kl(self) -> float | None:
        return None if self.reverse_kl is None else sum(self.reverse_kl) / len(self.reverse_kl)

    @property
    def top1_agreement(self) -> float:
        return sum(self.same_top1) / len(self.same_top1)

    @property
    def mean_base_kl(self) -> float | None:
        values = self.base_vs_reference_kl
        return None if values is None else sum(values) / len(values)


def load_causal_lm(base_dir, device: str):
    """The base as a transformers model in float32, or InputError naming why it cannot run."""
    from transformers import AutoModelForCausalLM

    try:
        with interrupts.deferred():  # transformers builds the model through torch's device modes: see interrupts
            model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    except Exception as error:  # transformers raises many types for an unloadable folder
        raise InputError(
            f"{base_dir}: cannot load the base as a causal LM for the behavioural check "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200]})"
        ) from None
    return model.to(device).eval()


def probe_ids(base_dir, vocab_size: int) -> tuple[list[list[int]], str]:
    """Probe token ids: PROBE_TEXTS through the base's tokenizer, or seeded ids when it has none."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    except Exception:  # no tokenizer files: fall back to seeded ids, said in the report
        tokenizer = None
    if tokenizer is not None:
        return [tokenizer(text)["input_ids"] for text in PROBE_TEXTS], "probe texts through the base's tokenizer"
    generator = torch.Generator().manual_seed(PROBE_SEED)
    ids = torch.randint(0, vocab_size, (len(PROBE_TEXTS), SEEDED_PROBE_LENGTH), generator=generator)
    return ids.tolist(), "seeded token ids (the base has no tokenizer)"


@torch.no_grad()
def first_token_logprobs(model, probes: list[list[int]]) -> torch.Tensor:
    """log p(next token | probe) for each probe, one forward each (no padding to get wrong), float32 on CPU."""
    device = next(model.parameters()).device
    rows = [model(input_ids=torch.tensor([ids], device=device)).logits[0, -1] for ids in probes]
    return torch.log_softmax(torch.stack(rows).float(), dim=-1).cpu()


def kl_divergence(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row from log-probabilities."""
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp_min(0.0)


def reference_of(logprobs: torch.Tensor, probes: list[list[int]]) -> dict:
    """What a fingerprint records: the probe ids and each probe's top tokens with their log-probabilities."""
    k = min(REFERENCE_TOP_K, logprobs.shape[-1])
    top = logprobs.topk(k, dim=-1)
    return {
        "probe_ids": probes,
        "top_ids": top.indices.tolist(),
        "top_logprobs": [[float(f"{v:.7g}") for v in row] for row in top.values.tolist()],
    }


def kl_to_reference(logprobs: torch.Tensor, reference: dict) -> list[float]:
    """KL(reference || base) per probe over the reference's top tokens, both renormalised on them."""
    ids = torch.tensor(reference["top_ids"])
    if int(ids.max()) >= logprobs.shape[-1]:
        return [float("inf")] * len(ids)
    recorded = torch.log_softmax(torch.tensor(reference["top_logprobs"]), dim=-1)
    measured = torch.log_softmax(logprobs.gather(1, ids), dim=-1)
    return kl_divergence(recorded, measured).tolist()


def apply_adapter_(model, adapter) -> list[str]:
    """Merge the adapter into the model's own weights (LoraAdapter.apply) and put in replaced tensors; names it has
    no parameter for come back."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    skipped = []
    with torch.no_grad():
        for name in adapter.targets():
            if name in parameters:
                parameters[name].copy_(adapter.apply(name, parameters[name].detach().cpu()))
            else:
                skipped.append(name)
        head = model.get_output_embeddings()
        for name in adapter.replaced():
            if name == "lm_head.weight" and head is not None:
                head.weight = torch.nn.Parameter(adapter.replacement(name).to(torch.float32).to(head.weight.device))
            elif name in parameters:
                if (
                    head is not None
                    and head.weight is parameters[name]
                    and not adapter.config.get("ensure_weight_tying")
                ):
                    head.weight = torch.nn.Parameter(head.weight.detach().clone())  # PEFT trains a copy; the head stays
                parameters[name].copy_(adapter.replacement(name))
            else:
                skipped.append(name)
    return skipped


@contextmanager
def adapted(model, adapter):
    """The model with the adapter applied (apply_adapter_) inside the block, and its own weights back after it, so
    one loaded base serves a whole batch of adapters."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    touched = [name for name in adapter.targets() + adapter.replaced() if name in parameters]
    saved = {name: parameters[name].detach().clone() for name in touched}
    head = model.get_output_embeddings()
    head_weight = head.weight if head is not None else None
    try:
        yield apply_adapter_(model, adapter)
    finally:
        if head is not None:
            head.weight = head_weight
        with torch.no_grad():
            for name, value in saved.items():
                parameters[name].copy_(value)


def measure_divergence(
    base_dir, adapter, device: str = "cpu", reference: dict | None = None, model=None
) -> tuple[Divergence, str, list[str]]:
    """Base and base+adapter on the same probes (the fingerprint's ids when it has them); also base vs reference.
    `model`: the base already loaded (a batch loads it once); it is given back unchanged."""
    model = model if model is not None else load_causal_lm(base_dir, device)
    if reference is not None:
        probes, how = reference["probe_ids"], "the fingerprint's probe token ids"
    else:
        probes, how = probe_ids(base_dir, model.config.get_text_config().vocab_size)
    base = first_token_logprobs(model, probes)
    base_vs_reference = kl_to_reference(base, reference) if reference is not None else None
    with adapted(model, adapter) as skipped:
        adapted_logprobs = first_token_logprobs(model, probes)
    # KL(base || base+adapter), as the authors' check_output_divergence computes it (src/audit_checks.py)
    divergence = Divergence(
        kl_divergence(base, adapted_logprobs).tolist(),
        (adapted_logprobs.argmax(-1) == base.argmax(-1)).tolist(),
        base_vs_reference,
        reverse_kl=kl_divergence(adapted_logprobs, base).tolist(),
    )
    return divergence, how, skipped


def record_reference(base_dir, device: str = "cpu") -> dict:
    """The base's first-token distribution on the probes, for a fingerprint."""
    model = load_causal_lm(base_dir, device)
    probes, how = probe_ids(Path(base_dir), model.config.get_text_config().vocab_size)
    return {**reference_of(first_token_logprobs(model, probes), probes), "probes": how}
