"""Adapter audits on real tiny PEFT adapters: one per verdict, the fingerprint, leakage, and the CLI's exit codes."""

import json
import shutil
from contextlib import closing
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from open_files import closes_what_it_opens, files_open_under
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from tiny_models import VOCAB, tiny_llama, train_lora
from transformers import LlamaForCausalLM

from mergekit_lite.audits import fingerprint as fingerprint_module
from mergekit_lite.audits.adapter import audit_adapter, find_adapters, require_verified, target_mismatch
from mergekit_lite.audits.base import AuditBase
from mergekit_lite.audits.fingerprint import (
    FINGERPRINT_FILE,
    compute_fingerprint,
    load_fingerprint,
    top_singular,
    write_fingerprint,
)
from mergekit_lite.audits.leakage import check_leakage, find_contamination
from mergekit_lite.audits.thresholds import AuditThresholds
from mergekit_lite.cli.main import main
from mergekit_lite.errors import InputError
from mergekit_lite.threads import torch_threads


def make_adapter(base_dir, out_dir, target_modules, steps: int, modules_to_save=None, **save_options):
    """A real PEFT adapter on the saved base, trained `steps` Adam steps on random tokens (0 steps: B stays zero)."""
    peft_model = get_peft_model(
        LlamaForCausalLM.from_pretrained(base_dir),
        LoraConfig(r=4, lora_alpha=16, target_modules=target_modules, modules_to_save=modules_to_save),
    )
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
    return {
        "root": root,
        "base": root / "base",
        "other_base": root / "other_base",
        "wide_base": root / "wide_base",
        "adapters": adapters,
        "good": good,
        "untrained": untrained,
        "pickled": root / "pickled",
        "nan": nan,
        "embedding": embedding,
        "unshipped": unshipped,
    }


def statuses(report) -> dict[str, str]:
    return {check.name: check.status for check in report.checks}


def check_of(report, name: str):
    """The report's check of that name: tests read its detail and measurements, not only its status."""
    return next(check for check in report.checks if check.name == name)


def edit_config(adapter_dir, edit):
    """Rewrite the adapter's adapter_config.json through `edit` (dict -> dict): real tensors, one field changed."""
    path = adapter_dir / "adapter_config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return adapter_dir


def scaled_adapter(source, target, factor_of):
    """A copy of the adapter with each tensor multiplied by factor_of(its name): a crafted update size."""
    shutil.copytree(source, target)
    tensors = load_file(target / "adapter_model.safetensors")
    scaled = {key: value * factor_of(key) for key, value in tensors.items()}
    save_file(scaled, str(target / "adapter_model.safetensors"))
    return target


def test_good_adapter_is_verified(zoo):
    report = audit_adapter(zoo["good"], zoo["base"])
    assert report.verdict == "VERIFIED", report.reasons
    assert statuses(report) == {
        "format": "pass",
        "base-id": "pass",
        "structure": "pass",
        "tokenizer": "pass",
        "signature": "pass",
        "spectral": "pass",
        "delta": "pass",
    }
    checks = {check.name: check for check in report.checks}
    assert checks["spectral"].value > 0.999
    assert checks["structure"].value == pytest.approx(6 / 16)
    assert "scaling 4 (alpha/r)" in checks["format"].detail
    assert "declares this base folder" in checks["base-id"].detail
    assert (
        1.0
        <= checks["delta"].measurements["modules"]["model.layers.0.self_attn.q_proj.weight"]["effective_rank"]
        <= 4.0
    )
    assert json.loads(json.dumps(report.to_dict()))["verdict"] == "VERIFIED"


def test_adapter_made_on_another_base_is_rejected(zoo):
    report = audit_adapter(zoo["good"], zoo["other_base"])
    assert report.verdict == "REJECTED"
    assert statuses(report)["spectral"] == "fail"
    assert statuses(report)["structure"] == "pass", "same architecture: only the fingerprint can tell"
    assert statuses(report)["base-id"] == "fail", "declares the base folder, whose weights are not other_base's"
    assert "16 of 21 tensors differ: 16 hold other values" in report.reasons[0], (
        "the 5 norm weights are all ones in both"
    )
    assert "not the base in the signature" in report.reasons[1]
    assert "16 of 21 signed tensors hold other values" in report.reasons[1]
    assert "does not match the adapter's base fingerprint" in report.reasons[2]


def test_without_fingerprint_the_declared_folder_decides(zoo):
    """No fingerprint: the declared folder's weights are the evidence; the alignment heuristic never fails."""
    own = audit_adapter(zoo["unshipped"], zoo["base"])
    assert own.verdict == "VERIFIED" and "no base fingerprint needed" in check_of(own, "spectral").detail
    other = audit_adapter(zoo["unshipped"], zoo["other_base"])
    assert [c.name for c in other.checks if c.status == "fail"] == ["base-id"]
    assert statuses(other)["spectral"] in ("pass", "warn")


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
    peft_model = get_peft_model(
        LlamaForCausalLM.from_pretrained(root / "base"),
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    fit(peft_model, markov_batches(200, 40), 3e-3)
    peft_model.save_pretrained(root / "adapter")
    return root


@pytest.mark.slow
def test_without_fingerprint_alignment_tells_a_learned_base(pretrained_pair):
    own = audit_adapter(pretrained_pair / "adapter", pretrained_pair / "base")
    twin = audit_adapter(pretrained_pair / "adapter", pretrained_pair / "twin")
    assert (own.verdict, statuses(own)["spectral"]) == ("VERIFIED", "pass")
    assert (twin.verdict, statuses(twin)["base-id"], statuses(twin)["spectral"]) == ("REJECTED", "fail", "warn")
    alignment = {report.base: next(c.value for c in report.checks if c.name == "spectral") for report in (own, twin)}
    assert alignment[str(pretrained_pair / "base")] > 2 * alignment[str(pretrained_pair / "twin")]


def test_explicit_fingerprint_overrides_the_shipped_one(zoo):
    other = zoo["root"] / "other_fingerprint.json"
    write_fingerprint(compute_fingerprint(zoo["other_base"]), other)
    assert audit_adapter(zoo["good"], zoo["base"], fingerprint=other).verdict == "REJECTED"
    assert statuses(audit_adapter(zoo["unshipped"], zoo["other_base"], fingerprint=other))["spectral"] == "pass"


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
    assert statuses(allowed) == {
        "format": "warn",
        "base-id": "pass",
        "structure": "pass",
        "tokenizer": "pass",
        "signature": "pass",
        "spectral": "pass",
        "delta": "pass",
    }


def test_nan_adapter_is_rejected(zoo):
    report = audit_adapter(zoo["nan"], zoo["base"])
    assert report.verdict == "REJECTED"
    assert statuses(report) == {"format": "fail"}
    assert "NaN/Inf" in report.reasons[0]


def test_shape_mismatch_is_a_structural_failure(zoo):
    report = audit_adapter(zoo["unshipped"], zoo["wide_base"])
    assert report.verdict == "REJECTED"
    assert statuses(report) == {"format": "pass", "base-id": "fail", "structure": "fail"}
    assert "another model size" in check_of(report, "structure").detail


def test_carried_base_embedding_must_equal_the_base(zoo):
    assert statuses(audit_adapter(zoo["embedding"], zoo["base"]))["structure"] == "pass"
    report = audit_adapter(zoo["embedding"], zoo["other_base"])
    assert statuses(report)["structure"] == "fail"
    assert "copy of model.embed_tokens.weight differs" in check_of(report, "structure").detail


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
    with pytest.raises(
        InputError, match="REJECTED: base-id: made on another base.*signature: .*spectral: .*use --force"
    ):
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
    assert [(r["adapter"].split("/")[-1], r["verdict"]) for r in reports] == [
        ("good", "VERIFIED"),
        ("untrained", "REJECTED"),
    ]
    verbose = run_cli("--base", zoo["base"], "-v", zoo["pickled"], "--allow-pickle")
    assert verbose.exit_code == 0 and "WARN" in verbose.stdout and "threshold 0.95" in verbose.stdout
    for args in (
        [zoo["root"] / "missing", "--base", zoo["base"]],
        [zoo["base"], "--base", zoo["base"]],
        [zoo["good"], "--base", zoo["root"] / "missing"],
    ):
        unusable = run_cli(*args)
        assert unusable.exit_code == 2
        assert unusable.stderr.startswith("error: ") and unusable.stderr.count("\n") == 1


def test_cli_fingerprint_subcommand(zoo, tmp_path):
    out = tmp_path / "fp.json"
    written = run_cli("fingerprint", zoo["other_base"], "--out", out, "--top-k", "4")
    assert written.exit_code == 0, written.output
    fingerprint = load_fingerprint(out)
    assert fingerprint["top_k"] == 4 and len(fingerprint["modules"]) == 16
    anonymous = edit_config(
        shutil.copytree(zoo["unshipped"], tmp_path / "anonymous"),
        lambda config: {**config, "base_model_name_or_path": None},
    )
    (anonymous / "README.md").unlink()
    assert run_cli(anonymous, "--base", zoo["other_base"], "--fingerprint", out).exit_code == 0
    assert run_cli(anonymous, "--base", zoo["base"], "--fingerprint", out).exit_code == 1


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_audits_and_fingerprints_close_the_base_files_they_open(zoo, tmp_path):
    """An audit reads the base's shards. One that opened its base (a folder or a hub id) closes it before it
    returns, a batch's shared base stays open from one adapter to the next and is closed with the batch, and the
    fingerprint closes its base too: none of them leaves a handle for the garbage collector."""
    with closes_what_it_opens(zoo["base"]):
        assert audit_adapter(zoo["good"], zoo["base"]).verdict == "VERIFIED"
    with closes_what_it_opens(zoo["base"]):
        compute_fingerprint(zoo["base"])
    with closes_what_it_opens(zoo["base"]):
        assert run_cli(zoo["adapters"], "--base", zoo["base"]).exit_code == 1  # the untrained one: REJECTED
    with closes_what_it_opens(zoo["base"]):
        assert run_cli("fingerprint", zoo["base"], "--out", tmp_path / "fp.json").exit_code == 0
    with closes_what_it_opens(zoo["base"]), closing(AuditBase.open(zoo["base"])) as shared:
        for ref in find_adapters([zoo["adapters"]]):
            audit_adapter(ref, shared)
            assert files_open_under(zoo["base"]), "the shared base was closed between adapters"


def test_a_folder_of_adapters_does_not_follow_links_out_of_it(zoo, tmp_path):
    """Reads stay inside the paths the user named: a linked adapter is audited when named itself."""
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "linked").symlink_to(zoo["good"], target_is_directory=True)
    with pytest.raises(InputError, match=r"linked: links out of .*pool; name the adapter itself"):
        find_adapters([pool])
    assert [ref.path for ref in find_adapters([pool / "linked"])] == [pool / "linked"]


# --- The paper's declared-base check (Table 2, App. F) on real PEFT adapters whose base_model_name_or_path is set ---

HUB_BASE = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.fixture(scope="module")
def hub_named(tmp_path_factory):
    """A tiny base whose config records a hub id, and adapters PEFT saved declaring various bases."""
    root = tmp_path_factory.mktemp("hub_named")
    tiny_llama(0).save_pretrained(root / "base")
    config = json.loads((root / "base" / "config.json").read_text())
    (root / "base" / "config.json").write_text(json.dumps({**config, "_name_or_path": HUB_BASE}))
    declared = {
        "same": "NousResearch/Meta-Llama-3.1-8B-Instruct",
        "version": "meta-llama/Meta-Llama-3-8B-Instruct",
        "not-instruct": "meta-llama/Llama-3.1-8B",
        "4bit": "unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit",
    }
    fingerprint = compute_fingerprint(root / "base")
    for name, base_id in declared.items():
        model = LlamaForCausalLM.from_pretrained(root / "base")
        model.name_or_path = base_id  # what PEFT records as base_model_name_or_path
        peft_model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])
        )
        train_lora(peft_model, 5, seed=2, batch=(4, 16)).save_pretrained(root / name)
        write_fingerprint(fingerprint, root / name / FINGERPRINT_FILE)
        assert json.loads((root / name / "adapter_config.json").read_text())["base_model_name_or_path"] == base_id
    return root


@pytest.mark.parametrize(
    "adapter, verdict, reason",
    [
        ("same", "VERIFIED", None),
        ("version", "REJECTED", "version mismatch: declared llama-3-8b, given llama-3.1-8b"),
        (
            "not-instruct",
            "REJECTED",
            "declares the base (non-Instruct) variant, the given base is the Instruct/chat variant",
        ),
        ("4bit", "REJECTED", "declares a quantised base (bnb-4bit)"),
    ],
)
def test_declared_base_against_the_given_one(hub_named, adapter, verdict, reason):
    report = audit_adapter(hub_named / adapter, hub_named / "base")
    assert report.verdict == verdict, report.reasons
    base_check = next(check for check in report.checks if check.name == "base-id")
    assert base_check.measurements["given"] == HUB_BASE
    if reason:
        assert report.reasons[0].startswith("base-id: ") and reason in report.reasons[0]
        assert [c.name for c in report.checks if c.status == "fail"] == ["base-id"], "only the declared base is wrong"


def test_declared_base_needs_an_id_to_compare_with(hub_named, zoo):
    unverifiable = audit_adapter(hub_named / "version", zoo["base"])  # zoo's base config has a local _name_or_path
    assert unverifiable.verdict == "WARN" and "pass --base-id" in unverifiable.reasons[0]
    named = audit_adapter(hub_named / "version", zoo["base"], base_id="meta-llama/Meta-Llama-3-8B-Instruct")
    assert next(c.status for c in named.checks if c.name == "base-id") == "pass"
    quantised = hub_named / "quantised_base"
    shutil.copytree(hub_named / "base", quantised)
    config = json.loads((quantised / "config.json").read_text())
    (quantised / "config.json").write_text(
        json.dumps({**config, "quantization_config": {"quant_method": "bitsandbytes"}})
    )
    assert (
        "the given base is quantised (quant_method bitsandbytes)"
        in audit_adapter(hub_named / "same", quantised).reasons[0]
    )


@pytest.mark.parametrize(
    "edit",
    [
        lambda config: {k: v for k, v in config.items() if k != "base_model_name_or_path"},
        lambda config: {**config, "base_model_name_or_path": ""},
    ],
    ids=["missing", "empty"],
)
def test_adapter_declaring_no_base_warns(zoo, tmp_path, edit):
    """Nothing says which base the adapter was made on: the name check cannot pass or fail, so it warns (the
    fingerprint's checks still pass)."""
    anonymous = tmp_path / "anonymous"
    shutil.copytree(zoo["good"], anonymous)
    carded = audit_adapter(edit_config(anonymous, edit), zoo["base"])  # PEFT's own README.md names base_model
    assert (
        carded.verdict == "VERIFIED"
        and check_of(carded, "base-id").measurements["declared_in"] == "README.md base_model"
    )
    (anonymous / "README.md").unlink()
    report = audit_adapter(anonymous, zoo["base"])
    assert report.verdict == "WARN" and [c.name for c in report.checks if c.status != "pass"] == ["base-id"]
    assert report.reasons == [
        "base-id: adapter_config.json declares no base_model_name_or_path: "
        "nothing says which base the adapter was made on"
    ]


# --- Behaviour (App. I): the KL check on tiny trained models, and the fingerprint's recorded outputs ---


@pytest.fixture(scope="module")
def behaviour_zoo(pretrained_pair, tmp_path_factory):
    """On the pretrained pair: a real adapter, a no-op one (B zero), one made on the twin; each ships its base's fingerprint."""
    root = tmp_path_factory.mktemp("behaviour")
    fingerprints = {name: compute_fingerprint(pretrained_pair / name) for name in ("base", "twin")}
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for name, made_on, steps in (("real", "base", None), ("no-op", "base", 0), ("other-base", "twin", 40)):
        if steps is None:
            shutil.copytree(pretrained_pair / "adapter", root / name)
        else:
            peft_model = get_peft_model(
                LlamaForCausalLM.from_pretrained(pretrained_pair / made_on),
                LoraConfig(r=4, lora_alpha=8, target_modules=targets),
            )
            fit(peft_model, markov_batches(200, steps), 3e-3)
            peft_model.save_pretrained(root / name)
        write_fingerprint(fingerprints[made_on], root / name / FINGERPRINT_FILE)
    return root


@pytest.mark.slow
def test_kl_check_separates_real_no_op_and_another_base(behaviour_zoo, pretrained_pair):
    reports = {
        name: audit_adapter(behaviour_zoo / name, pretrained_pair / "base", behaviour=True)
        for name in ("real", "no-op", "other-base")
    }
    checks = {name: next(c for c in report.checks if c.name == "behaviour") for name, report in reports.items()}
    measured = {name: check.measurements for name, check in checks.items()}
    assert checks["real"].status == "pass", checks["real"].detail
    assert measured["real"]["mean_kl"] > 1e-2 and measured["real"]["base_vs_fingerprint_kl"] < 1e-6
    assert checks["no-op"].status == "fail" and checks["no-op"].detail.startswith("no-op")
    assert measured["no-op"]["mean_kl"] < 1e-6 and measured["no-op"]["top1_agreement"] == 1.0
    assert checks["other-base"].status == "fail"
    assert "does not behave like the base the adapter's fingerprint recorded" in checks["other-base"].detail
    assert measured["other-base"]["base_vs_fingerprint_kl"] > 10 * AuditThresholds().max_base_kl
    # Why the recorded outputs are needed: the adapter's own KL sits between the paper's two thresholds.
    assert AuditThresholds().min_kl < measured["other-base"]["mean_kl"] < AuditThresholds().max_kl


def sharpened_copy(base_dir, factor: float, out_dir):
    """The base with its head scaled by `factor`: the same greedy tokens, log-probabilities `factor` times further
    apart. The tiny pretrained base spans ~11 nats between its likeliest and unlikeliest token, a real LLM far more;
    the paper's 20-nat rule only has room to fire on a base that confident."""
    model = LlamaForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.mark.slow
def test_kl_above_the_paper_limit_is_rejected_as_another_base(pretrained_pair, tmp_path):
    """Reaches the paper's 'KL > 20: likely wrong base' rule, which the other-base adapter above never does: on a
    confident base an update 10x the trained one moves every probe's greedy token, and the base's likely tokens
    lose their mass. Held in the authors' direction KL(base || base+adapter) (src/audit_checks.py,
    check_output_divergence): the real adapter on that base stays below 20 nats that way but passes 20
    the other way, which the 20-nat rule would have called another base."""
    sharp = sharpened_copy(pretrained_pair / "base", 10, tmp_path / "sharp")
    loud = scaled_adapter(pretrained_pair / "adapter", tmp_path / "loud", lambda key: 10.0 if "lora_B" in key else 1.0)
    real = check_of(audit_adapter(pretrained_pair / "adapter", sharp, behaviour=True), "behaviour")
    assert real.status == "pass" and real.measurements["mean_kl"] < AuditThresholds().max_kl
    assert real.measurements["mean_reverse_kl"] > AuditThresholds().max_kl, "recorded only: never held to the rule"
    report = audit_adapter(loud, sharp, behaviour=True)
    behaviour = check_of(report, "behaviour")
    assert report.verdict == "REJECTED" and [c.name for c in report.checks if c.status == "fail"] == [
        "base-id",
        "behaviour",
    ]
    assert behaviour.detail.startswith("extreme divergence, likely another base: ")
    assert behaviour.value > behaviour.threshold == AuditThresholds().max_kl
    assert behaviour.measurements["top1_agreement"] == 0.0


@pytest.mark.slow
def test_kl_check_without_a_fingerprint_still_finds_the_no_op(behaviour_zoo, pretrained_pair, tmp_path):
    no_op = tmp_path / "no-op"
    shutil.copytree(behaviour_zoo / "no-op", no_op)
    (no_op / FINGERPRINT_FILE).unlink()
    check = next(
        c for c in audit_adapter(no_op, pretrained_pair / "base", behaviour=True).checks if c.name == "behaviour"
    )
    assert check.status == "fail" and "seeded token ids" in check.measurements["probes"]
    assert check.measurements["base_vs_fingerprint_kl"] is None


@pytest.mark.slow
def test_kl_is_the_papers_direction_measured_as_peft_runs_the_adapter(pretrained_pair):
    """The authors' output-divergence check (src/audit_checks.py, check_output_divergence) weights the log-ratio by
    the base's probabilities: KL(base || base+adapter). Measured independently here with PEFT's own unmerged
    forward pass on the audit's probes: the audit must report that per probe, not the reverse direction."""
    from peft import PeftModel

    from mergekit_lite.audits.behaviour import probe_ids

    behaviour = check_of(
        audit_adapter(pretrained_pair / "adapter", pretrained_pair / "base", behaviour=True), "behaviour"
    )
    base = LlamaForCausalLM.from_pretrained(pretrained_pair / "base").eval()
    probes, _ = probe_ids(pretrained_pair / "base", VOCAB)
    with torch.no_grad():
        base_logp = torch.stack(
            [torch.log_softmax(base(input_ids=torch.tensor([ids])).logits[0, -1], -1) for ids in probes]
        )
        peft_model = PeftModel.from_pretrained(base, pretrained_pair / "adapter").eval()
        adapted_logp = torch.stack(
            [torch.log_softmax(peft_model(input_ids=torch.tensor([ids])).logits[0, -1], -1) for ids in probes]
        )
    paper = (base_logp.exp() * (base_logp - adapted_logp)).sum(-1)
    reverse = (adapted_logp.exp() * (adapted_logp - base_logp)).sum(-1)
    assert behaviour.measurements["kl_direction"] == "KL(base || base+adapter)"
    torch.testing.assert_close(torch.tensor(behaviour.measurements["per_probe_kl"]), paper, rtol=1e-3, atol=1e-6)
    assert behaviour.measurements["mean_kl"] == pytest.approx(float(paper.mean()), rel=1e-3)
    assert behaviour.measurements["mean_reverse_kl"] == pytest.approx(float(reverse.mean()), rel=1e-3)
    assert abs(float(paper.mean()) - float(reverse.mean())) > 0.1, (
        "the two directions must differ for this to test anything"
    )


def test_relative_local_path_peft_recorded_is_this_base_folder(tmp_path, monkeypatch):
    """PEFT records base_model_name_or_path as the string from_pretrained was given; a base loaded from
    `models/pre` is declared as `models/pre`, which has the form of a hub id (org/name). The paper's base check
    (src/experiments/audit_pool.py, audit_one) compares that string with the expected base: a folder that is the
    given base is the best possible match, not 'another model' (and never a failure when --base-id names it)."""
    monkeypatch.chdir(tmp_path)
    tiny_llama(0).save_pretrained("models/pre")
    tiny_llama(1).save_pretrained("models/other")
    adapter = make_adapter("models/pre", tmp_path / "adapter", ["q_proj", "v_proj", "up_proj"], steps=5)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == "models/pre"
    for base, base_id in (
        ("models/pre", None),
        (tmp_path / "models" / "pre", None),
        ("models/pre", "meta-llama/Llama-3.1-8B"),
    ):
        base_check = check_of(audit_adapter(adapter, base, base_id=base_id), "base-id")
        assert base_check.status == "pass" and "declares this base folder (models/pre)" in base_check.detail, (
            base_check.detail
        )
    other = check_of(audit_adapter(adapter, "models/other"), "base-id")
    assert other.status == "fail" and "the declared folder models/pre holds other weights" in other.detail


@pytest.mark.parametrize(
    "options",
    [
        dict(rank_pattern={"v_proj": 2, "layers.1.self_attn.q_proj": 8}, alpha_pattern={"up_proj": 3, "q_proj": 32}),
        dict(use_rslora=True, rank_pattern={"v_proj": 2}, alpha_pattern={"v_proj": 5}),
        dict(target_modules=["embed_tokens", "lm_head", "q_proj"]),
    ],
    ids=["patterns", "rslora-patterns", "embedding-and-head"],
)
def test_delta_norms_are_the_update_peft_merges(zoo, tmp_path, options):
    """The paper's total norm is sqrt(sum ||scaling*B@A||_F^2) with scaling alpha/r, or alpha/sqrt(r) under rsLoRA
    (src/utils.py extract_lora_delta; src/experiments/audit_pool.py audit_one). Each module's norm must be that of
    the update PEFT's merge_and_unload applies, so per-module rank/alpha patterns and embedding LoRA count as PEFT
    counts them (theirs uses one global scaling and skips lora_embedding_A/B: a documented difference)."""
    from peft import PeftModel

    config = {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "up_proj"], **options}
    peft_model = get_peft_model(LlamaForCausalLM.from_pretrained(zoo["base"]), LoraConfig(**config))
    train_lora(peft_model, 3, seed=2, batch=(4, 16)).save_pretrained(tmp_path / "adapter")
    base = LlamaForCausalLM.from_pretrained(zoo["base"]).state_dict()
    merged = PeftModel.from_pretrained(
        LlamaForCausalLM.from_pretrained(zoo["base"]), tmp_path / "adapter"
    ).merge_and_unload()
    updates = {
        name: float((weight - base[name]).norm())
        for name, weight in merged.state_dict().items()
        if not torch.equal(weight, base[name])
    }
    delta = check_of(audit_adapter(tmp_path / "adapter", zoo["base"]), "delta")
    measured = {name: module["delta_norm"] for name, module in delta.measurements["modules"].items()}
    assert measured.keys() == updates.keys()
    for name, norm in updates.items():
        assert measured[name] == pytest.approx(norm, rel=1e-4), name
    assert delta.value == pytest.approx(sum(norm**2 for norm in updates.values()) ** 0.5, rel=1e-4)


# --- Signature and tokenizer (App. I, made offline and dtype-proof) ---


def test_signature_matches_a_bf16_copy_and_nothing_else(zoo, tmp_path):
    LlamaForCausalLM.from_pretrained(zoo["base"]).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    report = audit_adapter(zoo["good"], tmp_path / "bf16", behaviour=True)
    signature = next(c for c in report.checks if c.name == "signature")
    assert signature.status == "pass" and "dtypes/shapes" in signature.detail
    assert signature.measurements["differing"] == [] and not signature.measurements["same_tensor_table"]
    behaviour = next(c for c in report.checks if c.name == "behaviour")
    assert behaviour.measurements["base_vs_fingerprint_kl"] < AuditThresholds().max_base_kl / 100


def word_tokenizer(size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def test_tokenizer_larger_than_the_base_vocabulary_is_rejected(zoo, tmp_path):
    same, larger = tmp_path / "same", tmp_path / "larger"
    for folder, size in ((same, VOCAB), (larger, VOCAB + 20)):
        shutil.copytree(zoo["unshipped"], folder)
        word_tokenizer(size).save(str(folder / "tokenizer.json"))
    word_tokenizer(VOCAB).save(str(tmp_path / "tokenizer.json"))
    shipped_same = next(c for c in audit_adapter(same, zoo["base"]).checks if c.name == "tokenizer")
    assert shipped_same.status == "warn", "the base has no tokenizer.json: the shipped one differs from nothing"
    report = audit_adapter(larger, zoo["base"])
    tokenizer = next(c for c in report.checks if c.name == "tokenizer")
    assert tokenizer.status == "fail" and "120 tokens, the base's embeddings 100 rows" in tokenizer.detail


def test_base_resized_since_the_fingerprint_fails_the_tokenizer_check(zoo, tmp_path):
    """Embeddings resized after the adapter's fingerprint was taken (tokens added): its recorded vocab_size no longer
    fits, even though the adapter's own modules (q, v, up) still fit the base's shapes."""
    model = LlamaForCausalLM.from_pretrained(zoo["base"])
    model.resize_token_embeddings(VOCAB + 28)
    model.save_pretrained(tmp_path / "resized")
    report = audit_adapter(zoo["good"], tmp_path / "resized")
    tokenizer = check_of(report, "tokenizer")
    assert report.verdict == "REJECTED" and statuses(report)["structure"] == "pass"
    assert tokenizer.status == "fail"
    assert f"vocab_size {VOCAB + 28} in the base, {VOCAB} in the base fingerprint" in tokenizer.detail
    assert f"tokenizer: {tokenizer.detail}" in report.reasons


# --- Each refusal states its real cause ---


def renamed_adapter(source, target, rename):
    shutil.copytree(source, target)
    tensors = load_file(target / "adapter_model.safetensors")
    save_file({rename(key): value for key, value in tensors.items()}, str(target / "adapter_model.safetensors"))
    return target


def test_vision_language_layout_is_named(zoo, tmp_path):
    vlm = renamed_adapter(
        zoo["unshipped"],
        tmp_path / "vlm",
        lambda key: key.replace("base_model.model.model.", "base_model.model.model.language_model."),
    )
    report = audit_adapter(vlm, zoo["base"])
    assert "different vision-language layouts" in report.reasons[0]


def test_module_names_of_another_revision_are_named(zoo, tmp_path):
    old = renamed_adapter(zoo["unshipped"], tmp_path / "old", lambda key: key.replace("q_proj", "Wqkv"))
    edit_config(old, lambda config: {**config, "target_modules": ["Wqkv", "v_proj", "up_proj"]})
    assert "this base has no module named Wqkv" in audit_adapter(old, zoo["base"]).reasons[0]


@pytest.fixture(scope="module")
def tied_base(tmp_path_factory):
    """Qwen2.5 / Llama-3.2-1B style: the head is tied to the embeddings and not stored."""
    folder = tmp_path_factory.mktemp("tied") / "base"
    tiny_llama(0, tie_word_embeddings=True).save_pretrained(folder)
    return folder


def test_lora_on_a_tied_head_is_refused_with_the_reason(tied_base, tmp_path):
    adapter = make_adapter(tied_base, tmp_path / "head-lora", ["lm_head", "q_proj"], steps=3)
    report = audit_adapter(adapter, tied_base)
    assert "the base ties lm_head to model.embed_tokens.weight" in report.reasons[0]


def test_merge_tells_the_user_the_tied_head_is_written_untied(tied_base, tmp_path):
    """The audit notes that a modules_to_save head on a tied base merges as an untied lm_head; the merge output
    changes the model's config, so `merge` must say so too, in the audit's words."""
    adapter = make_adapter(
        tied_base, tmp_path / "head-lora", ["q_proj", "v_proj"], steps=4, modules_to_save=["lm_head"]
    )
    structure = check_of(audit_adapter(adapter, tied_base), "structure")
    result = CliRunner().invoke(
        main,
        [
            "merge",
            "--method",
            "linear",
            "--base",
            str(tied_base),
            "--model",
            str(adapter),
            "--alpha",
            "1",
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stdout.splitlines() if "untied lm_head" in line]
    assert len(notes) == 1
    assert notes[0].startswith("note: head-lora: lm_head.weight (modules_to_save) replaces the head")
    assert notes[0].removeprefix("note: head-lora: ") in structure.detail
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False


def test_negative_alpha_warns(zoo, tmp_path):
    negative = tmp_path / "negative"
    shutil.copytree(zoo["good"], negative)
    edit_config(negative, lambda config: {**config, "lora_alpha": -16})
    report = audit_adapter(negative, zoo["base"])
    assert report.verdict == "WARN" and "negative lora_alpha (scaling -4" in report.reasons[0]


def test_paper_total_norm_rejects_what_one_live_module_lets_through(zoo, tmp_path):
    keep = "layers.0.self_attn.q_proj.lora_B"
    one_live = scaled_adapter(
        zoo["good"], tmp_path / "one-live", lambda key: 1.0 if "lora_A" in key or keep in key else 1e-3
    )
    strict = audit_adapter(one_live, zoo["base"], thresholds=AuditThresholds(min_total_norm=1.0))
    delta = next(c for c in strict.checks if c.name == "delta")
    assert delta.measurements["largest_relative"] > 1e-4, "the relative rule alone passes it"
    assert delta.status == "fail" and "no-op by the paper's rule" in delta.detail
    assert delta.measurements["per_module_mean_norm"] == pytest.approx(delta.value / 6)


def test_cli_json_carries_every_measure_and_threshold(hub_named):
    result = run_cli(hub_named / "version", hub_named / "same", "--base", hub_named / "base", "--json", "--behaviour")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["thresholds"]["min_total_norm"] == 1.0 and data["thresholds"]["max_kl"] == 20.0
    checks = {c["name"]: c for c in data["reports"][1]["checks"]}
    assert (
        checks["delta"]["measurements"]["min_total_norm"] == 1.0 and checks["delta"]["measurements"]["total_norm"] > 1
    )
    assert checks["behaviour"]["measurements"]["max_kl"] == 20.0 and checks["behaviour"]["measurements"]["mean_kl"] > 0
    table = run_cli(hub_named / "version", "--base", hub_named / "base")
    assert "BASE-ID" in table.stdout and "PER-MOD" in table.stdout and "fail" in table.stdout.splitlines()[1]


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_behaviour_on_cuda_measures_what_cpu_does(behaviour_zoo, pretrained_pair):
    on = {
        device: next(
            c
            for c in audit_adapter(
                behaviour_zoo / "real", pretrained_pair / "base", behaviour=True, device=device
            ).checks
            if c.name == "behaviour"
        )
        for device in ("cpu", "cuda")
    }
    assert on["cuda"].status == "pass"
    assert on["cuda"].measurements["mean_kl"] == pytest.approx(on["cpu"].measurements["mean_kl"], rel=1e-2)


def test_another_vocabulary_is_named(zoo, tmp_path):
    tiny_llama(0, vocab_size=VOCAB + 28).save_pretrained(tmp_path / "bigger_vocab")
    report = audit_adapter(zoo["embedding"], tmp_path / "bigger_vocab")
    assert (
        "vocabulary of 100 rows in the adapter, 128 in the base (vocab_size 128)"
        in check_of(report, "structure").detail
    )
