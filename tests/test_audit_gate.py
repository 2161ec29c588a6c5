"""The audit as a gate, on adapters trained here with PEFT: a declared base at hand is compared weight by weight,
nothing unproven is VERIFIED, every merge and sweep of an adapter says its verdict on stderr, --require-verified
refuses a WARN, and our own extracted adapters pass our own audit."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_safety import cli
from tiny_models import save_tiny_llama, tiny_model, train_lora
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from mergekit_lite.audits.adapter import audit_adapter
from mergekit_lite.audits.fingerprint import FINGERPRINT_FILE, compute_fingerprint, write_fingerprint
from mergekit_lite.audits.thresholds import AuditThresholds
from mergekit_lite.threads import torch_threads

TARGETS = ["q_proj", "v_proj", "up_proj"]


def peft_adapter(base_dir, out_dir, seed: int = 2):
    """A real PEFT adapter, a few Adam steps on the base PEFT loaded (it declares that folder, as PEFT records it)."""
    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(str(base_dir)), LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS)
    )
    train_lora(model, 5, seed=seed, batch=(4, 16)).save_pretrained(out_dir)
    return out_dir


def without_declaration(adapter_dir):
    """Nothing left that names a base: adapter_config.json's base_model_name_or_path and PEFT's model card."""
    config_file = adapter_dir / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "base_model_name_or_path": None}))
    (adapter_dir / "README.md").unlink()
    return adapter_dir


@pytest.fixture(scope="module")
def gate_zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    with torch_threads(1):
        save_tiny_llama(0, root / "base")
        save_tiny_llama(1, root / "other")
        shutil.copytree(root / "base", root / "base_copy")
        shutil.copytree(root / "base", root / "gone")
        adapters = {
            "on_other": peft_adapter(root / "other", root / "on_other"),
            "on_copy": peft_adapter(root / "base_copy", root / "on_copy"),
            "on_gone": peft_adapter(root / "gone", root / "on_gone"),
            "anonymous": without_declaration(peft_adapter(root / "base", root / "anonymous")),
        }
    shutil.rmtree(root / "gone")
    return {"root": root, "base": root / "base", "other": root / "other", **adapters}


def check_of(report, name):
    return next(check for check in report.checks if check.name == name)


def test_declared_folder_of_another_base_is_rejected_naming_it(gate_zoo):
    done = cli("audit", gate_zoo["on_other"], "--base", gate_zoo["base"])
    assert done.returncode == 1, done.stdout + done.stderr
    row = done.stdout.splitlines()[1]
    assert (
        " REJECTED " in row
        and f"the declared folder {gate_zoo['other']} holds other weights than the given base "
        "(16 of 21 tensors differ: 16 hold other values"
        in row
    ), row
    report = audit_adapter(gate_zoo["on_other"], gate_zoo["base"])
    assert check_of(report, "base-id").measurements["weights_differing"] == 16


def test_declared_folder_holding_the_given_weights_passes_the_base_check(gate_zoo):
    report = audit_adapter(gate_zoo["on_copy"], gate_zoo["base"])
    base_id = check_of(report, "base-id")
    assert base_id.status == "pass" and base_id.detail == (
        f"the declared folder {gate_zoo['root'] / 'base_copy'} holds the given base's weights (all 21 tensors equal)"
    )
    assert check_of(report, "spectral").status == "pass", "the weights prove the base: no fingerprint needed"
    assert report.verdict == "VERIFIED", report.reasons


def test_missing_declared_folder_warns_saying_so(gate_zoo):
    report = audit_adapter(gate_zoo["on_gone"], gate_zoo["base"])
    assert report.verdict == "WARN"
    assert report.reasons[0] == (
        f"base-id: declares the local folder {gate_zoo['root'] / 'gone'}, which does not exist "
        "here: its weights cannot be compared with the given base's"
    )


@pytest.mark.parametrize("shipped", [False, True], ids=["bare", "with-fingerprint"])
def test_without_a_declared_base_nothing_is_verified(gate_zoo, tmp_path, shipped):
    """No declared base: even the base's own fingerprint, shipped beside it, leaves base-id a WARN."""
    adapter = shutil.copytree(gate_zoo["anonymous"], tmp_path / "anonymous")
    if shipped:
        write_fingerprint(compute_fingerprint(gate_zoo["base"], behaviour=False), adapter / FINGERPRINT_FILE)
    report = audit_adapter(adapter, gate_zoo["base"])
    assert report.verdict == "WARN" and check_of(report, "base-id").status == "warn"
    assert (
        (check_of(report, "signature").status == "pass") == shipped
        if shipped
        else "signature" not in [check.name for check in report.checks]
    )


def test_audit_exit_codes(gate_zoo, tmp_path):
    """0 VERIFIED or WARN, 1 REJECTED (and WARN under --require-verified), 2 unusable input."""
    base = ["--base", gate_zoo["base"]]
    assert cli("audit", gate_zoo["on_copy"], *base, "--require-verified").returncode == 0
    assert cli("audit", gate_zoo["anonymous"], *base).returncode == 0
    assert cli("audit", gate_zoo["anonymous"], *base, "--require-verified").returncode == 1
    assert cli("audit", gate_zoo["on_other"], *base).returncode == 1
    missing = cli("audit", tmp_path / "nowhere", *base)
    assert missing.returncode == 2 and missing.stderr.startswith("error: ")
    help_text = cli("audit", "--help").stdout
    for line in (
        "0  every adapter VERIFIED, or some WARN",
        "1  some adapter REJECTED; with --require-verified, also some WARN",
        "2  unusable input",
    ):
        assert line in help_text


def warn_line(stderr: str, adapter) -> str:
    """The one stderr line that gives the adapter's verdict."""
    lines = [line for line in stderr.splitlines() if line.startswith(f"audit: {adapter}: ")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_merge_of_a_warn_adapter_says_so_and_require_verified_refuses_it(gate_zoo, tmp_path):
    args = ["merge", "--method", "task_arithmetic", "--base", gate_zoo["base"], "--model", f"{gate_zoo['anonymous']}:1"]
    merged = cli(*args, "--out", tmp_path / "merged", "-q")
    assert merged.returncode == 0, merged.stderr
    assert warn_line(merged.stderr, gate_zoo["anonymous"]).startswith(
        f"audit: {gate_zoo['anonymous']}: WARN (base-id: adapter_config.json declares no base_model_name_or_path"
    )
    card = (tmp_path / "merged" / "README.md").read_text()  # reasons as plain markdown text: `_` escaped
    assert "| `anonymous` | WARN | base-id: adapter\\_config.json declares no" in card
    refused = cli(*args, "--out", tmp_path / "refused", "-q", "--require-verified")
    assert refused.returncode == 1 and not (tmp_path / "refused").exists()
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"error: adapter {gate_zoo['anonymous']} is WARN, not VERIFIED, and --require-verified was given: base-id: "
        )
    )
    verified = cli(
        "merge",
        "--method",
        "task_arithmetic",
        "--base",
        gate_zoo["base"],
        "--model",
        f"{gate_zoo['on_copy']}:1",
        "--out",
        tmp_path / "verified",
        "-q",
        "--require-verified",
    )
    assert verified.returncode == 0 and warn_line(verified.stderr, gate_zoo["on_copy"]).endswith(": VERIFIED")


def test_a_model_lora_reference_says_its_verdict(gate_zoo, tmp_path):
    done = cli(
        "merge",
        "--method",
        "linear",
        "--model",
        f"{gate_zoo['base']}+{gate_zoo['anonymous']}",
        "--model",
        gate_zoo["base"],
        "--out",
        tmp_path / "out",
        "-q",
    )
    assert done.returncode == 0, done.stderr
    assert ": WARN (base-id: " in warn_line(done.stderr, gate_zoo["anonymous"])


@pytest.mark.slow
def test_sweep_of_a_warn_adapter_says_so_and_require_verified_refuses_it(toy_pair, tmp_path):
    """`sweep --post ADAPTER`: the verdict on stderr before anything is evaluated (once, not once per point)."""
    with torch_threads(1):
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(toy_pair.pre_dir),
            LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS),
        )
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for step in range(5):
            tokens = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(step))
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.save_pretrained(tmp_path / "adapter")
    adapter = without_declaration(tmp_path / "adapter")
    args = [
        "sweep",
        "--pre",
        toy_pair.pre_dir,
        "--post",
        adapter,
        "--include-path",
        toy_pair.task_dir,
        "--old-tasks",
        ",".join(toy_pair.old_tasks),
        "--new-tasks",
        ",".join(toy_pair.new_tasks),
        "--alphas",
        "0.5",
        "--limit",
        "8",
        "--bootstrap",
        "0",
        "-q",
    ]
    refused = cli(*args, "--out", tmp_path / "refused", "--require-verified")
    assert refused.returncode == 1 and not (tmp_path / "refused").exists()
    assert ": WARN (base-id: " in warn_line(refused.stderr, adapter)
    swept = cli(*args, "--out", tmp_path / "run")
    assert swept.returncode == 0, swept.stderr
    assert ": WARN (base-id: " in warn_line(swept.stderr, adapter)


def test_layers_the_config_leaves_out_are_rejected(gate_zoo, tmp_path):
    adapter = shutil.copytree(gate_zoo["on_copy"], tmp_path / "layers")
    config_file = adapter / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "layers_to_transform": [0]}))
    done = cli("audit", adapter, "--base", gate_zoo["base"])
    assert done.returncode == 1 and " REJECTED " in done.stdout
    assert (
        "LoRA tensors for 3 modules in layers that layers_to_transform [0] leaves out (PEFT would not load "
        "them): model.layers.1.mlp.up_proj.weight" in done.stdout
    )


@pytest.mark.parametrize("architecture", ["gemma2", "phi3", "olmo2"])
def test_extracted_adapters_ship_their_base_fingerprint_and_pass(architecture, tmp_path):
    """extract writes base_fingerprint.json beside the adapter: VERIFIED against its base, and the fingerprint
    alone still checks the base when the declared folder is not at hand."""
    with torch_threads(1):
        tiny_model(architecture).save_pretrained(tmp_path / "pre")
        tiny_model(architecture, seed=1, shift=0.02).save_pretrained(tmp_path / "post")
    done = cli(
        "extract",
        "--base",
        tmp_path / "pre",
        "--model",
        tmp_path / "post",
        "--rank",
        "4",
        "--out",
        tmp_path / "lora",
        "-q",
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "lora" / FINGERPRINT_FILE).is_file()
    thresholds = AuditThresholds(min_total_norm=1e-3)  # the paper's norm rule is for 7-8B models
    report = audit_adapter(tmp_path / "lora", tmp_path / "pre", thresholds=thresholds)
    assert report.verdict == "VERIFIED", report.reasons
    moved = without_declaration(shutil.copytree(tmp_path / "lora", tmp_path / "moved"))
    alone = audit_adapter(moved, tmp_path / "pre", thresholds=thresholds)
    assert [check.name for check in alone.checks if check.status != "pass"] == ["base-id"]
    assert {check_of(alone, "signature").status, check_of(alone, "spectral").status} == {"pass"}
    other = audit_adapter(moved, tmp_path / "post", thresholds=thresholds)
    assert other.verdict == "REJECTED" and check_of(other, "signature").status == "fail"


@pytest.mark.slow
def test_the_example_script_lists_only_verified_adapters_from_a_fresh_shell(gate_zoo, tmp_path):
    """examples/audit_adapters.sh as the docs show it, in a bare environment (PATH with the console script, no
    activated virtualenv): WARN is not mergeable unless --allow-warn; REJECTED makes it exit 1."""
    script = Path(__file__).resolve().parent.parent / "examples" / "audit_adapters.sh"
    environment = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONPATH": str(script.parent.parent),
        "HF_HUB_OFFLINE": "1",
    }
    adapters = [gate_zoo["on_copy"], gate_zoo["anonymous"]]

    def run(*args):
        return subprocess.run(
            ["bash", str(script), *map(str, args)],
            env=environment,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )

    strict = run(gate_zoo["base"], *adapters)
    assert strict.returncode == 0, strict.stderr
    assert strict.stdout.splitlines() == [str(gate_zoo["on_copy"])]
    assert "WARN" in strict.stderr and list(tmp_path.iterdir()) == []
    lenient = run("--allow-warn", gate_zoo["base"], *adapters, gate_zoo["on_other"])
    assert lenient.returncode == 1 and lenient.stdout.splitlines() == list(map(str, adapters))
