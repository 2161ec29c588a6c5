"""A forgetting matrix on disk (matrix.json + matrix.npz), its plots (matrix.png, rank.png), and the per-doc rows
a prediction writes (--samples, --replay) [ours]."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.matrix import VALUES, CompletionTable, Docs, ForgettingMatrix, Prediction, history_of
from mergekit_lite.evaluate.outcomes import SampleOutcomes
from mergekit_lite.io.validation import open_regular

ARRAYS = ("z", "tasks", "keys", "doc_ids", "pre_correct", "rows")


def summary(matrix: ForgettingMatrix, r2: list[float], tables: list[CompletionTable]) -> dict:
    """matrix.json: the rows, the docs per task, the value kind, R^2 by rank (first entry: rank 1), the
    completion tables."""
    tasks, counts = np.unique(matrix.docs.tasks, return_counts=True)
    return {
        "rows": matrix.rows,
        "value": matrix.value,
        "docs": {
            "count": len(matrix.docs),
            "forgettable": int(matrix.forgettable.sum()),
            "per_task": dict(zip(map(str, tasks), map(int, counts), strict=True)),
        },
        "mean": float(matrix.z.mean()),
        "r2_by_rank": r2,
        "completion": [table.to_dict() for table in tables],
    }


def write_matrix(folder: Path, matrix: ForgettingMatrix, payload: dict) -> None:
    """matrix.json, matrix.npz (Z in float32 with its docs), matrix.png and rank.png into `folder` (a folder
    being written whole or not at all)."""
    (folder / "matrix.json").write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
    docs = matrix.docs
    with open(folder / "matrix.npz", "wb") as handle:
        np.savez_compressed(
            handle,
            z=matrix.z,
            tasks=docs.tasks,
            keys=docs.keys,
            doc_ids=docs.doc_ids,
            pre_correct=docs.pre_correct,
            rows=np.array(matrix.rows, dtype=str),
        )
    plot_matrix(matrix, folder / "matrix.png")
    plot_rank(payload["r2_by_rank"], folder / "rank.png")


def read_history(folder) -> tuple[ForgettingMatrix, dict]:
    """A folder `--matrix` wrote, checked: both files there, arrays of matching shapes, a known value kind."""
    folder = Path(folder)
    paths = {name: folder / name for name in ("matrix.json", "matrix.npz")}
    for path in paths.values():
        if not path.is_file():
            raise InputError(f"--history {folder}: no {path.name} (give a folder written by forgetting --matrix)")
    try:
        with open_regular(paths["matrix.json"]) as handle:
            payload = json.loads(handle.read())
        with open_regular(paths["matrix.npz"]) as handle, np.load(handle, allow_pickle=False) as arrays:
            loaded = {name: arrays[name] for name in ARRAYS}
    except (ValueError, KeyError, OSError, zipfile.BadZipFile) as error:
        raise InputError(f"--history {folder}: not a forgetting matrix ({type(error).__name__}: {error})") from None
    z = loaded["z"]
    if (
        not isinstance(payload, dict)
        or payload.get("value") not in VALUES
        or z.ndim != 2
        or z.dtype != np.float32
        or any(loaded[name].shape != (z.shape[1],) for name in ("tasks", "keys", "doc_ids", "pre_correct"))
        or loaded["rows"].shape != (z.shape[0],)
        or not np.isfinite(z).all()
    ):
        raise InputError(f"--history {folder}: matrix.json and matrix.npz do not describe one forgetting matrix")
    docs = Docs(loaded["tasks"], loaded["keys"], loaded["doc_ids"], loaded["pre_correct"].astype(bool))
    return ForgettingMatrix(z, docs, [str(row) for row in loaded["rows"]], payload["value"]), payload


def prediction_rows(
    matrix: ForgettingMatrix, prediction: Prediction, pre: dict[str, SampleOutcomes], seeds: dict[str, str]
) -> list[dict]:
    """One row per doc of the history: task, doc, PRE's score, the prompt and gold answer; observed docs carry
    what the log says, the others `predicted: true`; each p_forgotten (0/1 values) or predicted_drop."""
    rows = []
    score_name = "p_forgotten" if matrix.binary else "logprob_drop"
    for index, (task, key) in enumerate(zip(matrix.docs.tasks, matrix.docs.keys, strict=True)):
        text = pre[task].texts.get(key)
        rows.append(
            {
                "task": str(task),
                "doc_id": pre[task].doc_ids.get(key),
                "doc_hash": text.doc_hash if text else None,
                "seed": seeds[task],
                "pre_correct": bool(matrix.docs.pre_correct[index]),
                "predicted": not bool(prediction.observed[index]),
                score_name: float(prediction.scores[index]),
                "prompt": text.prompt if text else None,
                "gold": text.gold if text else None,
                "completion": text.completion if text else None,
            }
        )
    return rows


# --- plots ---------------------------------------------------------------------------------------------


def structure_order(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows and docs ordered by their position on the leading factor of the column-centred matrix, so blocks of
    fine-tunes that forget the same docs show as blocks."""
    history = history_of(z, rank=1)
    if not len(history.factors):
        return np.arange(z.shape[0]), np.arange(z.shape[1])
    loadings = (z - history.means) @ history.factors[0]
    return np.argsort(loadings, kind="stable"), np.lexsort((-z.mean(axis=0), history.factors[0]))


def plot_matrix(matrix: ForgettingMatrix, path) -> None:
    """Fine-tunes x docs heat map (matplotlib's Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows, docs = structure_order(matrix.z)
    figure = Figure(figsize=(10, 2 + 0.18 * len(rows)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    shown = matrix.z[rows][:, docs]
    if matrix.binary:
        image = axes.imshow(shown, vmin=0, vmax=1, cmap="Reds", aspect="auto", interpolation="nearest")
    else:
        limit = float(np.abs(shown).max()) or 1.0
        image = axes.imshow(shown, vmin=-limit, vmax=limit, cmap="coolwarm", aspect="auto", interpolation="nearest")
    axes.set_yticks(range(len(rows)), [Path(matrix.rows[row]).name[-24:] for row in rows], fontsize=6)
    axes.set_xlabel(f"{len(docs)} docs (ordered by the leading factor)")
    axes.set_title(
        "forgotten (pre right, fine-tune wrong)" if matrix.binary else "gold log-likelihood drop", fontsize=9
    )
    figure.colorbar(image, ax=axes, shrink=0.8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_rank(r2: list[float], path) -> None:
    """R^2 of the rank-r truncated SVD against r."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(4.5, 3.2))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    ranks = range(1, len(r2) + 1)
    axes.plot(ranks, r2, marker="o")
    axes.set_ylim(min(0.0, min(r2, default=0.0)), 1.02)
    axes.set_xlabel("rank r")
    axes.set_ylabel("R^2 of the rank-r SVD")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
