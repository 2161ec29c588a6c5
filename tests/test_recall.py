"""RECALL layer-wise weights (clustering, RBF similarity to the reference, softmax weights, per-tensor lookup)
checked against values computed by hand, our recall_lerp profile, and both end to end on tiny Llamas."""

import copy
import itertools
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
    layer_alphas,
    layer_weights,
    median_heuristic_sigma,
    post_coefficients,
    rbf_similarity,
    read_texts,
    select_typical_samples,
    token_mean_hidden_states,
    uniform_warning,
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
    assert all(a > b for a, b in itertools.pairwise(scores))
    y = x + 0.7 * direction
    for scale in (1e-3, 1e3):
        assert rbf_similarity(scale * x, scale * y) == pytest.approx(rbf_similarity(x, y), rel=1e-6)
    with pytest.raises(InputError):
        rbf_similarity(x, x[:4])


def test_layer_weights_hand_computed():
    reference_layer = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])  # squared gaps 1, 4, 5: sigma^2 = 4/2
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
    bad_calls = (
        (2, "layer", "nearest"),
        (None, "layer", "nearest"),
        (None, "bias", "nearest"),
        (None, "embed", "mean"),
    )
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
    with pytest.raises(InputError, match="missing.txt: no such text file"):
        read_texts(tmp_path / "missing.txt")


def test_paper_weights_three_models_median_bandwidth_by_hand():
    """Fig. 4 stages 2-3: every model against M_N (M_N included), RBF kernel, softmax per layer.
    Reference samples (0,0), (2,0), (0,2): squared gaps 4, 4, 8, median 4, so sigma^2 = 2 and the
    kernel is exp(-d^2 / 4). Model a is shifted by (1, 0) (d^2 = 1), model b by (0, 2) (d^2 = 4)."""
    reference = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0]])
    a, b = reference + torch.tensor([1.0, 0.0]), reference + torch.tensor([0.0, 2.0])
    assert median_heuristic_sigma(reference) == pytest.approx(math.sqrt(2))
    similarity, weights = layer_weights([a[None], b[None], reference[None]], reference=-1, temperature=1.0)
    s_a, s_b = math.exp(-1 / 4), math.exp(-4 / 4)
    assert similarity[0] == pytest.approx([s_a, s_b, 1.0])
    total = math.exp(s_a) + math.exp(s_b) + math.exp(1.0)
    assert weights[0] == pytest.approx([math.exp(s_a) / total, math.exp(s_b) / total, math.e / total])


def test_paper_weights_fixed_bandwidth_sample_pairs_by_hand():
    """Sample i is compared with sample i and the kernels averaged: with sigma = 1 and per-sample
    squared drifts 0, 2, 4 the similarity is (1 + e^-1 + e^-2) / 3; two layers, the first undrifted."""
    reference = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    drift = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    pre = torch.stack([reference, reference + drift])
    post = torch.stack([reference, reference])
    similarity, weights = layer_weights([pre, post], reference=1, temperature=1.0, bandwidth=1.0)
    s = (1 + math.exp(-1) + math.exp(-2)) / 3
    assert similarity[0] == [1.0, 1.0] and similarity[1] == pytest.approx([s, 1.0])
    assert weights[1] == pytest.approx([math.exp(s) / (math.exp(s) + math.e), math.e / (math.exp(s) + math.e)])


def test_two_models_pre_never_gets_more_than_half():
    """The reference scores 1 against itself, the top similarity: pre's weight is
    1 / (1 + exp((1 - s) / T)) <= 0.5 at every temperature, smallest where s (drift) is lowest (largest)."""
    for s in (1.0, 0.9, 0.5, 0.0):
        for temperature in (0.05, 1.0, 10.0):
            row = RecallWeights(["pre", "post"], 1, 1.0, [[s, 1.0]], [[0.5, 0.5]], [0]).with_temperature(temperature)
            expected = 1 / (1 + math.exp((1 - s) / temperature))
            assert row.weights[0][0] == pytest.approx(expected) and row.weights[0][0] <= 0.5


def test_bandwidth_errors_and_uniform_warning():
    reps = [torch.zeros(2, 3, 4), torch.ones(2, 3, 4)]
    for bad in (0.0, -1.0, "mean", True):
        with pytest.raises(InputError, match="bandwidth"):
            layer_weights(reps, reference=-1, temperature=1.0, bandwidth=bad)
    assert uniform_warning([[0.995, 1.0], [0.999, 1.0]]) is not None
    assert uniform_warning([[0.95, 1.0], [0.999, 1.0]]) is None


def test_layer_alphas_by_hand():
    """Decoder rows' drift = 1 - s = (0.4, 0.1, 0.1), mean 0.2, so r = (2, 0.5, 0.5) and alpha_l = alpha ** r;
    the embedding row (drift 0.3 here) takes alpha itself."""
    similarity = [[0.7, 1.0], [0.6, 1.0], [0.9, 1.0], [0.9, 1.0]]
    assert layer_alphas(similarity, 0.64) == pytest.approx([0.64, 0.64**2, 0.8, 0.8])
    assert layer_alphas(similarity, 0.0) == [0.0, 0.0, 0.0, 0.0]
    assert layer_alphas(similarity, 1.0) == [1.0, 1.0, 1.0, 1.0]
    flat = [[0.7, 1.0]] * 3
    assert layer_alphas(flat, 0.3) == [0.3, 0.3, 0.3]
    assert layer_alphas([[1.0, 1.0]] * 3, 0.3) == [0.3, 0.3, 0.3]  # no drift at all: linear
    with pytest.raises(InputError):
        layer_alphas(similarity, 1.5)
    weights = RecallWeights(["pre", "post"], 1, 1.0, similarity, similarity, [0])
    assert post_coefficients(weights, "recall_lerp", 0.64) == layer_alphas(similarity, 0.64)
    assert weights.lerp_alpha(0.64, 0, "layer") == pytest.approx(0.64**2)
    assert weights.lerp_alpha(0.64, None, "embed") == pytest.approx(0.64)
    assert weights.lerp_alpha(0.64, None, "head") == pytest.approx(0.8)
    assert weights.lerp_alpha(0.64, None, "embed", embed_rule="base") == 0.0


def test_bos_is_left_out_of_the_token_mean():
    from mergekit_lite.toy import build_tokenizer

    tokenizer = build_tokenizer(WORDS)
    config = tiny_config(n_layers=2)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    texts = ["the cat runs", "a dog"]
    without = token_mean_hidden_states(model, tokenizer, texts, batch_size=2)
    with_special = token_mean_hidden_states(model, tokenizer, texts, batch_size=2, special_tokens=True)
    for index, text in enumerate(texts):
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        assert ids[0, 0] == tokenizer.bos_token_id
        with torch.inference_mode():
            hidden = model.model(input_ids=ids, output_hidden_states=True).hidden_states
        for row, states in enumerate(hidden):
            assert torch.allclose(without[row, index], states[0, 1:].mean(dim=0), atol=1e-5)
            assert torch.allclose(with_special[row, index], states[0].mean(dim=0), atol=1e-5)


@pytest.mark.slow
def test_bandwidth_rule_is_recorded_and_a_wide_one_warns(base_and_last_layer_tuned):
    base_dir, tuned_dir = base_and_last_layer_tuned
    median = compute_recall_weights([base_dir, tuned_dir], TEXTS, n_typical=5)
    assert median.temperature == 1.0 and median.bandwidth["rule"] == "median"
    assert len(median.bandwidth["sigma"]) == median.n_layers + 1
    with pytest.warns(UserWarning, match="nearly uniform"):
        wide = compute_recall_weights([base_dir, tuned_dir], TEXTS, n_typical=5, bandwidth=1e6)
    assert wide.bandwidth["rule"] == "fixed" and wide.bandwidth["sigma"] == [1e6] * (wide.n_layers + 1)
    assert RecallWeights.from_json(json.loads(json.dumps(wide.to_json()))) == wide


def lerp_merge(base_dir, tuned_dir, tmp_path, similarity, alpha, method="recall_lerp"):
    from mergekit_lite.audited import run_merge
    from mergekit_lite.io.safetensors import open_model
    from mergekit_lite.merge.schema import config_from_dict

    weights = RecallWeights([base_dir, tuned_dir], 1, 1.0, similarity, similarity, [0])
    weights_file = tmp_path / f"{method}-{alpha}.json"
    weights_file.write_text(json.dumps(weights.to_json()))
    parameters = {"alpha": alpha}
    config = config_from_dict(
        {
            "method": method,
            "base": base_dir,
            "models": [tuned_dir],
            "parameters": parameters,
            "recall": {"weights_file": str(weights_file)},
        }
    )
    out = tmp_path / f"{method}-{alpha}-{len(list(tmp_path.iterdir()))}"
    run_merge(config, out)
    source = open_model(out)
    return {name: source.load(name) for name in source.names}


def test_recall_lerp_flat_profile_is_byte_identical_to_linear(base_and_last_layer_tuned, tmp_path):
    from mergekit_lite.audited import run_merge
    from mergekit_lite.io.safetensors import open_model
    from mergekit_lite.merge.schema import config_from_dict

    base_dir, tuned_dir = base_and_last_layer_tuned
    layerwise = lerp_merge(base_dir, tuned_dir, tmp_path, [[0.8, 1.0]] * 4, 0.3)
    config = config_from_dict(
        {"method": "linear", "base": base_dir, "models": [tuned_dir], "parameters": {"alpha": 0.3}}
    )
    run_merge(config, tmp_path / "linear")
    linear = open_model(tmp_path / "linear")
    for name, tensor in layerwise.items():
        assert torch.equal(tensor, linear.load(name)), name


def test_recall_lerp_merges_each_layer_at_its_alpha(base_and_last_layer_tuned, tmp_path):
    from mergekit_lite.io.safetensors import open_model
    from mergekit_lite.merge.plan import layer_index

    base_dir, tuned_dir = base_and_last_layer_tuned
    similarity = [[1.0, 1.0], [0.9, 1.0], [0.9, 1.0], [0.2, 1.0]]  # rows: embeddings, layers 0-2
    merged = lerp_merge(base_dir, tuned_dir, tmp_path, similarity, 0.5)
    alphas = layer_alphas(similarity, 0.5)
    assert alphas[-1] < 0.5 < alphas[1]
    pre, post = open_model(base_dir), open_model(tuned_dir)
    for name, tensor in merged.items():
        layer = layer_index(name)
        row = layer + 1 if layer is not None else (0 if "embed" in name else len(similarity) - 1)
        expected = (1 - alphas[row]) * pre.load(name) + alphas[row] * post.load(name)
        assert torch.allclose(tensor, expected, atol=1e-6), name


def test_recall_lerp_config_errors(base_and_last_layer_tuned):
    from mergekit_lite.merge.schema import config_from_dict

    base_dir, tuned_dir = base_and_last_layer_tuned
    common = {"method": "recall_lerp", "base": base_dir, "recall": {"texts": "t.txt"}}
    with pytest.raises(InputError, match="alpha"):
        config_from_dict({**common, "models": [tuned_dir]})
    with pytest.raises(InputError, match="exactly two"):
        config_from_dict({**common, "models": [tuned_dir, tuned_dir], "parameters": {"alpha": 0.5}})
    with pytest.raises(InputError, match="bandwidth"):
        config_from_dict(
            {
                **common,
                "models": [tuned_dir],
                "parameters": {"alpha": 0.5},
                "recall": {"texts": "t.txt", "bandwidth": "wide"},
            }
        )


@pytest.mark.slow
def test_quiet_merge_draws_no_loading_bars(base_and_last_layer_tuned, tmp_path):
    """-q: no transformers 'Loading weights' bars while RECALL runs the models (the CLI, as users call it)."""
    import os
    import subprocess
    import sys

    base_dir, tuned_dir = base_and_last_layer_tuned
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    from pathlib import Path

    command = [
        str(Path(sys.executable).parent / "mergekit-lite"),
        "merge",
        "--method",
        "recall",
        "--base",
        base_dir,
        "--model",
        tuned_dir,
        "--recall-texts",
        str(texts),
        "--recall-samples",
        "4",
    ]
    quieting = {"TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY"}
    env = {name: value for name, value in os.environ.items() if name not in quieting}
    loud = subprocess.run(command + ["--out", str(tmp_path / "loud")], capture_output=True, text=True, env=env)
    quiet = subprocess.run(command + ["--out", str(tmp_path / "quiet"), "-q"], capture_output=True, text=True, env=env)
    assert loud.returncode == 0 and quiet.returncode == 0, quiet.stderr
    assert "Loading weights" in loud.stderr
    assert "Loading weights" not in quiet.stderr and "%|" not in quiet.stderr
    written = json.loads((tmp_path / "quiet" / "recall_weights.json").read_text())
    assert written["bandwidth"]["rule"] == "median" and written["special_tokens"] is False


@pytest.mark.slow
def test_recall_lerp_sweep_reports_the_picks_layer_profile(toy_pair, tmp_path):
    """The sweep computes the similarities once (recall/similarity.json) and the report plots the pick's
    per-layer coefficients, the same numbers layer_alphas gives for that file."""
    from mergekit_lite.sweep import SweepSettings, run_sweep

    settings = SweepSettings(
        pre=str(toy_pair.pre_dir),
        post=str(toy_pair.post_dir),
        method="recall_lerp",
        alphas=[0.3, 0.6],
        old_tasks=toy_pair.old_tasks,
        new_tasks=toy_pair.new_tasks,
        include_path=str(toy_pair.task_dir),
        out=str(tmp_path / "sweep"),
        limit=8,
        recall_texts=str(toy_pair.typical_texts),
    )
    result = run_sweep(settings)
    similarity = RecallWeights.from_json(json.loads((tmp_path / "sweep" / "recall" / "similarity.json").read_text()))
    assert similarity.models == [str(toy_pair.pre_dir), str(toy_pair.post_dir)]
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "## Per-layer coefficients of the pick" in report and (tmp_path / "sweep" / "layers.png").is_file()
    expected = layer_alphas(similarity.similarity, result.best.alpha)
    assert f"embed: {expected[0]:.3f}, 0: {expected[1]:.3f}, 1: {expected[2]:.3f}" in report
