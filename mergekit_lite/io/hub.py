"""Model references that name a Hugging Face Hub repository (`org/name`, `org/name@revision`), as in mergekit, or a
folder inside one (`org/name/sub/folder[@revision]`: PEFT's `subfolder`, where a repository keeps several adapters).

A reference that exists on disk is always the local file or folder. Anything else of the form `org/name`
is fetched into huggingface_hub's own cache (only the files the command reads) and replaced by the
snapshot folder. With HF_HUB_OFFLINE=1 the cache alone answers, and a model that is not cached is a
one-line error that says so.

The cache is read as huggingface_hub lays it out (models--org--name/{refs,snapshots,blobs}, snapshot files
linking into ../../blobs) but never walked out of: huggingface_hub joins a revision, and the commit a
`refs/` file holds, onto the cache path as they are, so `@../../x` or a refs/main holding `../../..` would
make any command read a model from elsewhere. `checked_snapshot` is the one place every command's hub ids
pass through (merge, audit, sweep and extract resolve them here).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from mergekit_lite.errors import InputError

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?P<subfolder>(?:/[\w.-]+)*)(?:@(?P<revision>[\w./-]+))?$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")  # what huggingface_hub writes into refs/ and names snapshots by
# What a merge reads from a model repository: weights, their index, config and tokenizer files.
TOKENIZER_PATTERNS = [
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "chat_template.*",
]
ALLOW_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    *TOKENIZER_PATTERNS,
    "adapter_config.json",
    "README.md",
]
# What an audit reads from an adapter repository: never a pickle (adapter_model.bin is refused unread).
ADAPTER_PATTERNS = [
    "adapter_config.json",
    "adapter_model.safetensors",
    "base_fingerprint.json",
    "README.md",
    *TOKENIZER_PATTERNS,
]


def is_hub_id(reference: str) -> bool:
    """True for `org/name[/subfolder][@revision]` that is not a path on disk (a local folder always wins)."""
    return bool(HUB_ID.match(str(reference))) and not Path(reference).exists()


def split_hub_id(reference: str) -> tuple[str, str | None]:
    """(repo, revision) of `org/name[@revision]`; a revision that could leave the cache is refused here."""
    match = HUB_ID.match(reference)
    if match is None:
        raise InputError(f"{reference}: not a Hugging Face Hub id (org/name[@revision])")
    revision = match["revision"]
    if revision is not None and (revision.startswith("/") or ".." in revision.split("/")):
        raise InputError(
            f"{reference}: revision {revision!r} is not a branch, tag or commit (it holds '..' or "
            "starts with '/'); refused"
        )
    return match["repo"], revision


def hub_subfolder(reference: str) -> str:
    """The folder inside the repository a hub id names ('' for its top); `.` or `..` segments are refused."""
    match = HUB_ID.match(reference)
    subfolder = match["subfolder"].strip("/") if match else ""
    if any(part in (".", "..") for part in subfolder.split("/")):
        raise InputError(f"{reference}: subfolder {subfolder!r} holds '.' or '..'; refused")
    return subfolder


def repo_cache_folder(repo: str) -> Path:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_ref(reference: str, repo: str, revision: str | None) -> None:
    """The refs/ file huggingface_hub would read for a branch or tag: a regular file inside the repository's cache
    folder holding a commit hash, nothing else (it becomes a path: snapshots/<what it holds>)."""
    if revision is not None and COMMIT.match(revision):
        return
    folder = repo_cache_folder(repo)
    ref = folder / "refs" / (revision or "main")
    if not os.path.lexists(ref):
        return
    real = Path(os.path.realpath(ref))
    if not _inside(real, Path(os.path.realpath(folder))) or not stat.S_ISREG(os.stat(ref).st_mode):
        raise InputError(f"{reference}: {ref} is not a regular file inside {folder}; refused")
    with open(ref, "rb") as handle:
        held = handle.read(128).decode("ascii", "replace").strip()
    if not COMMIT.match(held):
        raise InputError(
            f"{reference}: {ref} does not hold a commit hash (40 hex digits); refused, the cache "
            "would be read outside the repository's folder"
        )


def checked_snapshot(reference: str, repo: str, snapshot: str) -> Path:
    """The snapshot folder, if it is a folder of the repository's own cache and every file in it is a regular file
    whose real path stays inside that cache folder (its links lead into ../../blobs); else a one-line error."""
    folder = Path(os.path.realpath(repo_cache_folder(repo)))
    real = Path(os.path.realpath(snapshot))
    if real.parent != folder / "snapshots":
        raise InputError(f"{reference}: the snapshot {snapshot} lies outside {folder / 'snapshots'}; refused")
    for root, dirs, files in os.walk(snapshot):
        for name in dirs + files:
            path = Path(root) / name
            target = Path(os.path.realpath(path))
            mode = os.stat(path).st_mode if os.path.exists(path) else 0
            regular = stat.S_ISDIR(mode) if name in dirs else stat.S_ISREG(mode)
            if not regular or not _inside(target, folder):
                raise InputError(
                    f"{reference}: {path} in the cached snapshot is not a regular file inside "
                    f"{folder} (a link out of the cache?); refused"
                )
    return Path(snapshot)


def hub_id_of(path) -> str | None:
    """`org/name` of a snapshot folder of huggingface_hub's cache (.../models--org--name/snapshots/<commit>), or of a
    folder inside one."""
    for folder in (Path(path), *Path(path).parents):
        entry = folder.parent.parent.name
        if folder.parent.name == "snapshots" and entry.startswith("models--"):
            return entry.removeprefix("models--").replace("--", "/", 1)
    return None


def split_lora_reference(reference: str) -> tuple[str, str] | None:
    """(model, adapter) for mergekit's `model+lora` reference (the model with that LoRA adapter merged in), each a
    path or hub id; None for a plain reference. A path on disk stays a path, '+' in its name or not; where folders
    with a '+' make several splits, the one whose both parts exist on disk is taken."""
    text = str(reference)
    if "+" not in text or os.path.lexists(text):
        return None
    splits = [(text[:at], text[at + 1 :]) for at, char in enumerate(text) if char == "+"]
    if len(splits) > 1:
        splits = [split for split in splits if all(os.path.lexists(part) for part in split)]
    if len(splits) != 1 or not all(splits[0]):
        raise InputError(
            f"{text}: no such file or folder, nor a model+lora reference (mergekit's form: one "
            "model and one LoRA adapter joined by '+')"
        )
    return splits[0]


def reference_paths(*references: str) -> list[str]:
    """The files or folders references read: both parts of a model+lora reference, else the reference itself."""
    return [path for reference in references for path in split_lora_reference(reference) or [reference]]


def lora_host(reference: str) -> str:
    """The model a reference's config and tokenizer files come from: the model of a model+lora (an adapter brings
    none, and mergekit copies its merged model's), else the reference itself."""
    return reference_paths(reference)[0]


def resolve_model(reference: str, allow_patterns: list[str] = ALLOW_PATTERNS) -> str:
    """The local path for a model reference: itself when on disk or not hub-shaped, else the hub snapshot; both
    parts of a model+lora reference, the adapter with the files an audit reads."""
    lora = split_lora_reference(reference)
    if lora:
        return f"{resolve_model(lora[0], allow_patterns)}+{resolve_model(lora[1], ADAPTER_PATTERNS)}"
    if not is_hub_id(reference):
        return reference
    repo, revision = split_hub_id(reference)
    subfolder = hub_subfolder(reference)
    from huggingface_hub import constants, snapshot_download

    check_ref(reference, repo, revision)
    patterns = [f"{subfolder}/{pattern}" for pattern in allow_patterns] if subfolder else allow_patterns
    with hub_errors(reference, revision):
        snapshot = snapshot_download(
            repo, revision=revision, allow_patterns=patterns, local_files_only=constants.HF_HUB_OFFLINE
        )
    folder = checked_snapshot(reference, repo, snapshot) / subfolder
    if not folder.is_dir():
        raise InputError(
            f"{reference}: {repo} has no folder {subfolder!r}"
            + (f" at {revision}" if revision else "")
            + " (or none of the files read from it)"
        )
    return str(folder)


def repo_files(reference: str, snapshot: Path) -> list[str]:
    """The files of the repository at that revision, under the hub id's subfolder and relative to it (`snapshot` is
    the folder resolve_model gave): the Hub's listing online, the cached snapshot's offline (names only: nothing is
    opened), so a pickle the audit refuses is known without being downloaded."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return sorted(str(path.relative_to(snapshot)) for path in Path(snapshot).rglob("*"))
    repo, revision = split_hub_id(reference)
    prefix = f"{hub_subfolder(reference)}/".lstrip("/")
    with hub_errors(reference, revision):
        files = HfApi().list_repo_files(repo, revision=revision)
    return sorted(name.removeprefix(prefix) for name in files if name.startswith(prefix))


def cached_refs(repo: str) -> list[str]:
    """The branches and tags the cache holds for a repository (the names of its refs/ files; none is read)."""
    refs = repo_cache_folder(repo) / "refs"
    return sorted(str(path.relative_to(refs)) for path in refs.rglob("*") if path.is_file()) if refs.is_dir() else []


class hub_errors:
    """huggingface_hub's errors (gated, missing revision or repository, offline) as one-line user errors."""

    def __init__(self, reference: str, revision: str | None):
        self.reference, self.revision = reference, revision

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if error is None:
            return False
        from huggingface_hub import constants
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        reference = self.reference
        if isinstance(error, GatedRepoError):
            raise InputError(
                f"{reference}: gated model on the Hugging Face Hub; accept its terms and log in (huggingface-cli login)"
            ) from None
        if isinstance(error, RevisionNotFoundError):
            raise InputError(f"{reference}: the Hugging Face Hub has no revision {self.revision!r}") from None
        if isinstance(error, RepositoryNotFoundError):
            raise InputError(f"{reference}: no such folder, and no such model on the Hugging Face Hub") from None
        if isinstance(error, LocalEntryNotFoundError):
            cached = cached_refs(split_hub_id(reference)[0])
            if constants.HF_HUB_OFFLINE and self.revision and cached:
                raise InputError(
                    f"{reference}: revision {self.revision!r} is not in the Hugging Face cache (which holds "
                    f"{', '.join(cached)}) and HF_HUB_OFFLINE=1; download it once online"
                ) from None
            if constants.HF_HUB_OFFLINE:
                raise InputError(
                    f"{reference}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                    "HF_HUB_OFFLINE=1; download it once online"
                ) from None
            raise InputError(
                f"{reference}: no such folder, and the Hugging Face Hub cannot be reached "
                "(set HF_HUB_OFFLINE=1 to use the cache)"
            ) from None
        if isinstance(error, HfHubHTTPError):
            raise InputError(f"{reference}: the Hugging Face Hub refused it ({str(error).splitlines()[0]})") from None
        return False
