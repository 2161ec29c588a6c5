"""RECALL layer-wise weights: clustering, similarity, softmax weights, per-tensor lookup, end to end on tiny Llamas."""

import copy
import json
import math

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mergekit_lite.errors import InputError
from mergekit_lite.merge.recall import (
    RecallWeights,
    compute_recall_weights,
    find_tokenizer_dir,
    layer_weights,
    rbf_similarity,
    read_texts,
    select_typical_samples,
    token_mean_hidden_states,
)

WORDS = "the a cat dog bird fish runs sleeps eats sings red blue green small big old new fast slow happy".split()
TEXTS = [
    " ".join(WORDS[(start + step * offset) % len(WORDS)] for offset in range(3 + start % 5))
    for start, step in ((s, 1 + s % 3) for s in range(16))
]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[PAD]": 0, "[UNK]": 1, **{word: index + 2 for index, word in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")


def tiny_config(n_layers: int = 3) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(WORDS) + 2,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )


@pytest.fixture(scope="module")
def base_and_last_layer_tuned(tmp_path_factory):
    """Two tiny Llamas: the second is the first with only its last layer perturbed.
    Only the first directory gets the tokenizer, so the loader's fallback is exercised."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_config())
    tuned = copy.deepcopy(base)
    with torch.no_grad():
        for parameter in tuned.model.layers[-1].mlp.parameters():
            parameter.add_(torch.randn_like(parameter))
    base_dir, tuned_dir = tmp_path_factory.mktemp("base"), tmp_path_factory.mktemp("tuned")
    base.save_pretrained(base_dir)
    tiny_tokenizer().save_pretrained(base_dir)
    tuned.save_pretrained(tuned_dir)
    return str(base_dir), str(tuned_dir)


def blobs(n_blobs=4, per_blob=10, dim=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(n_blobs, dim, generator=generator) * 50
    points = torch.cat([c + torch.randn(per_blob, dim, generator=generator) for c in centers])
    order = torch.randperm(len(points), generator=generator)
    labels = torch.arange(n_blobs).repeat_interleave(per_blob)
    return points[order], labels[order]


def test_kmeans_picks_one_representative_per_blob():
    points, labels = blobs()
    picked = select_typical_samples(points, 4, seed=3)
    assert picked == sorted(picked)
    assert sorted(labels[picked].tolist()) == [0, 1, 2, 3]
    assert select_typical_samples(points, 4, seed=3) == picked


def test_kmeans_edge_cases():
    points, _ = blobs()
    assert select_typical_samples(points[:3], 5) == [0, 1, 2]
    duplicates = torch.zeros(6, 2)
    assert len(set(select_typical_samples(duplicates, 3))) == 3
    with pytest.raises(InputError):
        select_typical_samples(points, 0)


def test_rbf_similarity_identical_distance_and_scale():
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    direction = torch.ones(6)
    assert rbf_similarity(x, x) == 1.0
    scores = [rbf_similarity(x, x + step * direction) for step in (0.1, 0.5, 1.0, 3.0)]
    assert all(a > b for a, b in zip(scores, scores[1:]))
    y = x + 0.7 * direction
    for scale in (1e-3, 1e3):
        assert rbf_similarity(scale * x, scale * y) == pytest.approx(rbf_similarity(x, y), rel=1e-6)
    with pytest.raises(InputError):
        rbf_similarity(x, x[:4])


def test_layer_weights_hand_computed():
    reference_layer = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])  # squared gaps 1, 4, 5: gamma 1/4
    reference = torch.stack([reference_layer, reference_layer])
    other = torch.stack([reference_layer, reference_layer + torch.tensor([1.0, 1.0])])  # drift^2 = 2 in layer 1
    similarity, weights = layer_weights([other, reference], reference=-1, temperature=0.5)
    assert similarity[0] == [1.0, 1.0]
    assert weights[0] == pytest.approx([0.5, 0.5])
    expected_similarity = math.exp(-2 / 4)
    assert similarity[1] == pytest.approx([expected_similarity, 1.0])
    lean = 1 / (1 + math.exp((expected_similarity - 1) / 0.5))
    assert weights[1] == pytest.approx([1 - lean, lean])


def test_layer_weights_reference_first_then_closer_models():
    reference_layer = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    near, far = reference_layer + 0.3, reference_layer + 1.5
    reps = [r.unsqueeze(0) for r in (far, reference_layer, near)]
    _, weights = layer_weights(reps, reference=1, temperature=0.5)
    assert weights[0][1] > weights[0][2] > weights[0][0]
    assert sum(weights[0]) == pytest.approx(1.0)


def test_temperature_moves_weights_between_one_hot_and_uniform():
    reference_layer = torch.randn(5, 4, generator=torch.Generator().manual_seed(4))
    reps = [(reference_layer + 2.0).unsqueeze(0), reference_layer.unsqueeze(0)]
    _, sharp = layer_weights(reps, reference=1, temperature=1e-3)
    _, flat = layer_weights(reps, reference=1, temperature=1e3)
    assert sharp[0][1] > 0.999
    assert flat[0] == pytest.approx([0.5, 0.5], abs=1e-3)


def test_layer_weights_errors():
    reps = [torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)]
    with pytest.raises(InputError, match="temperature"):
        layer_weights(reps, reference=-1, temperature=0.0)
    with pytest.raises(InputError, match="at least 2"):
        layer_weights(reps[:1], reference=-1, temperature=0.5)
    with pytest.raises(InputError, match="shape"):
        layer_weights([torch.zeros(3, 3, 4), torch.zeros(2, 3, 4)], reference=-1, temperature=0.5)


def sample_weights() -> RecallWeights:
    return RecallWeights(
        models=["base", "math", "chat"],
        reference=2,
        temperature=0.5,
        similarity=[[1.0, 1.0, 1.0], [0.9, 0.8, 1.0], [0.5, 0.6, 1.0]],
        weights=[[0.3, 0.3, 0.4], [0.2, 0.3, 0.5], [0.1, 0.2, 0.7]],
        typical_samples=[0, 4, 9],
    )


def test_for_tensor_rules():
    w = sample_weights()
    assert w.for_tensor(0, "layer") == [0.2, 0.3, 0.5]
    assert w.for_tensor(1, "layer", embed_rule="base") == [0.1, 0.2, 0.7]
    assert w.for_tensor(None, "embed") == [0.3, 0.3, 0.4]
    assert w.for_tensor(None, "head") == [0.1, 0.2, 0.7]
    assert w.for_tensor(None, "head", embed_rule="average") == pytest.approx([1 / 3] * 3)
    assert w.for_tensor(None, "embed", embed_rule="base") == [1.0, 0.0, 0.0]
    assert w.for_tensor(None, "head", embed_rule="reference") == [0.0, 0.0, 1.0]
    bad_calls = ((2, "layer", "nearest"), (None, "layer", "nearest"), (None, "bias", "nearest"), (None, "embed", "mean"))
    for bad in bad_calls:
        with pytest.raises(InputError):
            w.for_tensor(*bad)


def test_json_round_trip():
    w = sample_weights()
    assert RecallWeights.from_json(json.loads(json.dumps(w.to_json()))) == w
    with pytest.raises(InputError, match="weights"):
        RecallWeights.from_json({k: v for k, v in w.to_json().items() if k != "weights"})


def test_token_means_ignore_padding():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(n_layers=2))
    texts = ["the cat", "a big old dog runs fast", "bird"]
    batched = token_mean_hidden_states(model, tiny_tokenizer(), texts, device="cpu", batch_size=3)
    one_by_one = token_mean_hidden_states(model, tiny_tokenizer(), texts, device="cpu", batch_size=1)
    assert batched.shape == (3, 3, 32) and batched.dtype == torch.float32
    assert torch.allclose(batched, one_by_one, atol=1e-5)


def test_recall_weights_end_to_end(base_and_last_layer_tuned):
    base_dir, tuned_dir = base_and_last_layer_tuned
    result = compute_recall_weights([base_dir, tuned_dir], TEXTS, n_typical=5, temperature=0.5, device="cpu")
    assert result.reference == 1 and result.n_layers == 3
    assert len(result.typical_samples) == 5 and all(0 <= i < len(TEXTS) for i in result.typical_samples)
    for row in result.weights[:3]:  # embeddings, layers 0 and 1: untouched, so averaged
        assert row == pytest.approx([0.5, 0.5])
    assert result.similarity[-1][0] < 0.9
    assert result.for_tensor(2, "layer")[1] > 0.55
    assert result.for_tensor(None, "head") == result.weights[-1]


def test_find_tokenizer_dir_prefers_reference(tmp_path):
    dirs = [tmp_path / name for name in ("base", "tuned", "bare")]
    for directory in dirs:
        directory.mkdir()
    tiny_tokenizer().save_pretrained(dirs[0])
    tiny_tokenizer().save_pretrained(dirs[1])
    as_str = [str(d) for d in dirs]
    assert find_tokenizer_dir(as_str, reference=1) == as_str[1]
    assert find_tokenizer_dir(as_str, reference=2) == as_str[0]
    with pytest.raises(InputError, match="tokenizer"):
        find_tokenizer_dir([as_str[2]], reference=0)


def test_compute_recall_weights_input_errors(tmp_path):
    shallow, deep = tmp_path / "shallow", tmp_path / "deep"
    tiny_config(n_layers=2).save_pretrained(shallow)
    tiny_config(n_layers=3).save_pretrained(deep)
    dirs = [str(shallow), str(deep)]
    with pytest.raises(InputError, match="layers"):
        compute_recall_weights(dirs, TEXTS)
    with pytest.raises(InputError, match="at least 2"):
        compute_recall_weights(dirs[:1], TEXTS)
    with pytest.raises(InputError, match="temperature"):
        compute_recall_weights(dirs, TEXTS, temperature=-1.0)
    with pytest.raises(InputError, match="no texts"):
        compute_recall_weights(dirs, [])


def test_read_texts(tmp_path):
    plain = tmp_path / "texts.txt"
    plain.write_text("first sample\n\n  \nsecond sample\n")
    assert read_texts(plain) == ["first sample", "second sample"]
    records = tmp_path / "texts.jsonl"
    records.write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n')
    assert read_texts(records) == ["one", "two"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(InputError, match="text"):
        read_texts(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(InputError, match="no texts"):
        read_texts(empty)
    with pytest.raises(InputError, match="not found"):
        read_texts(tmp_path / "missing.txt")
