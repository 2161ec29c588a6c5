"""Output rules shared by every command that writes (merge, sweep, --save-best, audit fingerprint, demo).

- An output never is, contains, or sits inside-out of what the user asked to read: `--out` may not be an
  input, a folder holding an input, or the working folder or one of its ancestors.
- `--overwrite` replaces only what mergekit-lite wrote itself: a folder with the marker file it puts in every
  output folder (`OUTPUT_MARKER`), holding nothing but the files that marker lists with their sizes; it names
  the others when it refuses. A run folder (sweep, demo) is resumed only while it holds nothing but its own files.
- A folder is written beside its destination under a temporary name and renamed with RENAME_NOREPLACE
  (RENAME_EXCHANGE for --overwrite), so a folder that appears meanwhile, e.g. from a concurrent run, is
  never replaced: the later run fails and keeps its result out of the way instead.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mergekit_lite import interrupts
from mergekit_lite.errors import InputError
from mergekit_lite.io.layout import INDEX_FILE, WEIGHT_SUFFIXES
from mergekit_lite.io.model_card import CARD_FILE
from mergekit_lite.io.validation import check_folder_files, is_regular_inside, read_json, require_regular_inside

OUTPUT_MARKER = ".mergekit-lite-output"
FILE_RECORD_SUFFIX = ".mergekit-lite-output"  # `.NAME` + this: the record of an output file (`write_files`)
SHOWN_FOREIGN = 5
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def _temp_name(out: Path) -> str:
    return f".{out.name}.partial-{os.getpid()}"


def written_by_us(folder: Path) -> bool:
    """A folder mergekit-lite made: it holds the output marker (what may be in it is `foreign_files`' question)."""
    return is_regular_inside(Path(folder) / OUTPUT_MARKER, folder)


def _entries(folder: Path) -> dict[str, int | None]:
    """Every entry under `folder` by relative path: a regular file's size; None for anything else (a link, a FIFO,
    an empty folder), which no output of ours holds. Links are not followed."""
    entries: dict[str, int | None] = {}
    for root, folders, files in os.walk(folder):
        relative = Path(root).relative_to(folder)
        for name in files + [name for name in folders if os.path.islink(os.path.join(root, name))]:
            info = os.lstat(os.path.join(root, name))
            entries[(relative / name).as_posix()] = info.st_size if stat.S_ISREG(info.st_mode) else None
        if not files and not folders and root != str(folder):
            entries[relative.as_posix() + "/"] = None
    entries.pop(OUTPUT_MARKER, None)
    return entries


def record_output(folder: Path) -> None:
    """Write the marker as the manifest of what mergekit-lite wrote in `folder` (each file with its size), so
    --overwrite can later tell our files from any a user put beside them."""
    manifest = {
        "written_by": "mergekit-lite; --overwrite may replace this folder while it holds only these files",
        "files": _entries(folder),
    }
    (Path(folder) / OUTPUT_MARKER).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def foreign_files(folder: Path) -> list[str]:
    """The entries of an output folder that its manifest does not list at their recorded size: files a user
    added or changed. An older output without a manifest lists none, so all of its files count as foreign."""
    try:
        recorded = read_json(Path(folder) / OUTPUT_MARKER).get("files", {})
    except (InputError, AttributeError):
        recorded = {}
    recorded = recorded if isinstance(recorded, dict) else {}
    return sorted(name for name, size in _entries(Path(folder)).items() if size is None or recorded.get(name) != size)


def _named(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN_FOREIGN])
    return shown + (f" and {len(names) - SHOWN_FOREIGN} more" if len(names) > SHOWN_FOREIGN else "")


def check_output_path(out: str | os.PathLike, inputs: Iterable[str | os.PathLike | None] = ()) -> Path:
    """Refuse an output that is an input, contains one, lies inside an input folder, or is the working folder
    or an ancestor of it (paths compared after resolving links)."""
    out = Path(out)
    target = Path(os.path.realpath(out))
    cwd = Path(os.path.realpath(os.getcwd()))
    if target == cwd or target in cwd.parents:
        raise InputError(f"{out}: is the working folder or one of its parents; choose a new folder for the output")
    for source in inputs:
        if source is None or str(source) == "":
            continue
        source_path = Path(os.path.realpath(source))
        if target == source_path:
            raise InputError(f"{out}: is also an input ({source}); choose a new folder for the output")
        if target in source_path.parents:
            raise InputError(f"{out}: contains the input {source}; choose a new folder for the output")
        if source_path in target.parents and source_path.is_dir():
            raise InputError(f"{out}: is inside the input {source}; choose a folder outside the inputs")
    parent = next((folder for folder in out.absolute().parents if os.path.lexists(folder)), None)
    if parent is not None and not parent.is_dir():
        raise InputError(f"{out}: {parent} is not a folder; the output cannot go under it")
    return out


def _refuse_existing(out: Path, overwrite: bool) -> None:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise InputError(f"{out}: exists and is not a folder mergekit-lite wrote; not replacing it")
    if not out.exists():
        return
    if not written_by_us(out):
        raise InputError(
            f"{out}: already exists and was not written by mergekit-lite (no {OUTPUT_MARKER}); "
            "--overwrite replaces only mergekit-lite outputs, choose a new folder"
        )
    if not overwrite:
        raise InputError(f"{out}: already exists (pass --overwrite to replace it)")
    if foreign := foreign_files(out):
        raise InputError(
            f"{out}: holds files mergekit-lite did not write there ({_named(foreign)}); --overwrite "
            "replaces only a folder holding nothing but a mergekit-lite output, choose a new folder"
        )


def check_output_folder(
    out: str | os.PathLike, inputs: Iterable[str | os.PathLike | None] = (), overwrite: bool = False
) -> Path:
    """All the output rules that can be checked before any work: where `out` is, and what is there now."""
    out = check_output_path(out, inputs)
    _refuse_existing(out, overwrite)
    return out


def stale_partials(out: Path) -> list[Path]:
    """Temporary folders left next to `out` by runs that were killed (their process is gone, the marker is ours)."""
    stale = []
    for candidate in out.parent.glob(f".{out.name}.partial-*"):
        pid = candidate.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _process_alive(int(pid)) and written_by_us(candidate):
            stale.append(candidate)
    return stale


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _renameat2(source: Path, target: Path, flags: int) -> None:
    """Linux renameat2(2): RENAME_NOREPLACE fails with EEXIST if target exists, checked by the kernel atomically."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(target))


def rename_no_clobber(source: Path, target: Path) -> None:
    """Move `source` to `target` only if nothing is at `target`, atomically where the kernel allows it."""
    try:
        _renameat2(source, target, _RENAME_NOREPLACE)
        return
    except OSError as error:
        if error.errno == errno.EEXIST:
            raise InputError(
                f"{target}: appeared while this run was writing (another run?); "
                "left it untouched, this run's result is discarded"
            ) from None
        if error.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise
    # No renameat2 (old kernel, macOS, some network filesystems): link-free fallback that still never
    # replaces a non-empty folder (rename(2) fails with ENOTEMPTY), and checks for an empty one first.
    if os.path.lexists(target):
        raise InputError(f"{target}: appeared while this run was writing; left it untouched")
    os.rename(source, target)


def _replace_own_output(temp: Path, out: Path) -> None:
    """--overwrite: swap the new folder in, the old one out (which must still be ours), then delete the old."""
    if not out.exists():
        rename_no_clobber(temp, out)
        return
    _refuse_existing(out, overwrite=True)
    try:
        _renameat2(temp, out, _RENAME_EXCHANGE)
        shutil.rmtree(temp)  # `temp` now holds the replaced output
        return
    except OSError as error:
        if error.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise
    retired = out.parent / f".{out.name}.replaced-{os.getpid()}"
    rename_no_clobber(out, retired)
    rename_no_clobber(temp, out)
    shutil.rmtree(retired)


@contextmanager
def atomic_output_dir(
    out: str | os.PathLike, overwrite: bool = False, inputs: Iterable[str | os.PathLike | None] = ()
) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; rename it to `out` only if the block finishes.

    A failed or interrupted run removes its temporary folder; a killed one (SIGKILL) leaves a
    `.NAME.partial-PID` folder that no tool mistakes for a model, and the next run removes it.
    Signals are deferred throughout (the block calls `interrupts.check()` at its safe points), so the
    cleanup itself is never cut short; one that arrives during the final rename waits for the command's next
    safe point, since the output is then in place.
    """
    out = check_output_folder(out, inputs, overwrite)
    with interrupts.deferred(raise_at_end=False):
        out.parent.mkdir(parents=True, exist_ok=True)
        for stale in stale_partials(out):
            shutil.rmtree(stale, ignore_errors=True)
        temp = out.parent / _temp_name(out)
        if temp.exists() and written_by_us(temp):
            shutil.rmtree(temp)
        temp.mkdir()
        try:
            (temp / OUTPUT_MARKER).write_text("written by mergekit-lite; --overwrite may replace this folder\n")
            yield temp
            record_output(temp)
            interrupts.check()
            if overwrite:
                _replace_own_output(temp, out)
            else:
                rename_no_clobber(temp, out)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise


def check_run_folder(
    out: str | os.PathLike,
    inputs: Iterable[str | os.PathLike | None] = (),
    own: Callable[[str], bool] = lambda name: True,
) -> Path:
    """The rules of a run folder (sweep, demo) that later runs resume, checked without writing anything: it must
    be new, empty, or one mergekit-lite made that holds nothing but entries `own` recognises (relative paths) as
    what the run writes there, and no link, FIFO or device anywhere (empty folders of its own are fine)."""
    out = check_output_path(out, inputs)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise InputError(f"{out}: exists and is not a folder; choose a new run folder")
    if out.is_dir() and any(out.iterdir()) and not written_by_us(out):
        raise InputError(
            f"{out}: is a non-empty folder that mergekit-lite did not create (no {OUTPUT_MARKER}); "
            "choose a new or empty run folder"
        )
    if out.is_dir() and (
        foreign := sorted(
            name
            for name, size in _entries(out).items()
            if not own(name.rstrip("/")) or (size is None and name[-1] != "/")
        )
    ):
        raise InputError(
            f"{out}: holds files a run does not write ({_named(foreign)}); a run folder holds only "
            "its own files, choose a new run folder or move them"
        )
    return out


def prepare_run_folder(
    out: str | os.PathLike,
    inputs: Iterable[str | os.PathLike | None] = (),
    own: Callable[[str], bool] = lambda name: True,
) -> Path:
    """`check_run_folder`, then the folder made (or kept) with the marker that lets later runs resume it."""
    out = check_run_folder(out, inputs, own)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    marker = out / OUTPUT_MARKER
    if not marker.exists():
        try:
            write_atomic(marker, "a mergekit-lite run folder; reruns resume here\n")
        except BaseException:  # a full disk: no marker (written whole or not at all), nor a folder this run made
            if created:
                out.rmdir()
            raise
    return out


def check_output_file(
    out: str | os.PathLike,
    inputs: Iterable[str | os.PathLike | None] = (),
    recognise=lambda path: False,
    overwrite: bool = False,
    suffixes: Iterable[str] | None = None,
) -> Path:
    """A file output (e.g. a fingerprint): never an input or inside one's folder tree, in a folder that exists, with
    one of `suffixes` when the format follows the name, never replacing a file that `recognise` does not identify
    as mergekit-lite's own, or, with `overwrite`, that `write_files` did not write (`written_file`)."""
    out = Path(out)
    target = Path(os.path.realpath(out))
    for source in inputs:
        if source is None:
            continue
        source_path = Path(os.path.realpath(source))
        if target == source_path or (source_path.is_dir() and source_path in target.parents):
            raise InputError(f"{out}: is inside the input {source}; write the output elsewhere")
    if not out.absolute().parent.is_dir():
        raise InputError(f"{out}: {out.parent} is not an existing folder; create it first or write elsewhere")
    if suffixes is not None and out.suffix.lower().lstrip(".") not in suffixes:
        raise InputError(
            f"{out}: cannot tell the format from {out.suffix or 'a name without a suffix'}; end the name "
            f"with one of .{', .'.join(sorted(suffixes))}"
        )
    if os.path.lexists(out) and not (out.is_file() and not out.is_symlink() and recognise(out)):
        if overwrite and written_file(out):
            return out
        if written_file(out):
            raise InputError(f"{out}: already exists (mergekit-lite wrote it; pass --overwrite to replace it)")
        raise InputError(
            f"{out}: already exists and is not a file mergekit-lite wrote (or it was changed since); not replacing it"
        )
    return out


def _file_record(path: Path) -> Path:
    """The hidden file beside an output file that says mergekit-lite wrote it, and what it held."""
    return path.with_name(f".{path.name}{FILE_RECORD_SUFFIX}")


def _digest(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def written_file(path: str | os.PathLike) -> bool:
    """A regular file `write_files` wrote, unchanged since: its record beside it names its SHA-256."""
    path = Path(path)
    record = _file_record(path)
    if path.is_symlink() or not path.is_file() or not is_regular_inside(record, path.absolute().parent):
        return False
    try:
        data = read_json(record)
    except InputError:
        return False
    return isinstance(data, dict) and data.get("sha256") == _digest(path)


def write_files(files: dict[Path, str | Callable[[Path], None]], overwrite: bool = False) -> None:
    """Write a command's output files together or not at all: each into a temporary file beside it, then, once
    all are written, each renamed into place (never over a file that appeared meanwhile; with `overwrite` only
    over a file `written_file` recognises), each with the record that lets a later --overwrite replace it.
    An error or a signal before the renames leaves no file, temporary or not."""
    temps: dict[Path, Path] = {}
    placed: list[Path] = []  # new files already renamed into place: taken back if a later one cannot be
    try:
        for path, content in files.items():
            path = Path(path)
            temps[path] = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")  # the suffix: savefig's format
            _write_new(temps[path], content, path)
        with interrupts.deferred(raise_at_end=False):
            interrupts.check()
            for path, temp in temps.items():
                if overwrite and written_file(path):
                    os.replace(temp, path)
                else:
                    rename_no_clobber(temp, path)
                    placed.append(path)
                record = {
                    "written_by": "mergekit-lite; --overwrite may replace this file while it is unchanged",
                    "sha256": _digest(path),
                }
                write_atomic(_file_record(path), json.dumps(record) + "\n")
            placed.clear()
    finally:
        for temp in temps.values():
            temp.unlink(missing_ok=True)
        for path in placed:
            _file_record(path).unlink(missing_ok=True)
            path.unlink(missing_ok=True)


def _write_new(temp: Path, content: str | Callable[[Path], None], path: Path) -> None:
    try:
        temp.write_text(content) if isinstance(content, str) else content(temp)
    except OSError as error:  # write() errors carry no filename: name the target
        if error.filename is not None:
            raise
        raise OSError(error.errno, error.strerror or str(error), str(path)) from None


def write_atomic(path: Path, content: str | Callable[[Path], None]) -> None:
    """Write beside the target, then rename over it: readers see the old file or the new one, never half.

    `content` is the text, or a function that writes the file at the path it is given (a plot's savefig). A
    failed write (a full disk) leaves no temporary file and names the target: write() errors carry no filename.
    """
    path = Path(path)
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")  # the suffix tells savefig the format
    try:
        try:
            temp.write_text(content) if isinstance(content, str) else content(temp)
        except OSError as error:
            if error.filename is not None:
                raise
            raise OSError(error.errno, error.strerror or str(error), str(path)) from None
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class FreeSpace:
    """What the output needs against what its filesystem has free."""

    folder: Path  # the nearest existing folder of the output: where its bytes go
    free: int
    needed: int

    @property
    def fits(self) -> bool:
        return self.needed <= self.free

    def describe(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit: a merge is refused"
        return (
            f"disk: output {self.needed / 1e6:.1f} MB, free {self.free / 1e6:.1f} MB where it goes "
            f"({self.folder}): {verdict}"
        )


def free_space(folder: Path) -> int:
    """Bytes an unprivileged user may still write on the filesystem of `folder`."""
    return shutil.disk_usage(folder).free


def check_free_space(out: str | os.PathLike, needed: int, refuse: bool = True) -> FreeSpace:
    """The free space where `out` will be written against the `needed` bytes (the weights; side files are small),
    refused in one line, before anything is written, when it cannot fit (unless not `refuse`)."""
    folder = Path(os.path.abspath(out)).parent
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    space = FreeSpace(folder, free_space(folder), needed)
    if refuse and not space.fits:
        raise InputError(
            f"{out}: the output needs {needed / 1e6:.1f} MB and {folder} has {space.free / 1e6:.1f} MB "
            "free; nothing was written"
        )
    return space


def _side_file(folder: Path, name: str) -> Path | None:
    """`folder/name` if it is there, None if not; the one rule every side file read or copied from an input
    passes: one that is there but is a link out of the model folder (to a secret, say), a FIFO or a device is
    refused in one line naming it, never followed nor silently left out of the output."""
    path = Path(folder) / name
    return require_regular_inside(path, folder) if os.path.lexists(path) else None


def _copy_file(path: Path, out_folder: Path) -> None:
    """Contents and permission bits only: the output's files are plain files of its own."""
    shutil.copyfile(path, out_folder / path.name)
    shutil.copymode(path, out_folder / path.name)


def is_tokenizer_file(name: str) -> bool:
    """The files transformers' tokenizers save (tokenizer.json, its config, vocabularies, chat templates)."""
    return name in TOKENIZER_FILES or name.startswith("tokenizer") or name.startswith("chat_template.")


def copy_side_files(source_folder: Path, out_folder: Path, tokenizer: bool = True) -> list[str]:
    """Copy config, tokenizer and generation files (everything that is not weights) from a model folder; no
    tokenizer files unless `tokenizer` (mergekit's --no-copy-tokenizer).

    Every entry of the folder must be a regular file inside it (`check_folder_files`): a symlink that leaves it
    (to a secret, say) is refused, not copied. The input's model card (README.md) is not copied: the output gets its
    own (io/model_card.py).
    """
    copied = []
    source_folder = Path(source_folder)
    if not source_folder.exists():
        raise InputError(f"{source_folder}: no such folder to copy config and tokenizer files from")
    if not source_folder.is_dir():
        return copied  # a bare .safetensors file has no side files
    check_folder_files(source_folder)
    for item in sorted(source_folder.iterdir()):
        if (
            item.name.endswith(WEIGHT_SUFFIXES)
            or item.name in (INDEX_FILE, OUTPUT_MARKER, CARD_FILE)
            or item.name.startswith("adapter_")
            or (not tokenizer and is_tokenizer_file(item.name))
        ):
            continue
        if _side_file(source_folder, item.name):
            _copy_file(item, out_folder)
            copied.append(item.name)
    return copied


CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
TOKENIZER_FILES = (
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"


def has_chat_template(folder: Path) -> bool:
    """A chat template as its own file (transformers 5) or inside tokenizer_config.json (earlier versions); one there
    that is not a template (`chat_template: 5`) is refused, not carried into the output."""
    if any(_side_file(folder, name) for name in CHAT_TEMPLATE_FILES):
        return True
    config = _json_or_empty(folder, TOKENIZER_CONFIG)
    if "chat_template" in config:
        check_chat_template_text(config["chat_template"], f"{Path(folder) / TOKENIZER_CONFIG}: chat_template")
    return "chat_template" in config


def check_chat_template_text(template, where: str) -> None:
    """A chat template as transformers renders it: text that compiles as its Jinja (named templates: each of them),
    else one line naming where it came from; transformers itself fails only when the first prompt is built."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    if isinstance(template, list):  # transformers' list form: [{"name": ..., "template": ...}]
        template = {str(item.get("name")) if isinstance(item, dict) else "?": _template_of(item) for item in template}
    for name, text in template.items() if isinstance(template, dict) else [(None, template)]:
        label = where if name is None else f"{where} (template {name[:80]!r})"
        if not isinstance(text, str):
            raise InputError(f"{label}: expected a Jinja template (text), got {type(text).__name__} {str(text)[:40]}")
        try:
            _compile_jinja_template(text)
        except TemplateError as error:
            reason = " ".join(str(error).split())[:200]
            raise InputError(f"{label}: not a valid Jinja template ({reason})") from None


def _template_of(item):
    return item.get("template") if isinstance(item, dict) else item


def _json_or_empty(folder: Path, name: str) -> dict:
    """A side file's JSON object, or {} when it is missing or not a JSON object (one linking out is refused): these
    files only decide what to carry over, so a bad one is simply not used."""
    path = _side_file(folder, name)
    try:
        data = read_json(path) if path else {}
    except InputError:
        return {}
    return data if isinstance(data, dict) else {}


def keep_post_trained_files(donor: Path, candidates: list[Path], out_folder: Path) -> list[str]:
    """The chat template and generation config of a post-trained input, when the donor (usually the
    pre-trained base) has none: a base merged with its instruct model should still chat and stop at the
    instruct model's eos. The first candidate that has one gives it; a note says which. Only files that
    pass `_side_file` count, as for the donor's own side files: a link out of a folder is refused."""
    notes = []
    if not has_chat_template(donor):
        for candidate in candidates:
            if has_chat_template(candidate):
                _copy_chat_template(Path(candidate), out_folder)
                notes.append(f"chat template taken from {candidate} ({donor} has none)")
                break
    if not _side_file(donor, GENERATION_CONFIG):
        for candidate in candidates:
            if generation_config := _side_file(candidate, GENERATION_CONFIG):
                _copy_file(generation_config, out_folder)
                notes.append(f"{GENERATION_CONFIG} taken from {candidate} ({donor} has none)")
                break
    return notes


def _copy_chat_template(candidate: Path, out_folder: Path) -> None:
    files = [path for name in CHAT_TEMPLATE_FILES if (path := _side_file(candidate, name))]
    for file in files:
        _copy_file(file, out_folder)
    if files:
        return
    template = _json_or_empty(candidate, TOKENIZER_CONFIG)["chat_template"]
    tokenizer_config = out_folder / TOKENIZER_CONFIG
    if tokenizer_config.is_file():
        data = _json_or_empty(out_folder, TOKENIZER_CONFIG)
        data["chat_template"] = template
        tokenizer_config.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    else:
        (out_folder / CHAT_TEMPLATE_FILES[1]).write_text(json.dumps({"chat_template": template}, indent=2) + "\n")
