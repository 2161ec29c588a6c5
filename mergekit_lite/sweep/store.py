"""The run folder: one JSON per finished point (`points/`, probe points in `probes/`), written atomically
and checked against the sweep's identity when read back, so a killed sweep loses at most the point in
progress and a rerun of the same command picks up where it stopped; and the lock that keeps one sweep per
run folder."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from mergekit_lite.errors import InputError
from mergekit_lite.io.outputs import OUTPUT_MARKER, write_atomic, written_by_us
from mergekit_lite.io.validation import is_regular_inside, parse_json, read_text, require_regular_inside, validate
from mergekit_lite.sweep.scoring import TaskRun
from mergekit_lite.sweep.settings import SweepSettings

POINTS_DIR = "points"
PROBES_DIR = "probes"  # probe-mode points: scored on probe samples only, never resumed as full points
RECALL_DIR = "recall"
SIMILARITY_FILE = "similarity.json"
LOCK_FILE = ".sweep.lock"
OUTPUTS_FILE = "outputs.json"  # what the sweep wrote outside its run folder (--save-best, --replay), to rerun over it
# a point file is read whole: pre's holds every doc's prompt (a full few-shot MMLU alone is tens of MiB), so
# point files get a larger cap than other JSON inputs
POINT_FILE_BYTES = 1 << 30


def point_file(folder: Path, label: str, directory: str = POINTS_DIR) -> Path:
    return folder / directory / f"{label.replace('=', '_')}.json"


def alpha_label(alpha: float) -> str:
    return f"alpha={alpha!r}"


def point_label(settings: SweepSettings, alpha: float) -> str:
    """A point's label: `alpha=A`, and in a row of a 2-D grid `alpha=A,density=D` (a 1-D sweep's labels and file
    names are those of every sweep before 2-D grids, so old run folders resume)."""
    second = settings.second
    return alpha_label(alpha) + (f",{second}={getattr(settings, second)!r}" if second else "")


class SavedText(BaseModel):
    """One doc's text in a saved point: its answer, and in pre's file its prompt, gold answer and completion."""

    model_config = ConfigDict(strict=True, extra="forbid")
    prompt: str | None = None
    gold: str | None = None
    answer: str | None = None
    completion: str | None = None


class SavedTask(BaseModel):
    """One task of a saved point, as `TaskRun.to_json` writes it: per-sample outcomes (and, since samples.jsonl
    shows texts, each doc's text: absent in older point files), or why it was skipped."""

    model_config = ConfigDict(strict=True, extra="forbid")
    task: str
    group: Literal["old", "new"]
    metric: str | None = None
    filter: str | None = None
    n_choices: int | float | None = None
    correct: dict[str, bool] | None = None
    doc_ids: dict[str, int] | None = None
    answer_rule: str | None = None
    texts: dict[str, SavedText] | None = None
    skipped: str | None = None
    nonfinite_logits: bool | None = None


class PointFile(BaseModel):
    """One finished point as `save_point` writes it."""

    model_config = ConfigDict(strict=True, extra="forbid")
    identity: dict[str, Any]
    label: str
    alpha: float | None
    tasks: list[SavedTask]


def load_points(folder: Path, identity: dict, directory: str = POINTS_DIR) -> dict[str, list[TaskRun]]:
    """Every finished point in the run folder by label. One saved under other settings -> InputError,
    whether or not this grid includes it: the folder belongs to one sweep."""
    points = {}
    for path in sorted((folder / directory).glob("*.json")):
        try:
            text = read_text(require_regular_inside(path, folder / directory), POINT_FILE_BYTES)
            point = validate(PointFile, parse_json(text, path), path)
        except InputError as error:
            raise InputError(f"{error} (not a sweep point file; delete it to evaluate that point again)") from None
        label, saved = point.label, point.identity
        runs = [TaskRun.from_json(entry.model_dump(exclude_unset=True)) for entry in point.tasks]
        keys = [*identity, *(["lm_eval"] if "lm_eval" in saved and "lm_eval" not in identity else [])]
        changed = next((key for key in keys if saved.get(key) != identity.get(key)), None)
        if changed:
            raise InputError(
                f"{folder} holds a sweep with other settings ({changed}: {saved.get(changed)!r} "
                f"there, {identity.get(changed)!r} now); use another --out"
            )
        points[label] = runs
    return points


def save_point(path: Path, identity: dict, label: str, alpha: float | None, runs: list[TaskRun]) -> None:
    """One finished point; pre's file also keeps the prompts and gold answers every point shares."""
    data = {
        "identity": identity,
        "label": label,
        "alpha": alpha,
        "tasks": [run.to_json(prompts=label == "pre") for run in runs],
    }
    write_atomic(path, json.dumps(data, allow_nan=False) + "\n")


def _folder_state(out: Path) -> str:
    """ "absent", "empty" or "used": what `taken_back_if_unused` may take back from a run folder."""
    if not os.path.lexists(out):
        return "absent"
    return "empty" if out.is_dir() and not out.is_symlink() and not any(out.iterdir()) else "used"


@contextmanager
def taken_back_if_unused(out: str | Path, prepare: Callable[[], Path]):
    """The run folder `prepare` makes or reuses at `out`, yielded; a run that fails (a refusal, Ctrl-C, even while
    the folder is being prepared) before saving any point leaves nothing behind in a folder that was absent or empty
    before it: its marker, lock and empty folders are taken back, and the folder itself when the run made it. A
    folder holding anything else (a saved point, RECALL's similarities) stays, to resume."""
    out = Path(out)
    state = _folder_state(out)
    try:
        yield prepare()
    except BaseException:
        if state != "used":
            _remove_unused(out, remove_folder=state == "absent")
        raise


def _remove_unused(folder: Path, remove_folder: bool) -> None:
    if not folder.is_dir() or folder.is_symlink():
        return
    entries = sorted(folder.rglob("*"), key=lambda path: len(path.parts), reverse=True)  # deepest first
    files = [path for path in entries if path.is_symlink() or not path.is_dir()]
    if any(path.name not in (OUTPUT_MARKER, LOCK_FILE) or path.is_symlink() for path in files):
        return
    for path in files:
        path.unlink()
    for path in entries:
        if path not in files:
            path.rmdir()
    if remove_folder:
        folder.rmdir()


@contextmanager
def run_lock(folder: Path):
    """One sweep per run folder: a second one fails at once instead of racing on the same files."""
    handle = open(folder / LOCK_FILE, "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise InputError(f"{folder}: another sweep is running in this run folder (it holds {LOCK_FILE})") from None
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def probe_identity(settings: SweepSettings) -> dict:
    """What a probe point depends on beyond a full point's identity: the rate and the docs it samples from."""
    return {
        **settings.identity(),
        "probe": settings.probe,
        "selection": settings.selection,
        "selection_fraction": settings.selection_fraction,
    }


def _fingerprint(path: Path) -> str | None:
    """sha256 of a file, or of a folder's output marker (the manifest of each file it wrote, with its size); None when
    there is no such regular file."""
    target = path / OUTPUT_MARKER if path.is_dir() and not path.is_symlink() else path
    if not is_regular_inside(target, target.parent):
        return None
    digest = hashlib.sha256()
    with open(target, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _written(folder: Path) -> dict:
    path = Path(folder) / OUTPUTS_FILE
    if not is_regular_inside(path, Path(folder)):
        return {}
    try:
        data = parse_json(read_text(path), path)
    except InputError:
        return {}
    return data if isinstance(data, dict) else {}


def record_written(folder: Path, kind: str, path: str | os.PathLike) -> None:
    """Note in the run folder that this sweep wrote `path` (kind: "save_best" or "replay") and its fingerprint, so
    the same command run again recognises it as its own and writes it again."""
    written = _written(folder)
    written[kind] = {"path": os.path.realpath(path), "sha256": _fingerprint(Path(path))}
    write_atomic(Path(folder) / OUTPUTS_FILE, json.dumps(written, indent=1, sort_keys=True) + "\n")


def wrote_before(folder: str | os.PathLike, kind: str, path: str | os.PathLike) -> bool:
    """Whether `path` is what this run folder's sweep wrote as `kind` and is unchanged since (same content; for a
    folder, still ours with the same manifest)."""
    entry = _written(Path(folder)).get(kind)
    if not isinstance(entry, dict) or entry.get("path") != os.path.realpath(path) or os.path.islink(path):
        return False
    if Path(path).is_dir() and not written_by_us(Path(path)):
        return False
    fingerprint = _fingerprint(Path(path))
    return fingerprint is not None and fingerprint == entry.get("sha256")
