"""Hub ids, batches and model cards, on a Hugging Face cache laid out here exactly as huggingface_hub
lays it out (models--org--name/blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, refs/<branch>),
offline (HF_HUB_OFFLINE=1): real tiny PEFT adapters, the real audit and merge, huggingface_hub's own resolution."""

import csv
import hashlib
import io
import json
import os
import pickle
import shutil
import warnings
from contextlib import closing
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from huggingface_hub import constants, snapshot_download
from huggingface_hub.utils import filter_repo_objects
from peft import LoraConfig, get_peft_model
from tiny_models import tiny_llama, train_lora
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import mergekit_lite.audits.base as audit_base_module
from mergekit_lite.audited import run_merge
from mergekit_lite.audits.adapter import audit_adapter
from mergekit_lite.audits.fingerprint import FINGERPRINT_FILE, compute_fingerprint, write_fingerprint
from mergekit_lite.audits.thresholds import AuditThresholds
from mergekit_lite.cli.main import main
from mergekit_lite.errors import InputError
from mergekit_lite.io.hub import ADAPTER_PATTERNS, resolve_model
from mergekit_lite.merge.extract import extract_lora
from mergekit_lite.merge.schema import config_from_dict
from mergekit_lite.threads import torch_threads

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
TARGETS = ["q_proj", "v_proj", "up_proj"]
BATCH = 20


def lay_out(cache: Path, repo: str, folder: Path, commit: str = COMMIT, refs: tuple[str, ...] = ("main",)) -> Path:
    """huggingface_hub's layout: each file's bytes in blobs/<sha256>, the snapshot's file a relative link to it."""
    entry = cache / ("models--" + repo.replace("/", "--"))
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (entry / "blobs").mkdir(exist_ok=True)
    for file in sorted(folder.iterdir()):
        blob = entry / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (entry / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (entry / "refs" / ref).write_text(commit)
    return snapshot


class MarkerOnLoad:
    """Unpickling this creates `path`: the proof a pickle was (or was never) loaded."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def make_adapter(base_dir: Path, out: Path, steps: int, seed: int = 2, declared: str | None = None) -> Path:
    peft_model = get_peft_model(
        LlamaForCausalLM.from_pretrained(base_dir), LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS)
    )
    train_lora(peft_model, steps, seed=seed, batch=(4, 16))
    peft_model.save_pretrained(out)
    if declared is not None:
        config = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": declared}))
    return out


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A base published as tiny-org/base (license apache-2.0 in its card), adapters for each verdict as local
    folders and as hub repositories, a pickle-only adapter repository and a batch of BATCH adapters."""
    root = tmp_path_factory.mktemp("hub")
    with torch_threads(1):
        tiny_llama(0).save_pretrained(root / "base")
        (root / "base" / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny base\n")
        folders = {
            "good": make_adapter(root / "base", root / "good", 5, declared="tiny-org/base"),
            "noop": make_adapter(root / "base", root / "noop", 0, declared="tiny-org/base"),
            "wrong": make_adapter(root / "base", root / "wrong", 5, declared="tiny-org/other-model"),
        }
        batch = root / "batch"
        for index in range(BATCH):
            make_adapter(root / "base", batch / f"a{index:02d}", steps=index % 3, seed=index, declared="tiny-org/base")
        write_fingerprint(compute_fingerprint(root / "base", behaviour=False), root / FINGERPRINT_FILE)
    for folder in [*folders.values(), *batch.iterdir()]:
        shutil.copy(root / FINGERPRINT_FILE, folder / FINGERPRINT_FILE)
    cache = root / "cache"
    lay_out(cache, "tiny-org/base", root / "base")
    for name, folder in folders.items():
        lay_out(cache, f"tiny-org/{name}-lora", folder, refs=("main", "v1"))
    pickled = root / "pickled"
    shutil.copytree(folders["good"], pickled)
    (pickled / "adapter_model.safetensors").unlink()
    marker = root / "unpickled.marker"
    (pickled / "adapter_model.bin").write_bytes(pickle.dumps({"weights": MarkerOnLoad(marker)}))
    lay_out(cache, "tiny-org/pickled-lora", pickled)
    for index in range(0, BATCH, 2):  # half of the batch by hub id, half as folders
        lay_out(cache, f"tiny-org/batch-{index:02d}", batch / f"a{index:02d}")
    return {"root": root, "cache": cache, "base": root / "base", "batch": batch, "marker": marker, **folders}


@pytest.fixture
def offline_cache(hub, monkeypatch):
    """huggingface_hub reads its cache location per call: point it at the test's cache."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub["cache"]


def statuses(report) -> dict[str, str]:
    return {check.name: check.status for check in report.checks}


@pytest.mark.parametrize("revision", ["", f"@{COMMIT}", "@v1"], ids=["main", "commit", "tag"])
@pytest.mark.parametrize(
    "name, verdict, failed",
    [("good", "VERIFIED", None), ("noop", "REJECTED", "delta"), ("wrong", "REJECTED", "base-id")],
)
def test_hub_ids_get_the_verdicts_of_their_folders(hub, offline_cache, name, verdict, failed, revision):
    by_id = audit_adapter(
        f"tiny-org/{name}-lora{revision}", "tiny-org/base", thresholds=AuditThresholds(min_total_norm=0.01)
    )
    by_folder = audit_adapter(
        hub[name], hub["base"], base_id="tiny-org/base", thresholds=AuditThresholds(min_total_norm=0.01)
    )
    assert by_id.verdict == by_folder.verdict == verdict, by_id.reasons
    assert statuses(by_id) == statuses(by_folder)
    assert by_id.adapter == f"tiny-org/{name}-lora{revision}" and by_id.base == "tiny-org/base"
    base_id = next(check for check in by_id.checks if check.name == "base-id")
    assert (
        base_id.measurements["given"] == "tiny-org/base" and base_id.measurements["given_from"] == "the base's hub id"
    )
    if failed:
        assert statuses(by_id)[failed] == "fail"
    delta = {c.name: c for c in by_id.checks}["delta"]
    assert delta.value == pytest.approx({c.name: c for c in by_folder.checks}["delta"].value, rel=1e-6)


def test_pickle_only_hub_adapter_is_refused_without_unpickling(hub, offline_cache, tmp_path):
    # the trap is real: unpickling a pickle built like the repository's creates its marker
    trap = tmp_path / "trap.marker"
    pickle.loads(pickle.dumps(MarkerOnLoad(trap)))
    assert trap.exists()
    for allow_pickle in (False, True):  # --allow-pickle is for local files; a hub pickle is never loaded
        report = audit_adapter("tiny-org/pickled-lora", "tiny-org/base", allow_pickle=allow_pickle)
        assert report.verdict == "REJECTED" and statuses(report) == {"format": "fail"}
        assert "ships only pickled weights (adapter_model.bin)" in report.reasons[0]
        assert "without downloading or unpickling" in report.reasons[0]
    assert not hub["marker"].exists()
    # online, huggingface_hub filters the repository's listing through these patterns: the pickle is never fetched
    listing = ["adapter_config.json", "adapter_model.bin", "README.md", "tokenizer.json", "training_args.bin"]
    assert sorted(filter_repo_objects(listing, allow_patterns=ADAPTER_PATTERNS)) == [
        "README.md",
        "adapter_config.json",
        "tokenizer.json",
    ]
    result = CliRunner().invoke(main, ["audit", "tiny-org/pickled-lora", "--base", "tiny-org/base"])
    assert result.exit_code == 1 and "REJECTED" in result.output
    assert not hub["marker"].exists()


def escape_cases(cache: Path, outside: Path) -> dict[str, str]:
    """Hub ids whose resolution would leave their repository's cache folder, one per way out."""
    cases = {}
    entry = lay_out(cache, "evil/refs-dotdot", outside).parent.parent
    (entry / "refs" / "main").write_text(os.path.relpath(outside, entry / "snapshots"))
    cases["refs/main holds .."] = "evil/refs-dotdot"
    entry = lay_out(cache, "evil/refs-link", outside).parent.parent
    (entry / "refs" / "main").unlink()
    stolen = outside.parent / "stolen-ref"
    stolen.write_text(COMMIT)
    (entry / "refs" / "main").symlink_to(stolen)
    cases["refs/main links out"] = "evil/refs-link"
    lay_out(cache, "evil/revision", outside)
    cases["@revision holds .."] = "evil/revision@../../../" + outside.name
    entry = cache / "models--evil--snapshot-link"
    (entry / "snapshots").mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(COMMIT)
    (entry / "snapshots" / COMMIT).symlink_to(outside, target_is_directory=True)
    cases["snapshot links out"] = "evil/snapshot-link"
    snapshot = lay_out(cache, "evil/file-link", outside)
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(outside / "config.json")
    cases["a file links out"] = "evil/file-link"
    return cases


def test_refs_and_revisions_that_walk_out_are_refused(hub, tmp_path):
    cache = tmp_path / "cache"
    outside = tmp_path / "outside-model"
    shutil.copytree(hub["base"], outside)
    cases = escape_cases(cache, outside)
    # huggingface_hub itself follows refs/main out of the cache: the check has to be ours
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_CACHE", str(cache))
        patch.setenv("HF_HUB_CACHE", str(cache))
        assert Path(snapshot_download("evil/refs-dotdot", local_files_only=True)).resolve() == outside.resolve()
        for reference in cases.values():
            with pytest.raises(InputError, match="refused"):
                resolve_model(reference)
        # and the CLI's commands (in-process through its click group, which renders errors as the console script
        # does) refuse them in one line, exit 2, before writing anything
        for why, reference in cases.items():
            for args in (
                ["audit", str(hub["good"]), "--base", reference, "-q"],
                [
                    "merge",
                    "--method",
                    "linear",
                    "--alpha",
                    "0.5",
                    "--base",
                    str(hub["base"]),
                    "--model",
                    reference,
                    "--out",
                    str(tmp_path / "merged"),
                    "-q",
                ],
            ):
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    run = CliRunner().invoke(main, args)
                lines = run.stderr.strip().splitlines()
                assert run.exit_code == 2 and len(lines) == 1, (why, args[0], run.stderr)
                assert lines[0].startswith(f"error: {reference}") and "refused" in lines[0], (why, lines[0])
                assert not (tmp_path / "merged").exists()


class Counter:
    """Wraps a real function and counts its calls (the function still runs)."""

    def __init__(self, function):
        self.function, self.calls = function, []

    def __call__(self, *args, **kwargs):
        self.calls.append(args)
        return self.function(*args, **kwargs)


@pytest.mark.slow
def test_a_batch_opens_and_measures_the_base_once(hub, offline_cache, tmp_path, monkeypatch):
    opened, decomposed = Counter(audit_base_module.open_dense), Counter(audit_base_module.top_singular)
    monkeypatch.setattr(audit_base_module, "open_dense", opened)
    monkeypatch.setattr(audit_base_module, "top_singular", decomposed)
    listing = tmp_path / "adapters.txt"
    by_id = [f"tiny-org/batch-{index:02d}" for index in range(0, BATCH, 2)]
    folders = [str(hub["batch"] / f"a{index:02d}") for index in range(1, BATCH, 2)]
    listing.write_text("# the batch\n" + "\n".join(by_id[5:]) + "\n\n" + "\n".join(folders) + "  # folders\n")
    args = ["audit", *by_id[:5], "--from-file", str(listing), "--base", "tiny-org/base", "--min-total-norm", "0.01"]
    runs = {
        form: CliRunner().invoke(main, args + flag)
        for form, flag in (("table", []), ("json", ["--json"]), ("csv", ["--csv"]))
    }
    assert len(opened.calls) == 3, "the base is opened once per run, not once per adapter"
    assert len(decomposed.calls) == 3 * 2 * len(TARGETS), "each adapted base matrix is decomposed once per run"
    for run in runs.values():
        assert run.exit_code == 1, run.output  # the untrained third of the batch is a REJECTED no-op
    table = runs["table"].output.strip().splitlines()
    assert table[0].startswith("ADAPTER") and len(table) == BATCH + 2
    assert table[-1] == f"{BATCH - 7} VERIFIED, 0 WARN, 7 REJECTED"
    reports = json.loads(runs["json"].output)["reports"]
    assert [r["adapter"] for r in reports] == by_id + folders
    assert {r["verdict"] for r in reports if r["adapter"].endswith(("00", "03", "06", "09", "12", "15", "18"))} == {
        "REJECTED"
    }
    rows = list(csv.DictReader(io.StringIO(runs["csv"].output)))
    assert [row["adapter"] for row in rows] == by_id + folders
    for row, report in zip(rows, reports, strict=True):
        delta = next(c for c in report["checks"] if c["name"] == "delta")
        assert float(row["delta_value"]) == delta["value"] and float(row["delta_threshold"]) == 0.01
        assert row["verdict"] == report["verdict"] and row["base-id_status"] == "pass"


@pytest.mark.parametrize(
    "content, message",
    [(b"", "lists no adapters"), (b"\xff\xfe", "not UTF-8"), (b"x" * (2 << 20), "larger than")],
    ids=["empty", "not-utf8", "huge"],
)
def test_from_file_is_a_checked_user_input(hub, tmp_path, content, message):
    listing = tmp_path / "list.txt"
    listing.write_bytes(content)
    result = CliRunner().invoke(main, ["audit", "--from-file", str(listing), "--base", str(hub["base"])])
    assert result.exit_code == 2 and message in result.output


def test_from_file_fifo_is_refused(hub, tmp_path):
    fifo = tmp_path / "list.fifo"
    os.mkfifo(fifo)
    result = CliRunner().invoke(main, ["audit", "--from-file", str(fifo), "--base", str(hub["base"])])
    assert result.exit_code == 2 and "not a regular file" in result.output


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_merge_output_has_a_model_card_and_loads(hub, offline_cache, tmp_path):
    config = config_from_dict(
        {
            "method": "task_arithmetic",
            "base": "tiny-org/base",
            "models": [{"model": "tiny-org/good-lora", "weight": 0.5}],
        }
    )
    out = run_merge(config, tmp_path / "merged").out
    card = (out / "README.md").read_text()
    meta = front_matter(card)
    assert meta["base_model"] == ["tiny-org/base", "tiny-org/good-lora"]
    assert meta["base_model_relation"] == "merge" and meta["library_name"] == "transformers"
    assert meta["tags"] == ["merge", "mergekit-lite"] and meta["license"] == "apache-2.0"
    assert "Method: `task_arithmetic`" in card and "| `tiny-org/good-lora` | VERIFIED |" in card, card
    assert "```yaml\nmethod: task_arithmetic" in card and "weight: 0.5" in card
    assert "# tiny base" not in card, "the base's own card is never copied over ours"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 2


def test_extracted_adapter_has_an_adapter_card(hub, tmp_path):
    tuned = tmp_path / "tuned"
    tiny_llama(1).save_pretrained(tuned)
    extract_lora(str(hub["base"]), str(tuned), str(tmp_path / "lora"), rank=4)
    meta = front_matter((tmp_path / "lora" / "README.md").read_text())
    assert meta["base_model"] == ["base"] and meta["base_model_relation"] == "adapter"
    assert meta["license"] == "apache-2.0"


def test_an_adapter_tokenizer_linked_out_of_its_folder_is_never_opened(hub, tmp_path, monkeypatch):
    import mergekit_lite.audits.fingerprint as fingerprint_module

    secret = tmp_path / "secret.json"
    secret.write_text('{"hunter2": true}')
    adapter = tmp_path / "linked-tokenizer"
    shutil.copytree(hub["good"], adapter)
    (adapter / "tokenizer.json").symlink_to(secret)
    (adapter / "tokenizer_config.json").write_text("{}")  # a regular one beside it is read
    hashed = Counter(fingerprint_module.sha256_file)
    monkeypatch.setattr(fingerprint_module, "sha256_file", hashed)
    report = audit_adapter(adapter, hub["base"])
    tokenizer = next(check for check in report.checks if check.name == "tokenizer")
    assert tokenizer.status == "warn" and "not read: tokenizer.json" in tokenizer.detail
    assert list(tokenizer.measurements["adapter_files"]) == ["tokenizer_config.json"]
    assert [Path(args[0]).name for args in hashed.calls] == ["tokenizer_config.json"]
    assert "hunter2" not in json.dumps(report.to_dict())


def test_save_best_section_renders_pick_and_intervals(hub, tmp_path):
    """The section a sweep's --save-best passes to run_merge(card_sections=...): the pick and scores with intervals."""
    from mergekit_lite.io.model_card import selection_section

    section = selection_section(
        0.3,
        [
            {
                "label": "alpha=0.3",
                "old": 0.9,
                "new": 0.8,
                "harmonic_mean": 0.847,
                "intervals": {"old": [0.85, 0.95], "harmonic_mean": [0.8, 0.89]},
            },
            {"label": "post", "old": 0.5, "new": 0.9, "harmonic_mean": 0.643},
        ],
        tied=[0.25],
    )
    config = config_from_dict(
        {
            "method": "linear",
            "base": str(hub["base"]),
            "models": [{"model": str(hub["base"])}],
            "parameters": {"alpha": 0.3},
        }
    )
    card = (run_merge(config, tmp_path / "best", card_sections=[section]).out / "README.md").read_text()
    assert front_matter(card)["base_model"] == ["base"]
    assert "## Sweep selection" in card and "alpha = 0.3" in card and "0.25" in card
    assert "| alpha=0.3 | 0.9000 [0.8500, 0.9500] | 0.8000 | 0.8470 [0.8000, 0.8900] |" in card


@pytest.mark.slow
def test_behaviour_in_a_batch_loads_the_base_once_and_gives_it_back_unchanged(hub, monkeypatch):
    """--behaviour: one loaded model serves every adapter; each sees the base's own weights (its KL equals a fresh
    audit's, whatever adapter ran before it)."""
    import mergekit_lite.audits.behaviour as behaviour_module

    loads = Counter(behaviour_module.load_causal_lm)
    monkeypatch.setattr(behaviour_module, "load_causal_lm", loads)

    def kl(report):
        return next(c for c in report.checks if c.name == "behaviour").measurements["mean_kl"]

    with closing(audit_base_module.AuditBase.open(hub["base"])) as base:
        batch = [kl(audit_adapter(hub[name], base, behaviour=True)) for name in ("good", "wrong", "good")]
    assert len(loads.calls) == 1
    fresh = kl(audit_adapter(hub["good"], hub["base"], behaviour=True))
    assert batch[0] == batch[2] == pytest.approx(fresh, rel=1e-6) and batch[0] > 0
