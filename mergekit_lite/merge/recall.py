"""RECALL layer-wise merge weights (Wang et al., EMNLP 2025, arXiv 2510.20479).

RECALL merges each layer with its own weights, derived from how closely every
model's hidden representations of that layer agree with those of the reference
model (the newest fine-tune, M_N). Layers where all models still agree end up
averaged, layers where they diverge lean to the models that stay close to the
reference. This module computes those weights (steps 1-4 of the paper):

1. typical samples: k-means over the reference model's representations of the
   candidate texts, one representative text per cluster;
2. layer-wise representations of every model on those samples;
3. per-layer RBF-kernel similarity of every model to the reference;
4. per-layer softmax of the similarities (with a temperature) into weights.

The merge engine applies them per tensor through `RecallWeights.for_tensor`.

Choices where the paper leaves room (all documented at the function concerned):
- a text's representation at a layer is the mean of its real tokens' hidden
  states; the last row is what transformers returns for the last layer, i.e.
  after the final norm, which is also what the "head" tensors act on;
- typical samples are clustered on that last row (the model's final view of a
  text), with distinct representatives so k clusters always yield k samples;
- the RBF width comes from a median heuristic on the reference model's own
  spread between samples, so similarities are scale-free and comparable
  across the models of one layer;
- the similarity is paired (sample i under model A against sample i under the
  reference), averaged over samples.
"""

from __future__ import annotations

import gc
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from mergekit_lite.errors import InputError

KMEANS_ITERATIONS = 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
TENSOR_PARTS = ("layer", "embed", "head")
EMBED_RULES = ("nearest", "average", "base", "reference")


def right_pad(token_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad on the right with a mask, so real tokens keep positions 0..len-1 and,
    under causal attention, never see the padding: no pad token needed."""
    longest = max(len(ids) for ids in token_ids)
    input_ids = torch.zeros(len(token_ids), longest, dtype=torch.long)
    attention_mask = torch.zeros(len(token_ids), longest, dtype=torch.long)
    for row, ids in enumerate(token_ids):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    return input_ids, attention_mask


def masked_token_mean(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens only: [batch, tokens, hidden] -> [batch, hidden] float32."""
    mask = attention_mask.unsqueeze(-1).to(torch.float32)
    return (hidden.to(torch.float32) * mask).sum(dim=1) / mask.sum(dim=1)


def token_mean_hidden_states(
    model, tokenizer, texts: list[str], device="cpu", max_length=256, batch_size=8
) -> torch.Tensor:
    """Each text's token-mean hidden state at every depth, as a CPU float32 tensor
    [n_layers+1, n_texts, hidden]: row 0 is the embedding output, row l+1 the
    output of decoder layer l (the last row after the final norm, as transformers
    returns it). Runs the base model only, so no [tokens, vocab] logits are built."""
    if not texts:
        raise InputError("no texts to compute hidden states for")
    if max_length < 1 or batch_size < 1:
        raise InputError(f"max_length and batch_size must be >= 1, got {max_length} and {batch_size}")
    token_ids = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    empty = [index for index, ids in enumerate(token_ids) if not ids]
    if empty:
        raise InputError(f"text {empty[0]} has no tokens under this tokenizer")
    model.to(device)
    model.eval()
    batches = []
    with torch.inference_mode():
        for start in range(0, len(token_ids), batch_size):
            input_ids, attention_mask = right_pad(token_ids[start : start + batch_size])
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
            outputs = model.base_model(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
            )
            batches.append(torch.stack([masked_token_mean(h, attention_mask).cpu() for h in outputs.hidden_states]))
    return torch.cat(batches, dim=1)


def kmeans_plus_plus_centroids(points: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k-means++ seeding: spread the initial centroids so no blob is left without one.
    When fewer than k distinct points exist, the rest are drawn among unchosen points."""
    chosen = [int(torch.randint(len(points), (1,), generator=generator))]
    nearest_sq = torch.cdist(points, points[chosen]).squeeze(1) ** 2
    while len(chosen) < k:
        weights = nearest_sq.clone()
        weights[chosen] = 0.0
        if weights.sum() <= 0:
            weights = torch.ones(len(points))
            weights[chosen] = 0.0
        index = int(torch.multinomial(weights, 1, generator=generator))
        chosen.append(index)
        nearest_sq = torch.minimum(nearest_sq, torch.cdist(points, points[index : index + 1]).squeeze(1) ** 2)
    return points[chosen].clone()


def select_typical_samples(embeddings: torch.Tensor, k: int, seed: int = 0) -> list[int]:
    """Indices (sorted) of k typical samples: k-means (k-means++ init, seeded,
    KMEANS_ITERATIONS Lloyd steps) on [n, d], then per cluster the sample nearest
    its centroid. A sample already picked for another cluster is skipped, so the
    k indices are distinct. k >= n returns every index."""
    if embeddings.ndim != 2 or len(embeddings) == 0:
        raise InputError(f"expected a non-empty [n, d] tensor to cluster, got shape {tuple(embeddings.shape)}")
    if k < 1:
        raise InputError(f"the number of typical samples must be >= 1, got {k}")
    if k >= len(embeddings):
        return list(range(len(embeddings)))
    points = embeddings.detach().to("cpu", torch.float32)
    generator = torch.Generator().manual_seed(seed)
    centroids = kmeans_plus_plus_centroids(points, k, generator)
    for _ in range(KMEANS_ITERATIONS):
        assignment = torch.cdist(points, centroids).argmin(dim=1)
        sums = torch.zeros_like(centroids).index_add_(0, assignment, points)
        counts = torch.bincount(assignment, minlength=k)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled].unsqueeze(1)
    distances = torch.cdist(centroids, points)
    picked: list[int] = []
    for cluster in range(k):
        nearest_first = distances[cluster].argsort().tolist()
        picked.append(next(index for index in nearest_first if index not in picked))
    return sorted(picked)


def median_heuristic_gamma(*representations: torch.Tensor) -> float:
    """RBF gamma = 1 / median squared distance between different samples of the same
    model (pooled over the tensors given): a drift as large as the typical gap
    between two samples scores exp(-1), whatever the scale of the activations.
    Fallbacks when that median is 0 (one sample, or all samples equal): the mean
    squared norm, then 1."""
    pair_distances = []
    for samples in representations:
        samples = samples.to(torch.float64)
        rows, cols = torch.triu_indices(len(samples), len(samples), offset=1)
        pair_distances.append((torch.cdist(samples, samples) ** 2)[rows, cols])
    pooled = torch.cat(pair_distances)
    scale = float(pooled.median()) if len(pooled) else 0.0
    if scale <= 0:
        scale = float(torch.cat([r.to(torch.float64) for r in representations]).pow(2).sum(dim=1).mean())
    return 1.0 / scale if scale > 0 else 1.0


def rbf_similarity(x: torch.Tensor, y: torch.Tensor, gamma: float | None = None) -> float:
    """Mean over samples of exp(-gamma * ||x_i - y_i||^2), x and y being [n, d]
    representations of the same n samples under two models: 1.0 when they agree,
    towards 0 as they drift. gamma defaults to `median_heuristic_gamma(x, y)`."""
    if x.shape != y.shape or x.ndim != 2:
        raise InputError(
            f"representations must be two [n, d] tensors of one shape, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if gamma is None:
        gamma = median_heuristic_gamma(x, y)
    if gamma <= 0:
        raise InputError(f"RBF gamma must be > 0, got {gamma}")
    squared = (x.to(torch.float64) - y.to(torch.float64)).pow(2).sum(dim=1)
    return float(torch.exp(-gamma * squared).mean())


def layer_weights(
    representations: list[torch.Tensor], reference: int, temperature: float
) -> tuple[list[list[float]], list[list[float]]]:
    """Per layer: each model's RBF similarity to the reference (gamma from the
    reference's own spread, so the models of one layer are scored on one scale),
    then softmax(similarity / temperature) over models. Representations are
    [n_layers+1, n_samples, hidden], one per model, on the same samples."""
    check_merge_settings(len(representations), temperature)
    reference = resolve_reference(reference, len(representations))
    expected = representations[reference].shape
    for index, reps in enumerate(representations):
        if reps.ndim != 3 or reps.shape != expected:
            raise InputError(
                f"model {index} has representations of shape {tuple(reps.shape)} "
                f"(layers+1, samples, hidden), the reference has {tuple(expected)}"
            )
    similarity, weights = [], []
    for layer in range(expected[0]):
        anchor = representations[reference][layer]
        gamma = median_heuristic_gamma(anchor)
        row = [rbf_similarity(reps[layer], anchor, gamma) for reps in representations]
        similarity.append(row)
        weights.append(torch.softmax(torch.tensor(row, dtype=torch.float64) / temperature, dim=0).tolist())
    return similarity, weights


def check_merge_settings(n_models: int, temperature: float) -> None:
    """The settings errors shared by the pure and the loading entry points."""
    if temperature <= 0:
        raise InputError(f"temperature must be > 0, got {temperature}")
    if n_models < 2:
        raise InputError(f"RECALL needs at least 2 models to merge, got {n_models}")


def resolve_reference(reference: int, n_models: int) -> int:
    """Python-style index (-1 = last = newest model) to a plain index."""
    if not -n_models <= reference < n_models:
        raise InputError(f"reference model index {reference} is out of range for {n_models} models")
    return reference % n_models


def one_hot(index: int, size: int) -> list[float]:
    return [1.0 if position == index else 0.0 for position in range(size)]


@dataclass
class RecallWeights:
    """RECALL's per-layer merge weights, with what produced them (for reports and reuse)."""

    models: list[str]
    reference: int
    temperature: float
    similarity: list[list[float]]
    weights: list[list[float]]
    typical_samples: list[int]

    @property
    def n_layers(self) -> int:
        return len(self.weights) - 1

    def for_tensor(self, layer: int | None, part: str, embed_rule: str = "nearest") -> list[float]:
        """Per-model weights for one tensor. part "layer" takes decoder layer `layer`'s row;
        "embed" (before layer 0) and "head" (final norm, lm_head) follow embed_rule:
        "nearest" -> the embedding row / the last row, "average" -> uniform,
        "base" -> all on model 0 (the base), "reference" -> all on the reference."""
        if part not in TENSOR_PARTS:
            raise InputError(f"tensor part must be one of {', '.join(TENSOR_PARTS)}, got {part!r}")
        if embed_rule not in EMBED_RULES:
            raise InputError(f"embed rule must be one of {', '.join(EMBED_RULES)}, got {embed_rule!r}")
        n_models = len(self.models)
        if part == "layer":
            if layer is None or not 0 <= layer < self.n_layers:
                raise InputError(f"layer index {layer} is out of range for {self.n_layers} layers")
            return list(self.weights[layer + 1])
        if embed_rule == "nearest":
            return list(self.weights[0] if part == "embed" else self.weights[-1])
        if embed_rule == "average":
            return [1.0 / n_models] * n_models
        if embed_rule == "base":
            return one_hot(0, n_models)
        return one_hot(self.reference, n_models)

    def with_temperature(self, temperature: float) -> RecallWeights:
        """The same similarities re-weighted at another temperature: the similarities do not
        depend on it, so a sweep over temperatures runs the models once."""
        check_merge_settings(len(self.models), temperature)
        weights = [
            torch.softmax(torch.tensor(row, dtype=torch.float64) / temperature, dim=0).tolist()
            for row in self.similarity
        ]
        return replace(self, temperature=temperature, weights=weights)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d) -> RecallWeights:
        missing = [name for name in cls.__dataclass_fields__ if name not in d]
        if missing:
            raise InputError(f"RECALL weights JSON lacks the field(s): {', '.join(missing)}")
        return cls(
            models=[str(model) for model in d["models"]],
            reference=int(d["reference"]),
            temperature=float(d["temperature"]),
            similarity=[[float(value) for value in row] for row in d["similarity"]],
            weights=[[float(value) for value in row] for row in d["weights"]],
            typical_samples=[int(index) for index in d["typical_samples"]],
        )


def find_tokenizer_dir(model_dirs: list[str], reference: int) -> str:
    """The reference model's directory if it holds a tokenizer, else the first that does:
    fine-tunes often ship without one, and all of them share the base's vocabulary."""
    candidates = [model_dirs[reference]] + [d for i, d in enumerate(model_dirs) if i != reference]
    for directory in candidates:
        if any((Path(directory) / name).is_file() for name in TOKENIZER_FILES):
            return directory
    raise InputError(f"none of the model directories holds a tokenizer ({', '.join(TOKENIZER_FILES)})")


def check_same_architecture(model_dirs: list[str]) -> None:
    """Fail before loading any weights if layer counts or hidden sizes differ."""
    from transformers import AutoConfig

    shapes = []
    for directory in model_dirs:
        config = AutoConfig.from_pretrained(directory).get_text_config()
        shapes.append((config.num_hidden_layers, config.hidden_size))
    for directory, (n_layers, hidden) in zip(model_dirs, shapes):
        if (n_layers, hidden) != shapes[0]:
            raise InputError(
                f"{directory} has {n_layers} layers of size {hidden}, "
                f"{model_dirs[0]} has {shapes[0][0]} of size {shapes[0][1]}: RECALL needs one architecture"
            )


def model_representations(model_dir: str, tokenizer, texts: list[str], device: str, max_length: int) -> torch.Tensor:
    """Load one model, represent the texts, free it: peak memory stays one model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    representations = token_mean_hidden_states(model, tokenizer, texts, device=device, max_length=max_length)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return representations


def compute_recall_weights(
    model_dirs: list[str],
    texts: list[str],
    n_typical: int = 8,
    temperature: float = 0.5,
    reference: int = -1,
    device: str = "cpu",
    seed: int = 0,
    max_length: int = 256,
) -> RecallWeights:
    """RECALL steps 1-4: typical samples picked under the reference model (clustered on
    its last-row representations), every other model represented on those samples,
    then per-layer similarities and weights. Models load one at a time, in float32."""
    from transformers import AutoTokenizer

    check_merge_settings(len(model_dirs), temperature)
    if not texts:
        raise InputError("no texts to pick typical samples from")
    reference = resolve_reference(reference, len(model_dirs))
    check_same_architecture(model_dirs)
    tokenizer = AutoTokenizer.from_pretrained(find_tokenizer_dir(model_dirs, reference))

    reference_all = model_representations(model_dirs[reference], tokenizer, texts, device, max_length)
    typical = select_typical_samples(reference_all[-1], n_typical, seed=seed)
    typical_texts = [texts[index] for index in typical]
    representations = [
        reference_all[:, typical] if index == reference
        else model_representations(directory, tokenizer, typical_texts, device, max_length)
        for index, directory in enumerate(model_dirs)
    ]
    similarity, weights = layer_weights(representations, reference, temperature)
    return RecallWeights(
        models=[str(directory) for directory in model_dirs],
        reference=reference,
        temperature=temperature,
        similarity=similarity,
        weights=weights,
        typical_samples=typical,
    )


def read_texts(path) -> list[str]:
    """Candidate texts: one per non-empty line, or, for a .jsonl file, each line's "text" field."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"text file not found: {path}")
    lines = [(number, line.strip()) for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)]
    lines = [(number, line) for number, line in lines if line]
    if path.suffix == ".jsonl":
        texts = [jsonl_text(line, number, path) for number, line in lines]
    else:
        texts = [line for _, line in lines]
    texts = [text for text in texts if text.strip()]
    if not texts:
        raise InputError(f"no texts in {path}")
    return texts


def jsonl_text(line: str, number: int, path: Path) -> str:
    """The "text" field of one JSONL record, or an error naming the line."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise InputError(f"{path}:{number} is not valid JSON ({error.msg})") from error
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise InputError(f'{path}:{number} has no string "text" field')
    return record["text"]
