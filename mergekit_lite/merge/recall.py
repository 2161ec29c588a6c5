"""RECALL: REpresentation-aligned Catastrophic-forgetting ALLeviation via Hierarchical Model Merging
(Wang et al., EMNLP 2025 main, pp. 16392-16406, ACL Anthology 2025.emnlp-main.829, arXiv 2510.20479),
plus our layer-wise LERP driven by the same measurements (`recall_lerp`).

What the paper specifies, with the source we could read. Section 3's equations were not reachable from
this project (only the abstract, the Figure 4 caption as quoted in public reviews, and summaries that
name the kernel), so every point says where it rests:
- typical samples come from clustering the candidate texts ("clustered typical samples", abstract);
  their hidden states are taken from the newest fine-tune M_N, the reference (Fig. 4, stage 1);
- a model is represented by its layer-wise hidden states on those samples (abstract);
- similarity is an RBF kernel on those representations (summaries of the paper; not read first-hand);
- similarities are computed for every model against M_N, M_N included (Fig. 4, stage 2: "pairwise
  representational similarities across all models (including M_N)"), so M_N scores 1 against itself;
- each layer's weights are the softmax of its similarities (Fig. 4, stage 3), and each layer's
  parameters are merged with its own weights (Fig. 4, stage 4; "hierarchical parameter fusion").

Ours, because the text we could read does not say (each documented at its function):
- k-means (k-means++ seeding) on the reference's last row, one distinct representative per cluster;
- a text's representation is the mean hidden state of its tokens, special tokens (BOS) left out by
  default: BOS sits at position 0 and sees nothing else, so it is identical for every text and pulls
  all samples together;
- the RBF bandwidth: `median` (per layer, median squared distance between the reference's samples,
  the usual median heuristic) or a fixed sigma; the rule and the sigmas are stored with the weights;
- sample i under one model is compared with sample i under the reference, averaged over samples;
- a softmax temperature (default 1.0 = the plain softmax), the coefficient a sweep varies;
- embeddings and head (final norm, lm_head) take the embedding row / the last row ("nearest").

A consequence worth knowing: with two models, M_N's self-similarity of 1 is the largest, so pre's
weight 1/(1+exp((1-s)/T)) never exceeds 0.5, and it is smallest where the drift was largest. Plain
RECALL cannot bring a layer back to pre; `recall_lerp` (our extension, see `layer_alphas`) can.
"""

from __future__ import annotations

import gc
import json
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from mergekit_lite import interrupts
from mergekit_lite.errors import InputError
from mergekit_lite.io.validation import check_folder_files, read_text, require_regular
from mergekit_lite.merge.methods.recall import EMBED_RULES, MEDIAN_BANDWIDTH, check_bandwidth

KMEANS_ITERATIONS = 30
DEFAULT_TEMPERATURE = 1.0  # the plain softmax of Fig. 4, stage 3
UNIFORM_SPREAD = 0.01  # all similarities within this of 1: the weights are close to uniform at any temperature
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
TENSOR_PARTS = ("layer", "embed", "head")


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


def masked_token_mean(hidden: torch.Tensor, mean_mask: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens the mask keeps: [batch, tokens, hidden] -> [batch, hidden] float32."""
    mask = mean_mask.unsqueeze(-1).to(torch.float32)
    return (hidden.to(torch.float32) * mask).sum(dim=1) / mask.sum(dim=1)


def token_mean_hidden_states(
    model, tokenizer, texts: list[str], device="cpu", max_length=256, batch_size=8, special_tokens=False
) -> torch.Tensor:
    """Each text's token-mean hidden state at every depth, as a CPU float32 tensor
    [n_layers+1, n_texts, hidden]: row 0 is the embedding output, row l+1 the
    output of decoder layer l (the last row after the final norm, as transformers
    returns it). Runs the base model only, so no [tokens, vocab] logits are built.

    Special tokens (BOS, EOS the tokenizer adds) take part in attention but not in the
    mean unless `special_tokens` (ours: BOS is the same vector for every text at the
    embeddings and an attention sink later, so it makes all texts look alike)."""
    if not texts:
        raise InputError("no texts to compute hidden states for")
    if max_length < 1 or batch_size < 1:
        raise InputError(f"max_length and batch_size must be >= 1, got {max_length} and {batch_size}")
    encoded = tokenizer(texts, truncation=True, max_length=max_length, return_special_tokens_mask=True)
    token_ids = encoded["input_ids"]
    kept = [[1 if special_tokens else 1 - flag for flag in flags] for flags in encoded["special_tokens_mask"]]
    empty = [index for index, keep in enumerate(kept) if not any(keep)]
    if empty:
        raise InputError(f"text {empty[0]} has no tokens besides special ones under this tokenizer")
    model.to(device)
    model.eval()
    batches = []
    with torch.inference_mode():
        for start in range(0, len(token_ids), batch_size):
            input_ids, attention_mask = right_pad(token_ids[start : start + batch_size])
            mean_mask, _ = right_pad(kept[start : start + batch_size])
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
            outputs = model.base_model(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
            )
            mean_mask = mean_mask.to(device)
            batches.append(torch.stack([masked_token_mean(h, mean_mask).cpu() for h in outputs.hidden_states]))
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
    k indices are distinct. k >= n returns every index. Clustering is the paper's
    ("clustered typical samples"); this algorithm and the representative rule are ours."""
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


def median_heuristic_sigma(samples: torch.Tensor) -> float:
    """Ours (the paper's bandwidth was not readable here): RBF sigma from the median squared
    distance between different samples of one model, sigma^2 = median / 2, so two points as far
    apart as a typical pair of samples score exp(-1), whatever the scale of the activations.
    Fallbacks when that median is 0 (one sample, or all samples equal): the mean squared norm, then 1."""
    samples = samples.to(torch.float64)
    rows, cols = torch.triu_indices(len(samples), len(samples), offset=1)
    pair_distances = (torch.cdist(samples, samples) ** 2)[rows, cols]
    scale = float(pair_distances.median()) if len(pair_distances) else 0.0
    if scale <= 0:
        scale = float(samples.pow(2).sum(dim=1).mean())
    return (scale / 2) ** 0.5 if scale > 0 else 1.0


def rbf_similarity(x: torch.Tensor, y: torch.Tensor, sigma: float | None = None) -> float:
    """Mean over samples of the RBF kernel exp(-||x_i - y_i||^2 / (2 sigma^2)), x and y being [n, d]
    representations of the same n samples under two models: 1.0 when they agree, towards 0 as they
    drift. Pairing sample i with sample i, then averaging, is ours. sigma defaults to the median
    heuristic on x and y together."""
    if x.shape != y.shape or x.ndim != 2:
        raise InputError(
            f"representations must be two [n, d] tensors of one shape, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if sigma is None:
        sigma = median_heuristic_sigma(torch.cat([x, y]))
    if not sigma > 0:
        raise InputError(f"RBF bandwidth sigma must be > 0, got {sigma}")
    squared = (x.to(torch.float64) - y.to(torch.float64)).pow(2).sum(dim=1)
    return float(torch.exp(-squared / (2 * sigma**2)).mean())


def layer_similarities(
    representations: list[torch.Tensor], reference: int, bandwidth="median"
) -> tuple[list[list[float]], list[float]]:
    """Per depth row: every model's RBF similarity to the reference (the reference included, scoring 1;
    Fig. 4, stage 2), and the sigma used. With `median`, sigma comes from the reference's own samples at
    that row, so all models of one row are scored on one scale. Representations are
    [n_layers+1, n_samples, hidden], one per model, on the same samples."""
    check_bandwidth(bandwidth)
    if len(representations) < 2:
        raise InputError(f"RECALL needs at least 2 models to merge, got {len(representations)}")
    reference = resolve_reference(reference, len(representations))
    expected = representations[reference].shape
    for index, reps in enumerate(representations):
        if reps.ndim != 3 or reps.shape != expected:
            raise InputError(
                f"model {index} has representations of shape {tuple(reps.shape)} "
                f"(layers+1, samples, hidden), the reference has {tuple(expected)}"
            )
    similarity, sigmas = [], []
    for row in range(expected[0]):
        anchor = representations[reference][row]
        sigma = median_heuristic_sigma(anchor) if bandwidth == MEDIAN_BANDWIDTH else float(bandwidth)
        similarity.append([rbf_similarity(reps[row], anchor, sigma) for reps in representations])
        sigmas.append(sigma)
    return similarity, sigmas


def softmax_weights(similarity: list[list[float]], temperature: float) -> list[list[float]]:
    """Per row, softmax(similarity / temperature) over models (Fig. 4, stage 3; the temperature is ours)."""
    if not temperature > 0:
        raise InputError(f"temperature must be > 0, got {temperature}")
    return [torch.softmax(torch.tensor(row, dtype=torch.float64) / temperature, dim=0).tolist() for row in similarity]


def layer_weights(
    representations: list[torch.Tensor], reference: int, temperature: float, bandwidth="median"
) -> tuple[list[list[float]], list[list[float]]]:
    """RECALL's per-row similarities to the reference and their softmax weights."""
    check_merge_settings(len(representations), temperature)
    similarity, _ = layer_similarities(representations, reference, bandwidth)
    return similarity, softmax_weights(similarity, temperature)


def uniform_warning(similarity: list[list[float]]) -> str | None:
    """A message when every similarity is within UNIFORM_SPREAD of 1: then softmax weights are close
    to uniform at any temperature that is not tiny, whatever the models learned."""
    lowest = min(min(row) for row in similarity)
    if 1 - lowest >= UNIFORM_SPREAD:
        return None
    return (
        f"RECALL: every similarity is >= {lowest:.4f}, so the weights are nearly uniform; "
        "the bandwidth is wide next to the drift (try a smaller recall.bandwidth sigma)"
    )


def layer_drift(similarity: list[list[float]], model: int = 0) -> list[float]:
    """Ours: how far one model's representations drifted from the reference's in every depth row,
    1 - similarity (0 = no drift, towards 1 = far apart on the row's bandwidth)."""
    return [1.0 - row[model] for row in similarity]


def layer_alphas(similarity: list[list[float]], alpha: float, model: int = 0) -> list[float]:
    """Our layer-wise LERP (`recall_lerp`): the weight of the reference (post) in every depth row.

    Decoder layer l (row l + 1) gets alpha ** r_l, r_l being its drift (`layer_drift`) over the mean drift
    of the decoder layers; the embedding row (row 0) gets alpha itself. A flat profile (r = 1 everywhere,
    or no drift at all) is exactly linear at alpha; layers that drifted more than the average layer move
    towards pre (alpha ** r -> 0 as r grows), the others towards post; alpha = 0 is pre and alpha = 1 is
    post in every row, so a sweep over alpha spans the same ends as a linear one.

    Why the embedding row stays out of the profile: it measures the lookup table alone, while row l + 1
    measures everything up to layer l, so its drift is not on the layers' scale; mixing it into the mean
    pushed the embeddings towards post and every layer towards pre (README, "RECALL")."""
    if not 0.0 <= alpha <= 1.0:
        raise InputError(f"recall_lerp alpha must be in [0, 1], got {alpha}")
    drift = layer_drift(similarity, model)[1:]
    mean = sum(drift) / len(drift) if drift else 0.0
    if mean <= 0 or max(drift) - min(drift) <= 1e-12 * mean:  # flat, up to rounding: exactly linear
        return [alpha] * len(similarity)
    return [alpha] + [0.0 if alpha == 0 else alpha ** (value / mean) for value in drift]


def check_merge_settings(n_models: int, temperature: float) -> None:
    """The settings errors shared by the pure and the loading entry points."""
    if not temperature > 0:
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
    """RECALL's per-row merge weights (row 0 = embeddings, row l+1 = decoder layer l), with what
    produced them (for reports and reuse): similarities, the bandwidth rule and sigmas, the samples."""

    models: list[str]
    reference: int
    temperature: float
    similarity: list[list[float]]
    weights: list[list[float]]
    typical_samples: list[int]
    bandwidth: dict = field(default_factory=dict)  # {"rule": "median" | "fixed", "sigma": [per row]}
    special_tokens: bool = False

    @property
    def n_layers(self) -> int:
        return len(self.weights) - 1

    def row(self, layer: int | None, part: str, embed_rule: str = "nearest") -> int | None:
        """Which row a tensor follows: decoder layer l -> row l+1; embeddings / head under "nearest" ->
        the embedding row / the last row; None for the rules that do not use a row."""
        if part not in TENSOR_PARTS:
            raise InputError(f"tensor part must be one of {', '.join(TENSOR_PARTS)}, got {part!r}")
        if embed_rule not in EMBED_RULES:
            raise InputError(f"embed rule must be one of {', '.join(EMBED_RULES)}, got {embed_rule!r}")
        if part == "layer":
            if layer is None or not 0 <= layer < self.n_layers:
                raise InputError(f"layer index {layer} is out of range for {self.n_layers} layers")
            return layer + 1
        if embed_rule == "nearest":
            return 0 if part == "embed" else self.n_layers
        return None

    def for_tensor(self, layer: int | None, part: str, embed_rule: str = "nearest") -> list[float]:
        """Per-model weights for one tensor. part "layer" takes decoder layer `layer`'s row;
        "embed" (before layer 0) and "head" (final norm, lm_head) follow embed_rule:
        "nearest" -> the embedding row / the last row, "average" -> uniform,
        "base" -> all on model 0 (the base), "reference" -> all on the reference."""
        row = self.row(layer, part, embed_rule)
        n_models = len(self.models)
        if row is not None:
            return list(self.weights[row])
        if embed_rule == "average":
            return [1.0 / n_models] * n_models
        if embed_rule == "base":
            return one_hot(0, n_models)
        return one_hot(self.reference, n_models)

    def lerp_alpha(self, alpha: float, layer: int | None, part: str, embed_rule: str = "nearest") -> float:
        """`recall_lerp`: post's coefficient for one tensor (pre = model 0, post = the reference)."""
        if len(self.models) != 2 or self.reference != 1:
            raise InputError("recall_lerp interpolates two models, pre (the base) and post (the reference)")
        row = self.row(layer, part, embed_rule)
        if row is not None:
            return layer_alphas(self.similarity, alpha)[row]
        return {"average": alpha, "base": 0.0, "reference": 1.0}[embed_rule]

    def with_temperature(self, temperature: float) -> RecallWeights:
        """The same similarities re-weighted at another temperature: the similarities do not
        depend on it, so a sweep over temperatures runs the models once."""
        check_merge_settings(len(self.models), temperature)
        return replace(self, temperature=temperature, weights=softmax_weights(self.similarity, temperature))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d) -> RecallWeights:
        required = ("models", "reference", "temperature", "similarity", "weights", "typical_samples")
        missing = [name for name in required if name not in d]
        if missing:
            raise InputError(f"RECALL weights JSON lacks the field(s): {', '.join(missing)}")
        return cls(
            models=[str(model) for model in d["models"]],
            reference=int(d["reference"]),
            temperature=float(d["temperature"]),
            similarity=[[float(value) for value in row] for row in d["similarity"]],
            weights=[[float(value) for value in row] for row in d["weights"]],
            typical_samples=[int(index) for index in d["typical_samples"]],
            bandwidth=dict(d.get("bandwidth") or {}),
            special_tokens=bool(d.get("special_tokens", False)),
        )


def find_tokenizer_dir(model_dirs: list[str], reference: int) -> str:
    """The reference model's directory if it holds a tokenizer, else the first that does:
    fine-tunes often ship without one, and all of them share the base's vocabulary."""
    candidates = [model_dirs[reference]] + [d for i, d in enumerate(model_dirs) if i != reference]
    for directory in candidates:
        if any((Path(directory) / name).is_file() for name in TOKENIZER_FILES):
            return str(check_folder_files(directory))
    raise InputError(f"none of the model directories holds a tokenizer ({', '.join(TOKENIZER_FILES)})")


def check_same_architecture(model_dirs: list[str]) -> None:
    """Fail before loading any weights if layer counts or hidden sizes differ."""
    from transformers import AutoConfig

    shapes = []
    for directory in model_dirs:
        config = AutoConfig.from_pretrained(directory).get_text_config()
        shapes.append((config.num_hidden_layers, config.hidden_size))
    for directory, (n_layers, hidden) in zip(model_dirs, shapes, strict=True):
        if (n_layers, hidden) != shapes[0]:
            raise InputError(
                f"{directory} has {n_layers} layers of size {hidden}, "
                f"{model_dirs[0]} has {shapes[0][0]} of size {shapes[0][1]}: RECALL needs one architecture"
            )


def model_representations(
    model_dir: str, tokenizer, texts: list[str], device: str, max_length: int, special_tokens: bool = False
) -> torch.Tensor:
    """Load one model, represent the texts, free it: peak memory stays one model."""
    from transformers import AutoModelForCausalLM

    with interrupts.deferred():  # transformers builds the model through torch's device modes: see interrupts
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    representations = token_mean_hidden_states(
        model, tokenizer, texts, device=device, max_length=max_length, special_tokens=special_tokens
    )
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return representations


def compute_recall_weights(
    model_dirs: list[str],
    texts: list[str],
    n_typical: int = 8,
    temperature: float = DEFAULT_TEMPERATURE,
    reference: int = -1,
    device: str = "cpu",
    seed: int = 0,
    max_length: int = 256,
    bandwidth="median",
    special_tokens: bool = False,
) -> RecallWeights:
    """RECALL stages 1-3 (Fig. 4): typical samples picked under the reference model (clustered on
    its last-row representations, ours), every other model represented on those samples, then
    per-row similarities to the reference and softmax weights. Models load one at a time, in
    float32. Warns (UserWarning) when the similarities are too close to 1 to tell models apart."""
    from transformers import AutoTokenizer

    check_merge_settings(len(model_dirs), temperature)
    check_bandwidth(bandwidth)
    if not texts:
        raise InputError("no texts to pick typical samples from")
    reference = resolve_reference(reference, len(model_dirs))
    check_same_architecture(model_dirs)
    tokenizer = AutoTokenizer.from_pretrained(find_tokenizer_dir(model_dirs, reference))

    def represent(directory, chosen):
        return model_representations(directory, tokenizer, chosen, device, max_length, special_tokens)

    reference_all = represent(model_dirs[reference], texts)
    typical = select_typical_samples(reference_all[-1], n_typical, seed=seed)
    typical_texts = [texts[index] for index in typical]
    representations = [
        reference_all[:, typical] if index == reference else represent(directory, typical_texts)
        for index, directory in enumerate(model_dirs)
    ]
    similarity, sigmas = layer_similarities(representations, reference, bandwidth)
    message = uniform_warning(similarity)
    if message:
        warnings.warn(message, stacklevel=2)
    return RecallWeights(
        models=[str(directory) for directory in model_dirs],
        reference=reference,
        temperature=temperature,
        similarity=similarity,
        weights=softmax_weights(similarity, temperature),
        typical_samples=typical,
        bandwidth={
            "rule": bandwidth if bandwidth == MEDIAN_BANDWIDTH else "fixed",
            "sigma": sigmas,
            "kernel": "exp(-||x - y||^2 / (2 sigma^2))",
            "median": "sigma^2 = median squared distance between the reference's samples at the row / 2",
        },
        special_tokens=special_tokens,
    )


def read_texts(path) -> list[str]:
    """Candidate texts: one per non-empty line, or, for a .jsonl file, each line's "text" field."""
    path = Path(path)
    text = read_text(require_regular(path, "text file"))
    lines = [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1)]
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


def post_coefficients(weights: RecallWeights, interpolates: bool, alpha: float) -> list[float]:
    """The reference's (post's) weight in every depth row at one sweep point: the softmax weight at
    temperature alpha (recall), or with `interpolates` the layer-wise LERP coefficient at global alpha
    (recall_lerp)."""
    if interpolates:
        return layer_alphas(weights.similarity, alpha)
    return [row[weights.reference] for row in weights.with_temperature(alpha).weights]
