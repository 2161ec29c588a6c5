"""What the evaluation commands take besides their inputs and output files, declared once (the command line's
options are made from these models: cli/options.py): for `forgetting`, how samples are scored and grouped and the
settings of the example-forgetting matrix and its predictions (--matrix, --history); for `drift`, how far texts
are read and what non-finite weights do."""

from __future__ import annotations

from typing import Literal

from mergekit_lite.evaluate.forgetting import AGGREGATIONS
from mergekit_lite.evaluate.matrix import METHODS, STRATEGIES, VALUES
from mergekit_lite.evaluate.trajectory import REPLAY_FORMATS
from mergekit_lite.settings import Settings, setting


class ForgettingSettings(Settings):
    groups: tuple[str, ...] = setting(
        (),
        "A group of tasks, e.g. old=arc_easy,hellaswag, new=mmlu_* or an lm-eval group (old=mmlu). Repeatable.",
        flags=("--group",),
        metavar="NAME=TASK,...",
    )
    metrics: tuple[str, ...] = setting(
        (),
        "0/1 metric to score by, global (used where logged) or per task (default: the task's first).",
        flags=("--metric",),
        metavar="[TASK=]METRIC",
    )
    filters: tuple[str, ...] = setting(
        (),
        "lm-eval filter to score, e.g. flexible-extract or gsm8k=strict-match (default: the first logged).",
        flags=("--filter",),
        metavar="[TASK=]FILTER",
    )
    choices: tuple[str, ...] = setting(
        (),
        "Number of options of a generative multiple-choice task (default: from the docs; inf if none).",
        metavar="TASK=K",
    )
    aggregation: Literal[AGGREGATIONS] = setting(
        "paper", "Group values: paper = unweighted mean of the tasks' values; pooled = all samples pooled."
    )
    overall: bool = setting(
        False, "Add the paper's OVERALL row: the mean of the --group rows, each group weighing the same."
    )
    replay_format: Literal[REPLAY_FORMATS] | None = setting(
        None,
        f"--replay records: prompt/completion, or chat messages (user, assistant).  [default: {REPLAY_FORMATS[0]}]",
    )
    alerts: tuple[str, ...] = setting(
        (),
        "Exit 3 when a checkpoint's group value crosses VALUE (> or <), e.g. old:F_true>0.1. Repeatable.",
        flags=("--alert",),
        metavar="GROUP:METRIC>VALUE",
    )
    realigned: str | None = setting(
        None,
        "POST's lm-eval samples under a re-alignment (few-shot, chat template): forgotten docs it gets "
        "right are spurious, the rest genuine.",
        metavar="LOG",
        path="existing",
    )
    replay_spurious: bool = setting(
        False,
        "With --realigned: keep spurious docs in --replay (left out by default: they need format, not knowledge).",
    )


class MatrixSettings(Settings):
    matrix_dir: str | None = setting(
        None,
        "PRE POST_1 ... POST_M are independent fine-tunes of PRE: write their forgetting matrix, "
        "R^2 by rank and the completion table to DIR (matrix.json, matrix.npz, matrix.png, rank.png).",
        flags=("--matrix",),
        metavar="DIR",
        path="folder",
    )
    history_dir: str | None = setting(
        None,
        "PRE NEW, NEW's log covering some docs: predict the others from a --matrix DIR.",
        flags=("--history",),
        metavar="DIR",
        path="existing-folder",
    )
    value: Literal[VALUES] = setting(
        "outcome",
        "Matrix entries: outcome = 1 where pre was right and the fine-tune wrong; logprob = the drop "
        "of the gold answer's log-likelihood.",
    )
    known: tuple[int, ...] = setting(
        (),
        "Docs observed of each held-out fine-tune in the completion table (default 30). Repeatable.",
        metavar="K",
    )
    predictor: Literal[METHODS] | None = setting(
        None, "Completion method for --history (default: the best of the history's table)."
    )
    # numpy's generators take seeds >= 0 only (cli/types.py SEED)
    matrix_seed: int = setting(
        0, "Seed of the observed docs (--matrix) and of the replay draw (--history).", ge=0, le=2**63 - 1
    )
    replay_budget: int | None = setting(
        None, "With --history: write N distinct docs to --replay, chosen by --replay-strategy.", metavar="N"
    )
    replay_temperature: float = setting(0.1, "T of the replay weights softmax(score / T).")
    replay_strategy: Literal[STRATEGIES] = setting(
        "sample", "sample: drawn by weight; top: highest scores; random: uniform (the baseline)."
    )


class DriftSettings(Settings):
    max_length: int = setting(256, "Tokens kept per text for --texts.", ge=1)
    # non-finite weights: refused unless asked for (as merge's flag of the same name)
    allow_nonfinite: bool = setting(
        False,
        "Report the drift of tensors holding NaN/Inf (and of their layers and modules) as null instead of stopping.",
    )
