"""Never lose, leak or hang: outputs, reads, typed input, signals and the last line of defence, through the CLI.

Every destructive case hashes the inputs (and the folder around them) before and after: unchanged. Refusals and
merges run through the CLI's click group in this process (`cli`); a real process (`run`) where the process is what
is tested: signals, racing runs, inputs that could block, the interpreter's start-up and exit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from tiny_models import save_random_pair, save_tiny_llama

from mergekit_lite.cli.main import main
from mergekit_lite.merge.methods.tensor_math import lerp

CLI = Path(sys.executable).parent / "mergekit-lite"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run(*args, cwd=None, timeout: float = 120, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CLI), *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env or ENV, timeout=timeout
    )


def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """`mergekit-lite ARGS` in `cwd` through the CLI's click group in this process: the console script's own error
    handling (one line, exit code) without a torch-importing interpreter per run. Any warning is raised, so the
    one-line checks also cover what a fresh process would print besides its result."""
    argv = list(map(str, args))
    with contextlib.chdir(cwd or os.getcwd()), warnings.catch_warnings():
        warnings.simplefilter("error")
        result = CliRunner().invoke(main, argv)
    return subprocess.CompletedProcess(argv, result.exit_code, result.stdout, result.stderr)


def one_error_line(result: subprocess.CompletedProcess, code: int = 2, *patterns: str) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, (result.returncode, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for pattern in patterns:
        assert re.search(pattern, lines[0]), (pattern, lines[0])
    return lines[0]


def tree_hash(root: Path) -> dict[str, str]:
    """Every path under root (links not followed) with its content hash, or its link target."""
    hashes = {}
    for path in sorted(Path(root).rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            hashes[key] = "link:" + os.readlink(path)
        elif path.is_file():
            hashes[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            hashes[key] = "dir"
    return hashes


def lerp_args(base, model, alpha=0.5) -> list:
    return ["merge", "--method", "linear", "--base", base, "--model", model, "--alpha", alpha, "-q"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A user's working folder holding two tiny models, pre/ and post/ (sharded, with an index)."""
    root = tmp_path_factory.mktemp("work")
    save_tiny_llama(0, root / "pre")
    save_tiny_llama(1, root / "post")
    return root


@pytest.fixture
def fresh(work, tmp_path) -> Path:
    """A private copy of the working folder, for cases that could destroy it."""
    return Path(shutil.copytree(work, tmp_path / "work", symlinks=True))


# ------------------------------------------------------------------------------------------- output rules


@pytest.mark.parametrize(
    "out, cwd, patterns",
    [
        ("pre", ".", [r"pre: is also an input"]),
        (".", ".", [r"\.: is the working folder or one of its parents"]),
        ("..", ".", [r"\.\.: is the working folder or one of its parents"]),
        ("work", "..", [r"work: contains the input"]),
        ("pre/merged", ".", [r"pre/merged: is inside the input"]),
    ],
    ids=["out-is-base", "out-is-cwd", "out-is-cwd-parent", "out-contains-inputs", "out-inside-input"],
)
def test_overwrite_never_deletes_inputs_or_the_working_folder(fresh, out, cwd, patterns):
    """The data-loss findings: --out ., --out pre, --out (the parent of the inputs), all with --overwrite."""
    before = tree_hash(fresh.parent)
    folder = (fresh / cwd).resolve()
    pre, post = os.path.relpath(fresh / "pre", folder), os.path.relpath(fresh / "post", folder)
    result = cli(*lerp_args(pre, post), "--out", out, "--overwrite", cwd=folder)
    one_error_line(result, 2, *patterns)
    assert tree_hash(fresh.parent) == before


def test_overwrite_replaces_only_mergekit_lite_outputs(fresh):
    """A folder of the user's is refused with --overwrite and says why; one of ours is replaced."""
    mine = fresh / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    before = tree_hash(fresh)
    result = cli(*lerp_args("pre", "post"), "--out", "mine", "--overwrite", cwd=fresh)
    one_error_line(
        result,
        2,
        r"mine: already exists and was not written by mergekit-lite",
        r"--overwrite replaces only mergekit-lite outputs",
    )
    assert tree_hash(fresh) == before

    assert cli(*lerp_args("pre", "post", 0.2), "--out", "merged", cwd=fresh).returncode == 0
    refused = cli(*lerp_args("pre", "post", 0.7), "--out", "merged", cwd=fresh)
    one_error_line(refused, 2, r"merged: already exists \(pass --overwrite to replace it\)")
    replaced = cli(*lerp_args("pre", "post", 0.7), "--out", "merged", "--overwrite", cwd=fresh)
    assert replaced.returncode == 0, replaced.stderr
    assert "alpha: 0.7" in (fresh / "merged" / "mergekit_lite_config.yaml").read_text()
    assert sorted(p.name for p in fresh.iterdir()) == ["merged", "mine", "post", "pre"]  # no temp folder left


def test_a_provenance_file_name_does_not_make_a_users_folder_ours(fresh):
    """Outputs of older versions are recognised by their provenance file or sweep lock only beside what such an
    output holds: a user's folder that merely has a file of that name (a config kept for reuse) is not replaced
    by --overwrite, nor written into by a sweep."""
    (fresh / "configs").mkdir()
    (fresh / "configs" / "mergekit_lite_config.yaml").write_text("method: linear\n")
    (fresh / "configs" / "notes.txt").write_text("keep me")
    (fresh / "runs").mkdir()
    (fresh / "runs" / ".sweep.lock").write_text("")
    (fresh / "runs" / "results.json").write_text("mine")
    before = tree_hash(fresh)
    one_error_line(
        cli(*lerp_args("pre", "post"), "--out", "configs", "--overwrite", cwd=fresh),
        2,
        r"configs: already exists and was not written by mergekit-lite",
    )
    one_error_line(
        cli(*sweep_args("pre", "post", "runs"), cwd=fresh),
        2,
        r"runs: is a non-empty folder that mergekit-lite did not create",
    )
    assert tree_hash(fresh) == before


def test_output_under_a_file_is_refused_naming_it(fresh):
    (fresh / "notes.txt").write_text("keep me")
    before = tree_hash(fresh)
    one_error_line(
        cli(*lerp_args("pre", "post"), "--out", "notes.txt/merged", cwd=fresh),
        2,
        r"notes\.txt/merged: \S+/notes\.txt is not a folder",
    )
    assert tree_hash(fresh) == before


@pytest.mark.slow
def test_fingerprint_out_never_overwrites_a_file_it_did_not_write(fresh):
    shard = sorted((fresh / "pre").glob("*.safetensors"))[0]
    before = tree_hash(fresh)
    one_error_line(
        cli("audit", "fingerprint", "pre", "--out", shard.relative_to(fresh), cwd=fresh), 2, r"is inside the input pre"
    )
    (fresh / "notes.json").write_text("{}")
    one_error_line(
        cli("audit", "fingerprint", "pre", "--out", "notes.json", cwd=fresh),
        2,
        r"notes\.json: already exists and is not a file mergekit-lite wrote",
    )
    assert tree_hash(fresh) == {**before, "notes.json": hashlib.sha256(b"{}").hexdigest()}
    assert cli("audit", "fingerprint", "pre", "--out", "fp.json", cwd=fresh).returncode == 0
    again = cli("audit", "fingerprint", "pre", "--out", "fp.json", "--top-k", "2", cwd=fresh)
    assert again.returncode == 0, again.stderr  # its own fingerprint is replaced
    assert json.loads((fresh / "fp.json").read_text())["top_k"] == 2


def sweep_args(pre, post, out, *extra) -> list:
    return [
        "sweep",
        "--pre",
        pre,
        "--post",
        post,
        "--alphas",
        "0,1",
        "--old-tasks",
        "a",
        "--new-tasks",
        "b",
        "--out",
        out,
        *extra,
    ]


def test_sweep_run_folder_is_new_empty_or_its_own(fresh):
    """sweep --out a folder holding someone's report.md / results.json: refused before any evaluation."""
    theirs = fresh / "reports"
    theirs.mkdir()
    (theirs / "report.md").write_text("my report")
    (theirs / "results.json").write_text("[]")
    before = tree_hash(fresh)
    one_error_line(
        cli(*sweep_args("pre", "post", "reports"), cwd=fresh),
        2,
        r"reports: is a non-empty folder that mergekit-lite did not create",
    )
    one_error_line(cli(*sweep_args("pre", "post", "."), cwd=fresh), 2, r"is the working folder")
    one_error_line(
        cli(*sweep_args("pre", "post", "runs", "--save-best", "pre"), cwd=fresh), 2, r"pre: is also an input"
    )
    one_error_line(cli("demo", "--out", "reports", cwd=fresh), 2, r"reports: is a non-empty folder")
    assert tree_hash(fresh) == before


def test_extract_never_replaces_an_input(fresh):
    """extract follows merge's output rules: --out naming its own input is refused even with --overwrite and
    even when that input is a mergekit-lite output (which --overwrite may otherwise replace)."""
    assert cli(*lerp_args("pre", "post"), "--out", "merged", cwd=fresh).returncode == 0
    before = tree_hash(fresh)
    result = cli("extract", "--base", "merged", "--model", "post", "--out", "merged", "--overwrite", cwd=fresh)
    one_error_line(result, 2, r"merged: is also an input")
    one_error_line(
        cli("extract", "--base", "pre", "--model", "post", "--out", ".", cwd=fresh), 2, r"is the working folder"
    )
    assert tree_hash(fresh) == before


@pytest.mark.slow
def test_concurrent_merges_to_one_out_never_lose_a_result(fresh):
    """Four merges race to one --out: exactly one wins, the others fail in one line, the winner is complete."""

    def merge(alpha):
        return alpha, run(*lerp_args("pre", "post", alpha), "--out", "merged", cwd=fresh)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = dict(pool.map(merge, [0.1, 0.3, 0.6, 0.9]))
    winners = [alpha for alpha, result in results.items() if result.returncode == 0]
    assert len(winners) == 1, {a: (r.returncode, r.stderr) for a, r in results.items()}
    for alpha, result in results.items():
        if alpha not in winners:
            one_error_line(result, 2, r"merged: (already exists|appeared while this run was writing)")
    merged = load_file(fresh / "merged" / "model.safetensors")
    pre, post = load_state(fresh / "pre"), load_state(fresh / "post")
    assert all(torch.equal(merged[name], lerp(pre[name], post[name], winners[0])) for name in pre)
    assert sorted(p.name for p in fresh.iterdir()) == ["merged", "post", "pre"]


@pytest.mark.slow
def test_folder_created_at_out_during_a_merge_is_left_untouched(big_pair, tmp_path):
    out = tmp_path / "merged"
    process = start_big_merge(big_pair, out)
    wait_for_partial(process, out)
    out.mkdir()
    (out / "theirs.txt").write_text("created meanwhile")
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2 and "appeared while this run was writing" in stderr, stderr
    assert [p.name for p in out.iterdir()] == ["theirs.txt"] and not list(tmp_path.glob(".merged.partial-*"))


# -------------------------------------------------------------------------------- reads stay in the folder


def load_state(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(shard))
    return state


def first_shard(folder: Path) -> Path:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / sorted(set(index["weight_map"].values()))[0]


def retarget_index(folder: Path, shard_name: str, new_name: str) -> None:
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"] = {k: (new_name if v == shard_name else v) for k, v in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))


def traversal_index(fresh):
    shard = first_shard(fresh / "post")
    (fresh / "elsewhere").mkdir()
    shutil.move(shard, fresh / "elsewhere" / shard.name)
    retarget_index(fresh / "post", shard.name, f"../elsewhere/{shard.name}")
    return r"shard name '\.\./elsewhere/model-\S+' is not a plain file name"


def absolute_index(fresh):
    shard = first_shard(fresh / "post")
    target = fresh / "elsewhere.safetensors"
    shutil.move(shard, target)
    retarget_index(fresh / "post", shard.name, str(target))
    return r"shard name '/\S+elsewhere\.safetensors' is not a plain file name"


def symlinked_shard_out_of_folder(fresh):
    (fresh / "secret.txt").write_text("password=hunter2 " * 4)
    shard = first_shard(fresh / "post")
    shard.unlink()
    shard.symlink_to(fresh / "secret.txt")
    return r"post/model-\S+\.safetensors: not a regular file inside post \(a link out of the folder"


def fifo_shard(fresh):
    shard = first_shard(fresh / "post")
    shard.unlink()
    os.mkfifo(shard)
    return r"not a regular file inside"


def fifo_single_file(fresh):
    folder = fresh / "post"
    for path in folder.iterdir():
        if path.name != "config.json":
            path.unlink()
    os.mkfifo(folder / "model.safetensors")
    return r"post/model\.safetensors: not a regular file inside"


def unlisted_tensor(fresh):
    index_file = fresh / "post" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    index_file.write_text(json.dumps(index))
    return r"tensor model\.layers\.1\.mlp\.up_proj\.weight in model-\S+ is not in the index"


@pytest.mark.slow
@pytest.mark.parametrize(
    "build",
    [traversal_index, absolute_index, symlinked_shard_out_of_folder, fifo_shard, fifo_single_file, unlisted_tensor],
)
def test_reads_stay_inside_the_model_folder(fresh, build):
    pattern = build(fresh)
    before = tree_hash(fresh)
    if build in (fifo_shard, fifo_single_file):  # a process with a timeout: a FIFO must not hang the suite
        result = run(*lerp_args("pre", "post"), "--out", "merged", cwd=fresh, timeout=60)
    else:
        result = cli(*lerp_args("pre", "post"), "--out", "merged", cwd=fresh)
    line = one_error_line(result, 2, pattern)
    assert "hunter2" not in line and not (fresh / "merged").exists() and tree_hash(fresh) == before


def test_side_file_linking_out_of_the_base_is_refused(fresh):
    (fresh / "secret.txt").write_text("password=hunter2")
    (fresh / "pre" / "tokenizer.json").symlink_to(fresh / "secret.txt")
    (fresh / "pre" / "special_tokens_map.json").write_text("{}")
    before = tree_hash(fresh)
    line = one_error_line(
        cli(*lerp_args("pre", "post"), "--out", "merged", cwd=fresh),
        2,
        r"pre/tokenizer\.json: not a regular file inside pre \(a link out of the folder",
    )
    assert "hunter2" not in line and not (fresh / "merged").exists() and tree_hash(fresh) == before


def test_post_trained_side_files_linking_out_are_refused(fresh):
    """The chat template and generation config carried over from the post-trained input when the base lacks
    them pass the same rule as the base's side files: a link out of the folder is refused, never followed."""
    (fresh / "secret.txt").write_text("password=hunter2")
    (fresh / "pre" / "generation_config.json").unlink()
    (fresh / "post" / "generation_config.json").unlink()
    (fresh / "post" / "generation_config.json").symlink_to("../secret.txt")
    (fresh / "post" / "chat_template.jinja").symlink_to(fresh / "secret.txt")
    line = one_error_line(
        cli(*lerp_args("pre", "post"), "--out", "merged", cwd=fresh), 2, r"post/\S+: not a regular file inside post"
    )
    assert "hunter2" not in line and not (fresh / "merged").exists()

    for name in ("chat_template.jinja", "generation_config.json"):
        (fresh / "post" / name).unlink()
    (fresh / "post" / "chat_template.jinja").write_text("{{ messages }}")  # a regular file is still carried
    assert cli(*lerp_args("pre", "post"), "--out", "kept", cwd=fresh).returncode == 0
    assert (fresh / "kept" / "chat_template.jinja").read_text() == "{{ messages }}"


def test_copy_files_from_a_missing_folder_is_refused(fresh):
    one_error_line(
        cli(*lerp_args("pre", "post"), "--copy-files-from", "prre", "--out", "merged", cwd=fresh),
        2,
        r"prre: no such folder to copy config and tokenizer files from",
    )
    assert not (fresh / "merged").exists()


def test_hugging_face_cache_snapshot_links_are_read(work, tmp_path):
    """A hub download: snapshots/REV/* are links into ../../blobs; that is inside the repository, so it is read."""
    repo = tmp_path / "models--tiny--post"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for path in (work / "post").iterdir():
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copy(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    result = cli(*lerp_args(work / "pre", snapshot), "--out", tmp_path / "merged")
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------------------------- non-finite output


@pytest.mark.parametrize(
    "args, tensor",
    [
        (["--method", "task_arithmetic", "--lambda", "1e300"], r"model\.\S+"),
        (["--method", "task_arithmetic", "--lambda", "1e7", "--dtype", "float16"], r"model\.\S+"),
    ],
    ids=["lambda-1e300", "float16-overflow"],
)
def test_overflow_is_never_written(fresh, args, tensor):
    result = cli("merge", "--base", "pre", "--model", "post", *args, "--out", "merged", "-q", cwd=fresh)
    one_error_line(result, 2, r"merged tensor " + tensor + r" has NaN or Inf values", r"--allow-nonfinite")
    assert not (fresh / "merged").exists()
    allowed = cli(
        "merge", "--base", "pre", "--model", "post", *args, "--allow-nonfinite", "--out", "merged", "-q", cwd=fresh
    )
    assert allowed.returncode == 0, allowed.stderr
    assert not all(torch.isfinite(t).all() for t in load_file(fresh / "merged" / "model.safetensors").values())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_inputs_are_merged_upcast(work, tmp_path, dtype):
    folders = []
    for name in ("pre", "post"):
        folder = tmp_path / name
        folder.mkdir()
        save_file({k: v.to(dtype) for k, v in load_state(work / name).items()}, folder / "model.safetensors")
        folders.append(folder)
    result = cli(*lerp_args(*folders, 0.25), "--out", tmp_path / "merged")
    assert result.returncode == 0, result.stderr
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    pre, post = load_file(folders[0] / "model.safetensors"), load_file(folders[1] / "model.safetensors")
    for name, tensor in merged.items():
        assert tensor.dtype == dtype
        expected = lerp(pre[name].float(), post[name].float(), 0.25).to(dtype)
        assert torch.equal(tensor.float(), expected.float()), name


# --------------------------------------------------------------------------------------- typed input


def write_json(path: Path, data) -> None:
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def index_of(fresh) -> dict:
    return json.loads((fresh / "post" / "model.safetensors.index.json").read_text())


TYPED_CASES = [
    ("post/model.safetensors.index.json", lambda f: [1, 2], r"index\.json: top level: expected a mapping"),
    (
        "post/model.safetensors.index.json",
        lambda f: {**index_of(f), "weight_map": dict.fromkeys(index_of(f)["weight_map"], 3)},
        r"index\.json: weight_map\.\S+: expected a valid string \(got an integer\)",
    ),
    ("post/model.safetensors.index.json", lambda f: '{"weight_map": {"a": "x", "a": "y"}}', r"duplicate key 'a'"),
    ("post/model.safetensors.index.json", lambda f: "[" * 5000 + "]" * 5000, r"index\.json: nested too deeply"),
    ("post/config.json", lambda f: [1], r"config\.json: expected a JSON object \(got list\)"),
    (
        "post/config.json",
        lambda f: {"model_type": 7},
        r"config\.json: model_type: expected a valid string \(got an integer\)",
    ),
    (
        "post/config.json",
        lambda f: {"tie_word_embeddings": "false"},
        r"config\.json: tie_word_embeddings: expected a valid boolean \(got a string\)",
    ),
    ("post/config.json", lambda f: '{"a": NaN}', r"config\.json: invalid JSON \(NaN is not valid JSON\)"),
]


@pytest.mark.parametrize("relative, content, pattern", TYPED_CASES)
def test_json_inputs_are_typed(fresh, relative, content, pattern):
    write_json(fresh / relative, content(fresh))
    before = tree_hash(fresh)
    one_error_line(cli(*lerp_args("pre", "post"), "--out", "merged", cwd=fresh), 2, pattern)
    assert tree_hash(fresh) == before


def test_non_utf8_config_names_the_offset_not_the_bytes(fresh):
    (fresh / "post" / "config.json").write_bytes(b'{"model_type": "ll\xffama"}')
    one_error_line(
        cli(*lerp_args("pre", "post"), "--out", "merged", cwd=fresh),
        2,
        r"post/config\.json: not UTF-8 text \(bad byte at offset 18\)",
    )


SWEEP_YAML_CASES = [
    ("stream: 'false'\n", r"sweep\.yaml: stream: expected a valid boolean \(got a string\)"),
    ("limit: '5'\n", r"sweep\.yaml: limit: expected a valid number \(got a string\)"),
    ("limit: 0\n", r"sweep\.yaml: limit: expected greater than 0"),
    ("old_tasks: {a: 1}\n", r"sweep\.yaml: old_tasks"),
    (
        "a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
        "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
        "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n",
        r"sweep\.yaml: YAML expands to more than 100000 values through its aliases",
    ),
    ("x: " + "[" * 3000 + "]" * 3000 + "\n", r"sweep\.yaml: nested too deeply"),
]


@pytest.mark.parametrize(
    "text, pattern",
    SWEEP_YAML_CASES,
    ids=["quoted-false", "quoted-int", "limit-0", "tasks-mapping", "anchor-bomb", "deep-nesting"],
)
def test_sweep_config_is_typed(fresh, text, pattern):
    head = "pre: pre\npost: post\nalphas: [0, 1]\nold_tasks: a\nnew_tasks: b\nout: runs\n"
    lines = [line for line in head.splitlines() if line.split(":")[0] != text.split(":")[0]]
    (fresh / "sweep.yaml").write_text("\n".join(lines) + "\n" + text)
    started = time.monotonic()
    one_error_line(cli("sweep", "sweep.yaml", cwd=fresh), 2, pattern)
    assert time.monotonic() - started < 30 and not (fresh / "runs").exists()


def test_sweep_point_files_are_typed(fresh, toy_pair):
    """Real tasks (the sweep refuses unknown ones first), then a point file of the wrong types."""
    points = fresh / "runs" / "points"
    points.mkdir(parents=True)
    (fresh / "runs" / ".mergekit-lite-output").write_text("")
    old, new = toy_pair.old_tasks[0], toy_pair.new_tasks[0]
    (points / "pre.json").write_text(
        json.dumps(
            {
                "identity": {},
                "label": "pre",
                "alpha": None,
                "tasks": [
                    {"task": old, "group": "old", "metric": "acc", "filter": "none", "n_choices": "4", "correct": {}}
                ],
            }
        )
    )
    args = [
        "sweep",
        "--pre",
        "pre",
        "--post",
        "post",
        "--alphas",
        "0,1",
        "--old-tasks",
        old,
        "--new-tasks",
        new,
        "--include-path",
        str(toy_pair.task_dir),
        "--out",
        "runs",
    ]
    one_error_line(
        cli(*args, cwd=fresh), 2, r"pre\.json: tasks\.0\.n_choices", r"\(got a string\)", "not a sweep point file"
    )


@pytest.mark.parametrize(
    "change, pattern",
    [
        (
            lambda fp: fp["modules"].update({"x": {"shape": "32x32", "singular_values": [1.0], "probe": [1.0]}}),
            r"modules\.x\.shape: expected a valid list \(got a string\)",
        ),
        (lambda fp: fp.update(top_k="8"), r"top_k: expected a valid integer \(got a string\)"),
        (lambda fp: fp.update(modules=[]), r"modules: expected a mapping"),
    ],
)
@pytest.mark.slow
def test_fingerprint_files_are_typed(work, tmp_path, change, pattern):
    from mergekit_lite.audits.fingerprint import compute_fingerprint, load_fingerprint
    from mergekit_lite.errors import InputError

    fingerprint = compute_fingerprint(work / "pre", top_k=2)
    change(fingerprint)
    path = tmp_path / "fp.json"
    path.write_text(json.dumps(fingerprint))
    with pytest.raises(InputError, match=pattern):
        load_fingerprint(path)


LM_EVAL_STAMP = "2024-05-01T12-00-00.123456"


def lm_eval_output(folder: Path, accuracies: list[int]) -> Path:
    """A minimal lm-eval --log_samples output: one multiple-choice task's samples and the run's results file."""
    folder.mkdir()
    arguments = {f"gen_args_{i}": {"arg_0": "Q?", "arg_1": f" choice {i}"} for i in range(4)}
    lines = [
        json.dumps(
            {"doc_id": i, "doc_hash": f"h{i}", "arguments": arguments, "acc": acc, "filter": "none", "metrics": ["acc"]}
        )
        for i, acc in enumerate(accuracies)
    ]
    (folder / f"samples_arc_{LM_EVAL_STAMP}.jsonl").write_text("\n".join(lines) + "\n")
    write_json(folder / f"results_{LM_EVAL_STAMP}.json", {"model_name": folder.name, "config": {"random_seed": 0}})
    return folder


@pytest.mark.parametrize(
    "side, name, content, pattern",
    [
        ("pre", f"results_{LM_EVAL_STAMP}.json", "[1, 2]\n", r"pre/results_\S+\.json: top level: expected a mapping"),
        ("pre", f"results_{LM_EVAL_STAMP}.json", '{"config": "seed 0"}', r"pre/results_\S+\.json: config: expected a "),
        (
            "post",
            f"samples_arc_{LM_EVAL_STAMP}.jsonl",
            '{"a": ' + "[" * 5000 + "]" * 5000 + "}\n",
            r"post/samples_arc_\S+\.jsonl line 5: nested too deeply",
        ),
    ],
    ids=["results-is-a-list", "results-config-is-a-string", "samples-line-too-deep"],
)
def test_forgetting_names_the_malformed_lm_eval_file(tmp_path, side, name, content, pattern):
    """Malformed lm-eval outputs are user errors (exit 2) naming the file, and the line of a samples file."""
    lm_eval_output(tmp_path / "pre", [1, 1, 0, 0])
    lm_eval_output(tmp_path / "post", [1, 0, 1, 0])
    assert cli("forgetting", "pre", "post", cwd=tmp_path).returncode == 0
    path = tmp_path / side / name
    path.write_text(content if name.startswith("results_") else path.read_text() + content)
    one_error_line(cli("forgetting", "pre", "post", cwd=tmp_path), 2, pattern)


def test_forgetting_refuses_a_fifo_named_like_a_samples_file_without_waiting_on_it(tmp_path):
    lm_eval_output(tmp_path / "pre", [1, 1, 0, 0])
    lm_eval_output(tmp_path / "post", [1, 0, 1, 0])
    samples = next((tmp_path / "post").glob("samples_*.jsonl"))
    samples.unlink()
    os.mkfifo(samples)
    one_error_line(run("forgetting", "pre", "post", cwd=tmp_path), 2, r"samples_arc_\S+\.jsonl: not a regular file")


# ------------------------------------------------------------------ safetensors headers vs the library


def safetensors_file(header, data: bytes = b"", raw_header: bytes | None = None, length: int | None = None) -> bytes:
    raw = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


A = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
B = {"dtype": "F16", "shape": [4], "data_offsets": [16, 24]}
DATA = bytes(range(24))


def with_b(**changes) -> dict:
    return {"a": A, "b": {**B, **changes}}


def crafted_headers() -> dict[str, bytes]:
    """Valid files and every way we know to break one: layout, types, names, metadata, framing."""
    cases = {
        "valid": safetensors_file({"a": A, "b": B}, DATA),
        "valid-metadata": safetensors_file({"__metadata__": {"format": "pt"}, "a": A, "b": B}, DATA),
        "valid-padded": safetensors_file({}, raw_header=json.dumps({"a": A, "b": B}).encode() + b"   ", data=DATA),
        "valid-zero-size": safetensors_file({"z": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]}}),
        "empty-header": safetensors_file({}),
        "empty-header-with-data": safetensors_file({}, DATA),
        "overlap": safetensors_file(with_b(data_offsets=[8, 16]), DATA[:16]),
        "alias": safetensors_file({"a": A, "b": {**A}}, DATA[:16]),
        "gap": safetensors_file(with_b(data_offsets=[20, 28]), DATA + b"\0" * 4),
        "trailing-data": safetensors_file({"a": A, "b": B}, DATA + b"\0" * 8),
        "truncated-data": safetensors_file({"a": A, "b": B}, DATA[:20]),
        "offsets-reversed": safetensors_file(with_b(data_offsets=[24, 16]), DATA),
        "offsets-negative": safetensors_file(with_b(data_offsets=[-8, 0]), DATA),
        "offsets-float": safetensors_file(with_b(data_offsets=[16.0, 24.0]), DATA),
        "offsets-strings": safetensors_file(with_b(data_offsets=["16", "24"]), DATA),
        "offsets-three": safetensors_file(with_b(data_offsets=[16, 24, 32]), DATA),
        "offsets-missing": safetensors_file({"a": A, "b": {"dtype": "F16", "shape": [4]}}, DATA),
        "size-mismatch": safetensors_file(with_b(shape=[3]), DATA),
        "shape-float": safetensors_file(with_b(shape=[4.0]), DATA),
        "shape-half": safetensors_file(with_b(shape=[2.5]), DATA),
        "shape-string": safetensors_file(with_b(shape=["4"]), DATA),
        "shape-negative": safetensors_file(with_b(shape=[-4]), DATA),
        "shape-bool": safetensors_file(with_b(shape=[True, 4]), DATA),
        "shape-not-list": safetensors_file(with_b(shape=4), DATA),
        "shape-2^64": safetensors_file(with_b(shape=[2**64, 0]), DATA),
        "shape-overflow": safetensors_file(with_b(shape=[2**62, 2**62]), DATA),
        "dtype-unknown": safetensors_file(with_b(dtype="F9"), DATA),
        "dtype-lowercase": safetensors_file(with_b(dtype="f16"), DATA),
        "dtype-number": safetensors_file(with_b(dtype=16), DATA),
        "entry-not-object": safetensors_file({"a": A, "b": [1, 2]}, DATA),
        "entry-extra-key": safetensors_file(with_b(extra=1), DATA),
        "duplicate-key": safetensors_file(
            {}, raw_header=b'{"a":' + json.dumps(A).encode() + b',"a":' + json.dumps(A).encode() + b"}", data=DATA[:16]
        ),
        "metadata-number": safetensors_file({"__metadata__": {"format": 1}, "a": A, "b": B}, DATA),
        "metadata-list": safetensors_file({"__metadata__": ["pt"], "a": A, "b": B}, DATA),
        "header-list": safetensors_file([A]),
        "header-string": safetensors_file("a"),
        "header-leading-space": safetensors_file(
            {}, raw_header=b" " + json.dumps({"a": A, "b": B}).encode(), data=DATA
        ),
        "header-not-json": safetensors_file({}, raw_header=b"{not json}", data=DATA),
        "header-not-utf8": safetensors_file({}, raw_header=b'{"\xff": 1}', data=DATA),
        "header-nan": safetensors_file({}, raw_header=b'{"a": NaN}', data=DATA),
        "header-deep": safetensors_file({}, raw_header=b'{"a":' + b"[" * 10000 + b"]" * 10000 + b"}"),
        "length-beyond-file": safetensors_file({"a": A, "b": B}, DATA, length=10**6),
        "length-zero": safetensors_file({"a": A, "b": B}, DATA, length=0),
        "length-huge": safetensors_file({"a": A, "b": B}, DATA, length=2**63),
        "too-short": b"\x01\x02",
        "empty-file": b"",
        "name-empty": safetensors_file({"": A}, DATA[:16]),
    }
    return cases


def library_refuses(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                handle.get_tensor(name)
    except Exception:
        return True
    return False


def we_refuse(path: Path) -> bool:
    """read_header's verdict; anything but a clean InputError fails the test."""
    from mergekit_lite.errors import InputError
    from mergekit_lite.io.safetensors import read_header

    try:
        read_header(path)
    except InputError as error:
        assert "\n" not in str(error)
        return True
    return False


def test_headers_at_least_as_strict_as_the_safetensors_library(tmp_path):
    refused_by_library, stricter = [], []
    for name, content in crafted_headers().items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        theirs, ours = library_refuses(path), we_refuse(path)
        if theirs:
            refused_by_library.append(name)
            assert ours, f"{name}: the safetensors library refuses it, mergekit-lite accepted it"
        elif ours:
            stricter.append(name)
    assert {"overlap", "alias", "gap", "shape-half", "trailing-data", "empty-header-with-data"} <= set(
        refused_by_library
    )
    assert not {"valid", "valid-metadata", "valid-padded", "valid-zero-size"} & set(refused_by_library + stricter)
    assert stricter == ["duplicate-key"]  # the library keeps the last of two same-named tensors; we refuse


def test_empty_header_model_is_refused(tmp_path, work):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(safetensors_file({}))
    one_error_line(
        cli(*lerp_args(work / "pre", folder), "--out", tmp_path / "merged"),
        2,
        r"/empty: holds no tensors \(an empty safetensors header\)",
    )


def test_corrupt_shard_error_never_echoes_its_bytes(fresh):
    shard = first_shard(fresh / "post")
    shard.write_bytes(b"password=hunter2\n" * 10)
    line = one_error_line(
        cli(*lerp_args("pre", "post"), "--out", "merged", cwd=fresh), 2, r"corrupted safetensors header"
    )
    assert "hunter2" not in line and str(int.from_bytes(b"password", "little")) not in line


# ------------------------------------------------------------------------- property: never a traceback


@pytest.fixture(scope="module")
def header_seed(tmp_path_factory) -> bytes:
    folder = tmp_path_factory.mktemp("seed")
    save_file(
        {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.float16)},
        folder / "model.safetensors",
        metadata={"format": "pt"},
    )
    return (folder / "model.safetensors").read_bytes()


def json_values():
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
    return st.recursive(
        scalars,
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
        max_leaves=12,
    )


def mutate_json(data, path, value):
    """Replace the value at a (wrapped) path of keys / indices with `value`."""
    if not path or not isinstance(data, (dict, list)) or not data:
        return value
    keys = list(data) if isinstance(data, dict) else list(range(len(data)))
    key = keys[path[0] % len(keys)]
    data[key] = mutate_json(data[key], path[1:], value)
    return data


@pytest.mark.slow
def test_mutated_headers_and_indices_never_raise_anything_but_one_line(header_seed, work, tmp_path_factory):
    """Random byte edits and JSON-value swaps in a header, an index or a config: an InputError or a model."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from mergekit_lite.errors import InputError
    from mergekit_lite.io.safetensors import open_model

    length = struct.unpack("<Q", header_seed[:8])[0]
    header = json.loads(header_seed[8 : 8 + length])
    folder = tmp_path_factory.mktemp("mutated")
    shutil.copytree(work / "post", folder / "model")
    model = folder / "model"
    pristine = {name: (model / name).read_text() for name in ("model.safetensors.index.json", "config.json")}

    def verdict(target: Path) -> None:
        try:
            open_model(target)
        except InputError as error:
            assert "\n" not in str(error)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data):
        kind = data.draw(st.sampled_from(["bytes", "header-json", "index-json", "config-json"]))
        if kind == "bytes":
            content = bytearray(header_seed)
            for _ in range(data.draw(st.integers(1, 4))):
                content[data.draw(st.integers(0, len(content) - 1))] = data.draw(st.integers(0, 255))
            (folder / "x.safetensors").write_bytes(bytes(content))
            if library_refuses(folder / "x.safetensors"):
                assert we_refuse(folder / "x.safetensors")
            verdict(folder / "x.safetensors")
        elif kind == "header-json":
            path = data.draw(st.lists(st.integers(0, 5), max_size=3))
            mutated = json.dumps(mutate_json(json.loads(json.dumps(header)), path, data.draw(json_values())))
            (folder / "x.safetensors").write_bytes(safetensors_file({}, header_seed[8 + length :], mutated.encode()))
            if library_refuses(folder / "x.safetensors"):
                assert we_refuse(folder / "x.safetensors")
            verdict(folder / "x.safetensors")
        else:
            name = "model.safetensors.index.json" if kind == "index-json" else "config.json"
            path = data.draw(st.lists(st.integers(0, 100), max_size=3))
            mutated = mutate_json(json.loads(pristine[name]), path, data.draw(json_values()))
            (model / name).write_text(json.dumps(mutated))
            try:
                verdict(model)
            finally:
                (model / name).write_text(pristine[name])

    check()


# ---------------------------------------------------------------------------------------------- signals


@pytest.fixture(scope="module")
def big_pair(tmp_path_factory) -> tuple[Path, Path]:
    """Two ~13 MB single-file models of 50 tensors: a merge of them takes about a second."""
    return save_random_pair(tmp_path_factory.mktemp("big"), 50, (256, 256))


def start_big_merge(big_pair, out: Path) -> subprocess.Popen:
    a, b = big_pair
    return subprocess.Popen(
        [str(CLI), *map(str, lerp_args(a, b)), "--out", str(out), "--out-shard-size", "1MB"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def wait_for_partial(process: subprocess.Popen, out: Path) -> Path:
    partial = out.parent / f".{out.name}.partial-{process.pid}"
    deadline = time.monotonic() + 120
    while not (partial.is_dir() and any(partial.glob("*.safetensors"))):
        assert process.poll() is None, f"the merge ended before it was interrupted: {process.stderr.read()}"
        assert time.monotonic() < deadline, "the merge never started writing"
        time.sleep(0.005)
    return partial


STRESS_TRIES = 32


@pytest.mark.slow
def test_interrupts_at_random_moments_never_hang_and_leave_nothing(big_pair, tmp_path):
    """SIGINT or SIGTERM at 32 random moments, from interpreter start-up to the final rename.

    Each run must end within 90 s of its signal (a deadlock is forever; this machine may be loaded):
    interrupted (exit 130/143, one line, no output, no temp folder) or finished (a complete output). A signal that lands while the interpreter itself starts, before
    any of our code runs, gets Python's default action (death by SIGTERM, KeyboardInterrupt in start-up, or a
    KeyboardInterrupt Python reports as ignored in one of its import callbacks, after which the run completes):
    nothing was written then, or the whole output.
    """
    rng = random.Random(20261203)
    plans = [
        (index, rng.choice([signal.SIGINT, signal.SIGTERM]), rng.uniform(0.0, 4.0)) for index in range(STRESS_TRIES)
    ]

    def attempt(plan):
        index, signum, delay = plan
        out = tmp_path / f"out{index}"
        process = start_big_merge(big_pair, out)
        time.sleep(delay)
        process.send_signal(signum)
        try:
            _, stderr = process.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            return index, "hang", signum, delay, ""
        return index, process.returncode, signum, delay, stderr

    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(pool.map(attempt, plans))
    interrupted = 0
    for index, code, signum, delay, stderr in outcomes:
        out = tmp_path / f"out{index}"
        assert code != "hang", f"try {index}: still running 90 s after {signum.name} at {delay:.2f} s"
        assert not list(tmp_path.glob(f".out{index}.partial-*")), f"try {index}: temp folder left"
        if code == 0:
            # a complete run; a signal that landed in Python's own start-up may have been swallowed by it
            # ("Exception ignored in: <importlib callback>", KeyboardInterrupt) before our handlers existed
            lines = stderr.strip().splitlines()
            assert (
                not lines or lines[0].startswith("Exception ignored in") and lines[-1].startswith("KeyboardInterrupt")
            ), f"try {index}: {stderr}"
            assert sum(len(load_file(shard)) for shard in out.glob("*.safetensors")) == 50
        elif code == -signum or "KeyboardInterrupt" in stderr and "Interrupted" not in stderr:
            # Python's own start-up (before our handlers) or its shutdown (after the final rename): nothing
            # written, or the whole output, never a part of it
            assert not out.exists() or sum(len(load_file(shard)) for shard in out.glob("*.safetensors")) == 50
        else:
            interrupted += 1
            assert code == 128 + signum and stderr.strip() == f"interrupted ({signum.name})", (code, stderr)
            assert not out.exists()
    assert interrupted >= STRESS_TRIES // 3, outcomes


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_torch_imports_ends_in_one_line_once_it_has_imported(tmp_path, work, signum):
    """torch's import runs Python inside C++ (pybind11), where an exception cannot always unwind: the process
    aborted once ("terminate called after throwing ... error_already_set"). A signal sent from inside that
    import (an audit hook fires as torch._C loads) is acted on once torch has imported: one line, 128 + signal."""
    program = (
        "import atexit, os, signal, sys, mergekit_lite.cli.main\n"
        "def hook(event, args):\n"
        "    if event == 'import' and args[0] == 'torch._C' and not hasattr(hook, 'sent'):\n"
        f"        hook.sent = True; os.kill(os.getpid(), {int(signum)})\n"
        "sys.addaudithook(hook)\n"
        "atexit.register(lambda: print('sent', hasattr(hook, 'sent'),\n"
        "                              'whole', 'torch.nn.functional' in sys.modules))\n"
        "sys.argv[0] = 'mergekit-lite'\nmergekit_lite.cli.main.main()\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            program,
            *map(str, lerp_args(work / "pre", work / "post")),
            "--out",
            tmp_path / "merged",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert (result.returncode, result.stderr) == (128 + signum, f"interrupted ({signum.name})\n")
    assert result.stdout == "sent True whole True\n"
    assert not (tmp_path / "merged").exists() and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_signal_during_the_exit_of_a_finished_run_is_quiet(tmp_path, work):
    """A signal after the output is in place, while the interpreter shuts down (here from an atexit callback,
    which runs last): the run still exits 0 with nothing on stderr, and its output is whole."""
    program = (
        "import atexit, os, signal, sys, mergekit_lite.cli.main\n"
        "atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))\n"
        "sys.argv[0] = 'mergekit-lite'\nmergekit_lite.cli.main.main()\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            program,
            *map(str, lerp_args(work / "pre", work / "post")),
            "--out",
            tmp_path / "merged",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert list((tmp_path / "merged").glob("*.safetensors"))


# ------------------------------------------------------------------------------- the last line of defence


@pytest.mark.slow
def test_unexpected_exception_is_one_line_with_the_traceback_saved(tmp_path, work):
    """A bug (injected: plan_merge raising a ZeroDivisionError) is exit 1, one line, the traceback in a file."""
    program = (
        "import sys, mergekit_lite.cli.main, mergekit_lite.merge.engine as engine\n"
        "def broken(*args, **kwargs):\n    return 1 / 0\n"
        "engine.plan_merge = broken\nsys.argv[0] = 'mergekit-lite'\nmergekit_lite.cli.main.main()\n"
    )
    env = {**ENV, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            program,
            *map(str, lerp_args(work / "pre", work / "post")),
            "--out",
            tmp_path / "merged",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    line = one_error_line(
        result, 1, r"^error: internal error: ZeroDivisionError: division by zero; traceback saved to "
    )
    saved = Path(line.rsplit("traceback saved to ", 1)[1])
    assert saved.parent == tmp_path / "cache" / "mergekit-lite"
    assert "Traceback" in saved.read_text() and "in broken\nZeroDivisionError" in saved.read_text()
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--out-shard-size", "inf"], r"'inf' is no size"),
        (["--device", "cuda:7"], r"device 'cuda:7' is not available here"),
    ],
)
def test_huge_numbers_and_missing_devices_are_one_line(fresh, args, pattern):
    one_error_line(cli(*lerp_args("pre", "post"), *args, "--out", "merged", cwd=fresh), 2, pattern)


def test_a_regular_expression_that_does_not_compile_is_one_line(fresh):
    one_error_line(
        cli("extract", "--base", "pre", "--model", "post", "--out", "lora", "-i", "[", cwd=fresh),
        2,
        r"^error: '\[' is not a regular expression \(unterminated character set\)$",
    )
    assert not (fresh / "lora").exists()


def test_a_config_declaring_millions_of_layers_is_not_built():
    """transformers builds a config's model (on the meta device) to learn its tied tensors and towers, paying
    time and memory per layer: a few bytes of config.json asking for millions of layers are not built (names alone
    decide, as for an unknown architecture) instead of taking hours and all the memory."""
    from mergekit_lite.io import architecture

    text = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
    }
    composite = {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": {**text, "num_hidden_layers": 10**7},
    }
    started = time.monotonic()
    assert architecture.skeleton(composite) is None and architecture.tied_tensors(composite) == {}
    assert architecture.skeleton({**text, "architectures": ["LlamaForCausalLM"], "num_local_experts": 10**9}) is None
    assert time.monotonic() - started < 5
    assert architecture.skeleton({**text, "architectures": ["LlamaForCausalLM"]}) is not None  # real sizes still built


@pytest.mark.parametrize("alphas, count", [("0:1:1e-12", "1,000,000,000,001"), ("0:1:1e-6", "1,000,001")])
def test_absurd_alpha_grid_is_refused_at_once(fresh, alphas, count):
    """The grid's size is checked before it is built: no hang, no run folder, the count and the cap named."""
    started = time.monotonic()
    args = ["sweep", "--pre", "pre", "--post", "post", "--alphas", alphas, "--old-tasks", "a", "--new-tasks", "b"]
    one_error_line(cli(*args, "--out", "runs", cwd=fresh), 2, rf"grid of {count} points; at most 500")
    assert time.monotonic() - started < 30 and not (fresh / "runs").exists()


def test_merge_config_anchor_bomb_is_refused_at_once(fresh):
    bomb = SWEEP_YAML_CASES[4][0]
    (fresh / "merge.yaml").write_text("method: linear\nbase: pre\nmodels: [post]\n" + bomb)
    started = time.monotonic()
    one_error_line(
        cli("merge", "merge.yaml", "--out", "merged", cwd=fresh),
        2,
        r"merge\.yaml: YAML expands to more than 100000 values through its aliases",
    )
    assert time.monotonic() - started < 30 and not (fresh / "merged").exists()


FAILS_AFTER_SIGNAL = """
import os, signal, sys, time
import click
from mergekit_lite.cli import main as cli

@click.command()
def fails_after_signal():
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    except KeyboardInterrupt:  # what pybind11 makes of an exception raised inside an extension's import
        raise ImportError("initialization failed") from None

cli.LazyGroup.get_command = lambda self, ctx, name: fails_after_signal
cli.main(["fails-after-signal"])
"""


def test_a_library_failing_on_the_signal_ends_as_the_interrupt(tmp_path):
    """A library that turns Ctrl-C into its own error (a pybind11 extension's import: ImportError) still ends as
    an interrupt, 130 and one line, not as an internal error with a saved traceback."""
    run = subprocess.run(
        [sys.executable, "-c", FAILS_AFTER_SIGNAL],
        env={**ENV, "XDG_CACHE_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 130, run.stderr
    assert run.stderr == "interrupted (SIGINT)\n"
    assert not any(tmp_path.rglob("crash-*")), "an interrupt is not a crash"


def test_matplotlib_and_torch_imports_are_deferred():
    """Both load pybind11 extensions, where a raised KeyboardInterrupt cannot unwind: their imports defer it."""
    script = (
        "import os, signal, sys\n"
        "from mergekit_lite import interrupts\n"
        "interrupts.install(); interrupts.started()\n"
        "seen = []\n"
        "signal.signal(signal.SIGUSR1, lambda *_: seen.append(interrupts._deferring))\n"
        "class Probe:\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name in ('matplotlib.colors', 'torch.version'):\n"
        "            os.kill(os.getpid(), signal.SIGUSR1)\n"
        "sys.meta_path.insert(0, Probe())\n"
        "import matplotlib, torch\n"
        "print(seen)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[1, 1]"
