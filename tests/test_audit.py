"""Adapter audits on real tiny PEFT adapters: one per verdict, the fingerprint, leakage, and the CLI's exit codes."""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from tiny_models import VOCAB, tiny_llama, train_lora
from transformers import LlamaForCausalLM

from audits import fingerprint as fingerprint_module
from audits.adapter import audit_adapter, require_verified, target_mismatch
from audits.fingerprint import (
    FINGERPRINT_FILE,
    compute_fingerprint,
    load_fingerprint,
    top_singular,
    write_fingerprint,
)
from audits.leakage import check_leakage, find_contamination
from cli.main import main
from mergekit_lite.errors import InputError
from mergekit_lite.toy import torch_threads


def make_adapter(base_dir, out_dir, target_modules, steps: int, **save_options):
    """A real PEFT adapter on the saved base, trained `steps` Adam steps on random tokens (0 steps: B stays zero)."""
    peft_model = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir),
                                LoraConfig(r=4, lora_alpha=16, target_modules=target_modules))
    train_lora(peft_model, steps, seed=2, batch=(4, 16))
    peft_model.save_pretrained(out_dir, **save_options)
    return out_dir


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models train and decompose several times faster on one thread than on shared cores."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """Two bases that differ only by seed, one of another width, and adapters for every verdict."""
    root = tmp_path_factory.mktemp("zoo")
    tiny_llama(0).save_pretrained(root / "base", safe_serialization=True)
    tiny_llama(1).save_pretrained(root / "other_base", safe_serialization=True)
    tiny_llama(0, hidden_size=48).save_pretrained(root / "wide_base", safe_serialization=True)
    write_fingerprint(compute_fingerprint(root / "base"), root / "base_fingerprint.json")
    targets = ["q_proj", "v_proj", "up_proj"]
    adapters = root / "adapters"
    good = make_adapter(root / "base", adapters / "good", targets, steps=5)
    make_adapter(root / "base", root / "pickled", targets, steps=5, safe_serialization=False)
    untrained = make_adapter(root / "base", adapters / "untrained", targets, steps=0)
    embedding = make_adapter(root / "base", root / "embedding", ["embed_tokens", "q_proj"], steps=3)
    for folder in (good, untrained, root / "pickled"):
        shutil.copy(root / "base_fingerprint.json", folder / FINGERPRINT_FILE)
    nan = root / "nan"
    shutil.copytree(good, nan)
    tensors = load_file(nan / "adapter_model.safetensors")
    next(value for key, value in tensors.items() if "lora_A" in key)[0, 0] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors")
    unshipped = root / "unshipped"
    shutil.copytree(good, unshipped)
    (unshipped / FINGERPRINT_FILE).unlink()
    return {"root": root, "base": root / "base", "other_base": root / "other_base", "wide_base": root / "wide_base",
            "adapters": adapters, "good": good, "untrained": untrained, "pickled": root / "pickled", "nan": nan,
            "embedding": embedding, "unshipped": unshipped}


def statuses(report) -> dict[str, str]:
    return {check.name: check.status for check in report.checks}


def test_good_adapter_is_verified(zoo):
    report = audit_adapter(zoo["good"], zoo["base"])
    assert report.verdict == "VERIFIED", report.reasons
    assert statuses(report) == {"format": "pass", "base-id": "pass", "structure": "pass", "tokenizer": "pass",
                                "signature": "pass", "spectral": "pass", "delta": "pass"}
    checks = {check.name: check for check in report.checks}
    assert checks["spectral"].value > 0.999
    assert checks["structure"].value == pytest.approx(6 / 16)
    assert "scaling 4 (alpha/r)" in checks["format"].detail
    assert "declares this base folder" in checks["base-id"].detail
    assert 1.0 <= checks["delta"].measurements["modules"]["model.layers.0.self_attn.q_proj.weight"]["effective_rank"] <= 4.0
    assert json.loads(json.dumps(report.to_dict()))["verdict"] == "VERIFIED"


def test_adapter_made_on_another_base_is_rejected(zoo):
    report = audit_adapter(zoo["good"], zoo["other_base"])
    assert report.verdict == "REJECTED"
    assert statuses(report)["spectral"] == "fail"
    assert statuses(report)["structure"] == "pass", "same architecture: only the fingerprint can tell"
    assert statuses(report)["base-id"] == "warn", "declares another local folder: not verifiable by name"
    assert "not the base in the signature" in report.reasons[0]
    assert "16 of 21 signed tensors hold other values" in report.reasons[0], "the 5 norm weights are all ones in both"
    assert "does not match the adapter's base fingerprint" in report.reasons[1]


def test_without_fingerprint_alignment_only_warns(zoo):
    for base in (zoo["base"], zoo["other_base"]):
        report = audit_adapter(zoo["unshipped"], base)
        assert statuses(report)["spectral"] in ("pass", "warn")
        assert report.verdict in ("VERIFIED", "WARN")


def markov_batches(seed: int, count: int):
    """Token batches from a fixed sparse Markov chain: structure a tiny model can learn in a few steps."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 3), generator=generator)
    for _ in range(count):
        tokens = torch.zeros(16, 24, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (16,), generator=generator)
        for position in range(1, tokens.shape[1]):
            tokens[:, position] = successors[tokens[:, position - 1], torch.randint(0, 3, (16,), generator=generator)]
        yield tokens


def fit(model, batches, learning_rate):
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=learning_rate)
    for tokens in batches:
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture(scope="module")
def pretrained_pair(tmp_path_factory):
    """Two bases pretrained alike from different seeds, and an adapter trained on the first, with no fingerprint."""
    root = tmp_path_factory.mktemp("pretrained")
    for name, seed in (("base", 0), ("twin", 1)):
        model = tiny_llama(seed, hidden_size=64, num_key_value_heads=4, max_position_embeddings=32)
        fit(model, markov_batches(100, 150), 3e-3)
        model.save_pretrained(root / name, safe_serialization=True)
    peft_model = get_peft_model(LlamaForCausalLM.from_pretrained(root / "base"), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    fit(peft_model, markov_batches(200, 40), 3e-3)
    peft_model.save_pretrained(root / "adapter")
    return root


def test_without_fingerprint_alignment_tells_a_learned_base(pretrained_pair):
    own = audit_adapter(pretrained_pair / "adapter", pretrained_pair / "base")
    twin = audit_adapter(pretrained_pair / "adapter", pretrained_pair / "twin")
    assert (own.verdict, statuses(own)["spectral"]) == ("VERIFIED", "pass")
    assert (twin.verdict, statuses(twin)["spectral"]) == ("WARN", "warn")
    alignment = {report.base: next(c.value for c in report.checks if c.name == "spectral") for report in (own, twin)}
    assert alignment[str(pretrained_pair / "base")] > 2 * alignment[str(pretrained_pair / "twin")]


def test_explicit_fingerprint_overrides_the_shipped_one(zoo):
    other = zoo["root"] / "other_fingerprint.json"
    write_fingerprint(compute_fingerprint(zoo["other_base"]), other)
    assert audit_adapter(zoo["good"], zoo["base"], fingerprint=other).verdict == "REJECTED"
    assert audit_adapter(zoo["unshipped"], zoo["other_base"], fingerprint=other).verdict != "REJECTED"


def test_untrained_adapter_is_a_rejected_no_op(zoo):
    report = audit_adapter(zoo["untrained"], zoo["base"])
    assert report.verdict == "REJECTED"
    assert statuses(report)["delta"] == "fail"
    assert "no-op" in report.reasons[0]


def test_pickle_is_refused_unless_allowed(zoo):
    refused = audit_adapter(zoo["pickled"], zoo["base"])
    assert refused.verdict == "REJECTED"
    assert statuses(refused) == {"format": "fail"}
    assert "--allow-pickle" in refused.reasons[0]
    allowed = audit_adapter(zoo["pickled"], zoo["base"], allow_pickle=True)
    assert allowed.verdict == "WARN"
    assert statuses(allowed) == {"format": "warn", "base-id": "pass", "structure": "pass", "tokenizer": "pass",
                                 "signature": "pass", "spectral": "pass", "delta": "pass"}


def test_nan_adapter_is_rejected(zoo):
    report = audit_adapter(zoo["nan"], zoo["base"])
    assert report.verdict == "REJECTED"
    assert statuses(report) == {"format": "fail"}
    assert "NaN/Inf" in report.reasons[0]


def test_shape_mismatch_is_a_structural_failure(zoo):
    report = audit_adapter(zoo["unshipped"], zoo["wide_base"])
    assert report.verdict == "REJECTED"
    assert statuses(report) == {"format": "pass", "base-id": "warn", "structure": "fail"}
    assert "another model size" in report.reasons[0]


def test_carried_base_embedding_must_equal_the_base(zoo):
    assert statuses(audit_adapter(zoo["embedding"], zoo["base"]))["structure"] == "pass"
    report = audit_adapter(zoo["embedding"], zoo["other_base"])
    assert statuses(report)["structure"] == "fail"
    assert "copy of model.embed_tokens.weight differs" in report.reasons[0]


def test_target_modules_must_agree_with_the_tensors():
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    assert target_mismatch({"target_modules": ["q_proj", "v_proj"]}, modules) is None
    assert target_mismatch({"target_modules": r".*\.(q|v)_proj"}, modules) is None
    assert "not in target_modules" in target_mismatch({"target_modules": ["q_proj"]}, modules)
    assert "have no LoRA tensors" in target_mismatch({"target_modules": ["q_proj", "v_proj", "k_proj"]}, modules)


def write_lines(path, texts):
    path.write_text("".join(json.dumps({"id": f"item-{i}", "text": text}) + "\n" for i, text in enumerate(texts)))
    return path


SENTENCES = [" ".join(f"w{20 * i + j}" for j in range(20)) for i in range(40)]


def test_leaked_holdout_is_flagged(zoo, tmp_path):
    train = write_lines(tmp_path / "train.jsonl", SENTENCES[:30])
    leaked = [SENTENCES[3].upper(), "prefix words " + " ".join(SENTENCES[5].split()[:13])] + SENTENCES[30:]
    holdout = write_lines(tmp_path / "holdout.jsonl", leaked)
    report = audit_adapter(zoo["good"], zoo["base"], train_data=train, holdout=holdout)
    assert report.verdict == "REJECTED"
    leakage = next(check for check in report.checks if check.name == "leakage")
    assert leakage.status == "fail"
    assert leakage.measurements["contaminated_ids"] == ["item-0", "item-1"]
    assert leakage.measurements["exact_duplicate_ids"] == ["item-0"]
    assert "item-0, item-1" in leakage.detail


def test_leakage_thresholds_and_plain_text(tmp_path):
    train = tmp_path / "train.txt"
    train.write_text("\n".join(SENTENCES[:30]) + "\n")
    holdout = tmp_path / "holdout.txt"
    holdout.write_text("\n".join(SENTENCES[30:] + [" ".join(SENTENCES[0].split()[2:15])]) + "\n")
    found = find_contamination(train, holdout, 13)
    assert found.contaminated_ids == ["11"] and found.exact_duplicate_ids == []
    assert check_leakage(train, holdout, 13, max_share=0.5).status == "warn"
    assert check_leakage(train, holdout, 13, max_share=0.01).status == "fail"
    assert check_leakage(train, holdout, 14, max_share=0.01).status == "pass"


def test_leakage_needs_both_files_and_readable_data(zoo, tmp_path):
    with pytest.raises(InputError, match="both"):
        audit_adapter(zoo["good"], zoo["base"], holdout=tmp_path / "h.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"prompt": "no text"}\n')
    with pytest.raises(InputError, match="bad.jsonl:2"):
        find_contamination(bad, bad, 13)


def test_unusable_input_raises(zoo, tmp_path):
    with pytest.raises(InputError, match="not a PEFT adapter folder"):
        audit_adapter(tmp_path, zoo["base"])
    with pytest.raises(InputError, match="no such file or folder"):
        audit_adapter(zoo["good"], tmp_path / "missing")
    (tmp_path / "fp.json").write_text("{}")
    with pytest.raises(InputError, match="not a mergekit-lite base fingerprint"):
        load_fingerprint(tmp_path / "fp.json")


def test_require_verified_gates_the_merge(zoo):
    assert require_verified(zoo["good"], zoo["base"]).verdict == "VERIFIED"
    with pytest.raises(InputError, match="REJECTED: signature: .*spectral: .*use --force"):
        require_verified(zoo["good"], zoo["other_base"])
    assert require_verified(zoo["good"], zoo["other_base"], force=True).verdict == "REJECTED"


def test_randomized_top_singular_matches_exact(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    spectrum = torch.logspace(1, -2, 48)
    left = torch.linalg.qr(torch.randn(64, 48, generator=generator)).Q
    right = torch.linalg.qr(torch.randn(56, 48, generator=generator)).Q
    matrix = left @ torch.diag(spectrum) @ right.T
    exact_vectors, exact_values = top_singular(matrix, 6)
    monkeypatch.setattr(fingerprint_module, "EXACT_SVD_MAX_DIM", 16)
    vectors, values = top_singular(matrix, 6)
    torch.testing.assert_close(values, exact_values, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close((vectors.T @ exact_vectors).abs(), torch.eye(6), rtol=0, atol=1e-3)


def run_cli(*args):
    return CliRunner().invoke(main, ["audit", *map(str, args)])


def test_cli_exit_codes_and_json(zoo):
    verified = run_cli(zoo["good"], "--base", zoo["base"])
    assert verified.exit_code == 0, verified.output
    assert "VERIFIED" in verified.stdout
    rejected = run_cli(zoo["adapters"], "--base", zoo["base"], "--json")
    assert rejected.exit_code == 1
    reports = json.loads(rejected.stdout)["reports"]
    assert [(r["adapter"].split("/")[-1], r["verdict"]) for r in reports] == [("good", "VERIFIED"), ("untrained", "REJECTED")]
    verbose = run_cli("--base", zoo["base"], "-v", zoo["pickled"], "--allow-pickle")
    assert verbose.exit_code == 0 and "WARN" in verbose.stdout and "threshold 0.95" in verbose.stdout
    for args in ([zoo["root"] / "missing", "--base", zoo["base"]], [zoo["base"], "--base", zoo["base"]],
                 [zoo["good"], "--base", zoo["root"] / "missing"]):
        unusable = run_cli(*args)
        assert unusable.exit_code == 2
        assert unusable.stderr.startswith("error: ") and unusable.stderr.count("\n") == 1


def test_cli_fingerprint_subcommand(zoo, tmp_path):
    out = tmp_path / "fp.json"
    written = run_cli("fingerprint", zoo["other_base"], "--out", out, "--top-k", "4")
    assert written.exit_code == 0, written.output
    fingerprint = load_fingerprint(out)
    assert fingerprint["top_k"] == 4 and len(fingerprint["modules"]) == 16
    assert run_cli(zoo["unshipped"], "--base", zoo["other_base"], "--fingerprint", out).exit_code == 0
    assert run_cli(zoo["unshipped"], "--base", zoo["base"], "--fingerprint", out).exit_code == 1
