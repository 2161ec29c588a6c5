"""mergekit-yaml command lines run as `mergekit-lite merge` with only the program name changed: the lines are
taken verbatim from where users copy them (each cites its source), run side by side with mergekit 0.1.5, and
compared tensor by tensor; shard sizes in mergekit's units against mergekit's own shards; every mergekit flag
either acts, says in one line why it has nothing to do, or is refused in one line."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
from mergekit_reference import _environment, mergekit_cli
from safetensors import safe_open
from test_mergekit_compat import noisy, read_state, save_model
from test_safety import cli, one_error_line, tree_hash
from tiny_models import tiny_llama

from mergekit_lite.cli.types import ShardSize
from mergekit_lite.io import outputs
from mergekit_lite.io.safetensors import PlannedTensor, split_into_shards

# The slerp config of mlabonne's "Merge Large Language Models with mergekit" (LazyMergekit), its models replaced by
# the tiny ones here and dtype float32 (so both tools' float32 math can be compared closely).
CONFIG = """slices:
  - sources:
      - model: {base}
        layer_range: [0, 3]
      - model: {a}
        layer_range: [0, 3]
merge_method: slerp
base_model: {base}
parameters:
  t:
    - filter: self_attn
      value: [0, 0.5, 0.3, 0.7, 1]
    - filter: mlp
      value: [1, 0.5, 0.7, 0.3, 0]
    - value: 0.5
dtype: float32
"""

# Verbatim mergekit-yaml command lines (CPU ones; the GPU ones are below), as written where they were found.
COMMAND_LINES = {
    # mlabonne, "Merge Large Language Models with mergekit" (LazyMergekit notebook and article)
    "lazymergekit": "mergekit-yaml config.yaml merge --copy-tokenizer --allow-crimes --out-shard-size 1B "
    "--lazy-unpickle",
    # the mergekit-gui Space (app.py), its command without a GPU
    "mergekit_gui": "mergekit-yaml config.yaml merge --copy-tokenizer --allow-crimes -v --out-shard-size 1B "
    "--lazy-unpickle",
    # a fork of the mergekit-gui Space that keeps its caches beside the app
    "gui_with_caches": "mergekit-yaml config.yaml merge --copy-tokenizer --allow-crimes --out-shard-size 1B "
    "--lazy-unpickle --transformers-cache ./cache1 --lora-merge-cache ./cache",
}
# The same sources' lines for a machine with a GPU (mergekit-gui's has_gpu branch).
GPU_COMMAND_LINE = "mergekit-yaml config.yaml merge --copy-tokenizer --cuda --low-cpu-memory"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mergekit-cli")
    base = tiny_llama(0, num_hidden_layers=3).state_dict()
    return {"base": save_model(base, root / "base"), "a": save_model(noisy(base, 1), root / "a"), "root": root}


def workspace(models, tmp_path: Path, config: str = CONFIG) -> Path:
    """A user's folder holding config.yaml (absolute model paths: mergekit reads a bare name as a hub id)."""
    folder = tmp_path / "work"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(config.format(base=models["base"], a=models["a"]))
    return folder


def run_mergekit_line(line: str, cwd: Path) -> subprocess.CompletedProcess:
    """A mergekit-yaml command line as given, by mergekit 0.1.5's own console script, offline."""
    program, *arguments = shlex.split(line)
    assert program == "mergekit-yaml"
    result = subprocess.run(
        [str(mergekit_cli()), *arguments], cwd=cwd, capture_output=True, text=True, env=_environment(), timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def run_lite_line(line: str, cwd: Path) -> subprocess.CompletedProcess:
    """The same line with mergekit-lite merge in place of the program name."""
    program, *arguments = shlex.split(line)
    assert program == "mergekit-yaml"
    return cli("merge", *arguments, cwd=cwd)


def shards(folder: Path) -> list[list[tuple[str, int]]]:
    """Each shard's tensors in file order with their bytes (numel * element size), from its header."""
    index = (
        json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        if (folder / "model.safetensors.index.json").is_file()
        else None
    )
    files = sorted(set(index.values())) if index else ["model.safetensors"]
    layout = []
    for name in files:
        with open(folder / name, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        header.pop("__metadata__", None)
        ranges = sorted((entry["data_offsets"], key) for key, entry in header.items())  # file order
        layout.append([(key, end - start) for (start, end), key in ranges])
    return layout


# --------------------------------------------------------------------------- verbatim lines, side by side


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMMAND_LINES))
def test_mergekit_command_lines_run_as_they_are_with_mergekits_tensors(models, tmp_path, name):
    line = COMMAND_LINES[name]
    theirs_folder, ours_folder = workspace(models, tmp_path / "mergekit"), workspace(models, tmp_path / "lite")
    run_mergekit_line(line, theirs_folder)
    ours = run_lite_line(line, ours_folder)
    assert ours.returncode == 0, ours.stderr
    expected, merged = read_state(theirs_folder / "merge"), read_state(ours_folder / "merge")
    assert sorted(merged) == sorted(expected)
    for tensor, value in expected.items():
        torch.testing.assert_close(merged[tensor], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{tensor}: {m}")
    assert (ours_folder / "merge" / "tokenizer.json").is_file()  # --copy-tokenizer
    assert "note: --lazy-unpickle: nothing to do" in ours.stderr and "note: --allow-crimes: " in ours.stderr
    if "--lora-merge-cache" in line:
        assert "note: --lora-merge-cache: nothing to store" in ours.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_the_gpu_command_line_without_a_gpu_is_one_line_naming_the_flag(models, tmp_path):
    folder = workspace(models, tmp_path)
    before = tree_hash(folder)
    one_error_line(run_lite_line(GPU_COMMAND_LINE, folder), 2, r"^error: --cuda: no CUDA GPU here")
    assert tree_hash(folder) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
@pytest.mark.parametrize("flag", ["--cuda", "--read-to-gpu", "--low-cpu-memory", "--multi-gpu", "--gpu-rich"])
def test_each_gpu_flag_without_a_gpu_is_refused_by_name(models, tmp_path, flag):
    folder = workspace(models, tmp_path)
    one_error_line(cli("merge", "config.yaml", "out", flag, cwd=folder), 2, f"^error: {flag}: no CUDA GPU here")
    assert not (folder / "out").exists()


# --------------------------------------------------------------------------------------------- shard sizes


def planned(count: int, nbytes: int) -> list[PlannedTensor]:
    return [PlannedTensor(f"t{i}", (nbytes // 2,), torch.bfloat16) for i in range(count)]


@pytest.mark.parametrize(
    "size, expected_bytes, per_shard",
    [
        ("1B", 10**9, 4),  # mergekit's billion: 4 tensors of 250 MB to a shard
        ("500M", 5 * 10**8, 2),
        ("2GB", 2 * 10**9, 8),  # a byte unit stays bytes
        ("500MB", 5 * 10**8, 2),
        ("20K", 20_000, 1),  # smaller than one tensor: a shard each, as mergekit
    ],
)
def test_out_shard_size_units_give_the_documented_shards(size, expected_bytes, per_shard):
    """docs/mergekit.md's example: eight bf16 tensors of 250 MB (2 GB in all)."""
    assert ShardSize().convert(size, None, None) == expected_bytes
    layout = split_into_shards(planned(8, 250 * 10**6), expected_bytes)
    assert [len(shard) for shard in layout] == [per_shard] * (8 // per_shard)


@pytest.mark.slow
@pytest.mark.parametrize("size", ["20K", "50K", "1B"])
def test_shards_follow_mergekits_limit_side_by_side(models, tmp_path, size):
    """mergekit compares each tensor's bytes with the count (its io/tensor_writer.py): in float32, `20K` holds at
    most 20,000 bytes (5,000 parameters) in a shard. Both tools fill shards greedily up to the same limit; the
    tensors' order differs (mergekit writes lm_head first), so the shards are compared by their sizes."""
    limit = ShardSize().convert(size, None, None)
    line = f"mergekit-yaml config.yaml merge --out-shard-size {size}"
    theirs_folder, ours_folder = workspace(models, tmp_path / "mergekit"), workspace(models, tmp_path / "lite")
    run_mergekit_line(line, theirs_folder)
    assert run_lite_line(line, ours_folder).returncode == 0
    counts = []
    for folder in (theirs_folder / "merge", ours_folder / "merge"):
        layout = shards(folder)
        for index, shard in enumerate(layout):
            total = sum(nbytes for _, nbytes in shard)
            assert total <= limit or len(shard) == 1, (folder, index, total)
            if index + 1 < len(layout):  # greedy: the next shard's first tensor did not fit in this one
                assert total + layout[index + 1][0][1] > limit, (folder, index)
        counts.append(len(layout))
    assert abs(counts[0] - counts[1]) <= 1, counts  # same limit, same size of shards, up to the order of tensors
    assert (counts[0] > 1) == (size != "1B")


# ------------------------------------------------------------------------------------------- each flag


def test_no_copy_tokenizer_and_no_model_card_leave_them_out(models, tmp_path):
    folder = workspace(models, tmp_path)
    result = cli("merge", "config.yaml", "merge", "--no-copy-tokenizer", "--no-write-model-card", "-q", cwd=folder)
    assert result.returncode == 0, result.stderr
    written = {path.name for path in (folder / "merge").iterdir()}
    assert not {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "README.md"} & written
    assert "config.json" in written


@pytest.mark.parametrize(
    "flag, pattern",
    [
        ("--no-safe-serialization", "^error: --no-safe-serialization: refused, mergekit-lite writes safetensors only"),
        ("--unsafe-truncate-embeddings", "^error: --unsafe-truncate-embeddings: refused, .*tokenizer_source: base"),
    ],
)
def test_flags_that_cannot_apply_are_refused_in_one_line(models, tmp_path, flag, pattern):
    folder = workspace(models, tmp_path)
    before = tree_hash(folder)
    one_error_line(cli("merge", "config.yaml", "out", flag, cwd=folder), 2, pattern)
    assert tree_hash(folder) == before


@pytest.mark.parametrize(
    "flag, note",
    [
        (["--clone-tensors"], "note: --clone-tensors: nothing to do"),
        (["--trust-remote-code"], "warning: --trust-remote-code: no repository code is ever run"),
        (["--async-write", "--write-threads", "4"], "note: --async-write: "),
        (["--lora-merge-dtype", "bfloat16"], "note: --lora-merge-dtype: adapters are applied in float32"),
    ],
)
def test_flags_with_nothing_to_do_say_so_in_one_line(models, tmp_path, flag, note):
    folder = workspace(models, tmp_path)
    result = cli("merge", "config.yaml", "merge", *flag, "-q", cwd=folder)
    assert result.returncode == 0, result.stderr
    assert note in result.stderr


def test_random_seed_is_mergekits_name_for_seed(models, tmp_path):
    folder = workspace(models, tmp_path)
    folder.joinpath("config.yaml").write_text(f"""models:
  - model: {models["a"]}
    parameters: {{weight: 1.0, density: 0.5}}
merge_method: dare_ties
base_model: {models["base"]}
dtype: float32
""")
    runs = {"random-7": ["--random-seed", "7"], "seed-7": ["--seed", "7"], "random-8": ["--random-seed", "8"]}
    for out, args in runs.items():
        assert cli("merge", "config.yaml", out, *args, "-q", cwd=folder).returncode == 0
    same, seed, other = (read_state(folder / name) for name in runs)
    assert all(torch.equal(same[name], seed[name]) for name in same)
    assert not all(torch.equal(same[name], other[name]) for name in same)
    one_error_line(cli("merge", "config.yaml", "x", "--seed", "1", "--random-seed", "2", cwd=folder), 2, "two seeds")


def test_num_threads_limits_the_cores(models, tmp_path):
    folder = workspace(models, tmp_path)
    cores = os.sched_getaffinity(0)
    try:
        result = cli("merge", "config.yaml", "merge", "-j", "1", "-q", cwd=folder)
        assert result.returncode == 0, result.stderr
        assert len(os.sched_getaffinity(0)) == 1
    finally:
        os.sched_setaffinity(0, cores)


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["config.yaml", "a", "--out", "b"], "two output folders"),
        (["config.yaml"], "give the output folder"),
    ],
)
def test_the_output_folder_is_given_once(models, tmp_path, args, pattern):
    one_error_line(cli("merge", *args, cwd=workspace(models, tmp_path)), 2, pattern)


@pytest.mark.parametrize(
    "typo",
    [
        "--lazy-unpickel",
        "--allow-pickel",
        "--alow-pickle",
        "--allow-crimez",
        "--forse",
        "--trust-remote-cod",
        "--overwrit",
        "--allow-nonfinit",
    ],
)
@pytest.mark.parametrize("command", ["merge", "extract"])
def test_an_unknown_flag_is_never_corrected_to_an_unsafe_one(typo, command):
    result = cli(command, typo)
    line = one_error_line(result, 2, "No such option")
    for unsafe in (
        "--allow-pickle",
        "--allow-nonfinite",
        "--force",
        "--overwrite",
        "--trust-remote-code",
        "--allow-crimes",
        "--unsafe-truncate-embeddings",
    ):
        assert unsafe not in line.replace(typo, ""), line


# ----------------------------------------------------------------------------------------------- free space


def test_a_merge_that_cannot_fit_is_refused_before_writing(models, tmp_path, monkeypatch):
    """The free-space figure of the output's filesystem patched to 1 kB: the merge (about 100 kB) is refused in
    one line and nothing appears; the dry run says it would not fit."""
    folder = workspace(models, tmp_path)
    monkeypatch.setattr(outputs, "free_space", lambda path: 1000)
    before = tree_hash(folder)
    one_error_line(
        cli("merge", "config.yaml", "merge", cwd=folder),
        2,
        r"^error: merge: the output needs 0\.\d MB and .* has 0\.0 MB free; nothing was written",
    )
    assert tree_hash(folder) == before


@pytest.mark.slow
def test_the_dry_run_compares_free_space_with_the_output(models, tmp_path, monkeypatch, calibrated_rates):
    folder = workspace(models, tmp_path)
    fits = cli("merge", "config.yaml", "merge", "--dry-run", cwd=folder)
    assert fits.returncode == 0, fits.stderr
    assert f"where it goes ({folder}): fits" in fits.stdout
    monkeypatch.setattr(outputs, "free_space", lambda path: 1000)
    tight = cli("merge", "config.yaml", "merge", "--dry-run", cwd=folder)
    assert "free 0.0 MB where it goes" in tight.stdout and "does NOT fit: a merge is refused" in tight.stdout
    assert not (folder / "merge").exists()


# ------------------------------------------------------------------------------- extract, side by side

# mergekit's README ("LoRA Extraction", Usage), its optional parts written out and its placeholders filled in.
EXTRACT_LINES = {
    "readme": "mergekit-extract-lora --model {tuned} --base-model {base} --out-path output_path --no-lazy-unpickle "
    "--max-rank=8 --sv-epsilon=0.001",
    "embed_lora": "mergekit-extract-lora --model {tuned} --base-model {base} --out-path output_path --max-rank=4 "
    "--embed-lora",
    "no_distribute_scale": "mergekit-extract-lora --model {tuned} --base-model {base} --out-path output_path "
    "--max-rank=4 --no-distribute-scale -e k_proj",
    "skip_undecomposable": "mergekit-extract-lora --model {tuned} --base-model {base} --out-path output_path "
    "--max-rank=4 --skip-undecomposable",
    # mergekit 0.1.5 takes --save-module only beside these two (else it appends to its tuple of modules and fails)
    "save_module": "mergekit-extract-lora --model {tuned} --base-model {base} --out-path output_path --max-rank=4 "
    "--embed-lora --skip-undecomposable --save-module o_proj",
}
# mergekit-extract-lora's entry point once per line in one interpreter (importing torch and mergekit costs more
# than a tiny extraction)
EXTRACT_BATCH = """
import os, shlex, sys
from mergekit.scripts.extract_lora import main
for folder, line in zip(sys.argv[1::2], sys.argv[2::2]):
    os.chdir(folder)
    try:
        main(shlex.split(line)[1:], standalone_mode=False)
    except Exception as error:  # its model card looks the base up on the Hub after the adapter is written
        if not os.path.isfile("output_path/adapter_model.safetensors"):
            raise
"""


def factors_and_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """An adapter's tensors with each LoRA pair replaced by its product B @ A (the factors of an SVD are unique
    only up to signs): the update it applies, by module."""
    with safe_open(folder / "adapter_model.safetensors", "pt") as handle:
        state = {key: handle.get_tensor(key).float() for key in handle.keys()}
    result = {}
    for key, tensor in state.items():
        for a_part, b_part in ((".lora_A.weight", ".lora_B.weight"), (".lora_embedding_A", ".lora_embedding_B")):
            if key.endswith(a_part):
                result[key.removesuffix(a_part) + " (B@A)"] = state[key.removesuffix(a_part) + b_part] @ tensor
        if ".lora_" not in key:
            result[key] = tensor
    return result


@pytest.fixture(scope="module")
def extractions(models) -> dict[str, tuple[Path, Path, subprocess.CompletedProcess]]:
    """Each line through mergekit-extract-lora (one batch) and through `mergekit-lite extract`."""
    root = models["root"] / "extract"
    lines = {name: line.format(tuned=models["a"], base=models["base"]) for name, line in EXTRACT_LINES.items()}
    for name in lines:
        for tool in ("mergekit", "lite"):
            (root / tool / name).mkdir(parents=True)
    python = mergekit_cli().parent / "python"
    arguments = [str(part) for name, line in lines.items() for part in (root / "mergekit" / name, line)]
    batch = subprocess.run(
        [str(python), "-c", EXTRACT_BATCH, *arguments], capture_output=True, text=True, env=_environment(), timeout=1200
    )
    assert batch.returncode == 0, batch.stderr[-3000:]
    ours = {name: cli("extract", *shlex.split(line)[1:], cwd=root / "lite" / name) for name, line in lines.items()}
    return {
        name: (root / "mergekit" / name / "output_path", root / "lite" / name / "output_path", ours[name])
        for name in lines
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXTRACT_LINES))
def test_extract_lora_command_lines_give_mergekits_adapter(extractions, name):
    theirs, ours, run = extractions[name]
    assert run.returncode == 0, run.stderr
    expected, extracted = factors_and_tensors(theirs), factors_and_tensors(ours)
    assert sorted(extracted) == sorted(expected)
    for key, tensor in expected.items():
        torch.testing.assert_close(extracted[key], tensor, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
    with (
        safe_open(ours / "adapter_model.safetensors", "pt") as mine,
        safe_open(theirs / "adapter_model.safetensors", "pt") as reference,
    ):
        for key in reference.keys():  # the ranks, and --no-distribute-scale's factors themselves (up to sign)
            assert mine.get_slice(key).get_shape() == reference.get_slice(key).get_shape(), key
            if name == "no_distribute_scale":
                torch.testing.assert_close(
                    mine.get_tensor(key).abs(),
                    reference.get_tensor(key).abs(),
                    rtol=1e-3,
                    atol=1e-5,
                    msg=lambda m: f"{key}: {m}",
                )
    if name == "readme":
        assert "note: --lazy-unpickle" not in run.stderr  # --no-lazy-unpickle asks for nothing


def test_extract_save_module_alone_and_shared_flags_with_nothing_to_do(models, tmp_path):
    """--save-module without --embed-lora --skip-undecomposable (mergekit 0.1.5 fails there) stores the module
    whole; a shared flag with no part in an extraction says so."""
    result = cli(
        "extract",
        "--model",
        models["a"],
        "--base-model",
        models["base"],
        "--out-path",
        tmp_path / "lora",
        "--max-rank",
        "4",
        "--save-module",
        "o_proj",
        "--out-shard-size",
        "1B",
        "--random-seed",
        "1",
    )
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert {f"model.layers.{i}.self_attn.o_proj" for i in range(3)} <= set(config["modules_to_save"])
    assert "o_proj" not in config["target_modules"]
    assert "note: --out-shard-size: the adapter is one file" in result.stderr
    assert "note: --random-seed: an SVD draws nothing at random" in result.stderr
    one_error_line(
        cli(
            "extract",
            "--model",
            models["a"],
            "--base-model",
            models["base"],
            "--out-path",
            tmp_path / "never",
            "--save-module",
            "no_such_module",
        ),
        2,
        "--save-module no_such_module",
    )
