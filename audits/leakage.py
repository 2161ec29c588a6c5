"""Train/holdout leakage: does the evaluation holdout appear in the adapter's training data?

A holdout item counts as contaminated when it shares any word n-gram (default 13, the GPT-3 /
lm-eval decontamination length) with a training item, or equals one exactly after normalising case
and whitespace. Items shorter than n words can only match exactly. Only the holdout is indexed;
the training file is streamed, so memory is bounded by the holdout, not the training set.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mergekit_lite.audits.report import FAIL, PASS, WARN, CheckResult
from mergekit_lite.errors import InputError
from mergekit_lite.io.validation import decode_text, open_regular, require_regular

TEXT_FIELD = "text"
SHOWN_IDS = 10


@dataclass
class Contamination:
    ngram: int
    holdout_items: int
    contaminated_ids: list[str]
    exact_duplicate_ids: list[str]

    @property
    def share(self) -> float:
        return len(self.contaminated_ids) / self.holdout_items


def iter_items(path) -> Iterator[tuple[str, str]]:
    """(id, text) per item: `.jsonl` lines with a "text" field (id from "id", else the line number),
    any other file one item per non-empty line (id = line number)."""
    path = Path(path)
    jsonl = path.suffix == ".jsonl"
    with io.BufferedReader(open_regular(require_regular(path, "data file"))) as handle:
        for number, raw in enumerate(handle, start=1):
            line = decode_text(raw, f"{path}:{number}")
            if not line.strip():
                continue
            if not jsonl:
                yield str(number), line
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise InputError(f"{path}:{number}: not a JSON line") from None
            if not isinstance(record, dict) or not isinstance(record.get(TEXT_FIELD), str):
                raise InputError(f'{path}:{number}: no "{TEXT_FIELD}" string field')
            yield str(record.get("id", number)), record[TEXT_FIELD]


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def ngrams(normalized: str, n: int) -> set[tuple[str, ...]]:
    words = normalized.split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def find_contamination(train_data, holdout, n: int) -> Contamination:
    """Index the holdout's n-grams and texts, then stream the training data past them."""
    if n < 1:
        raise InputError(f"--ngram must be at least 1 (got {n})")
    holdout_ids, owners, texts = [], {}, {}
    for item_id, text in iter_items(holdout):
        holdout_ids.append(item_id)
        normalized = normalize(text)
        texts.setdefault(normalized, []).append(item_id)
        for gram in ngrams(normalized, n):
            owners.setdefault(gram, []).append(item_id)
    if not holdout_ids:
        raise InputError(f"{holdout}: no holdout items")
    overlapping, duplicates = set(), set()
    for _, text in iter_items(train_data):
        normalized = normalize(text)
        duplicates.update(texts.get(normalized, ()))
        for gram in ngrams(normalized, n):
            overlapping.update(owners.get(gram, ()))
    contaminated = overlapping | duplicates
    return Contamination(
        n, len(holdout_ids), [i for i in holdout_ids if i in contaminated], [i for i in holdout_ids if i in duplicates]
    )


def check_leakage(train_data, holdout, n: int, max_share: float) -> CheckResult:
    """Fail above `max_share` contaminated holdout items; any contamination at all is a warning."""
    found = find_contamination(train_data, holdout, n)
    count = len(found.contaminated_ids)
    shown = ", ".join(found.contaminated_ids[:SHOWN_IDS]) + (", ..." if count > SHOWN_IDS else "")
    summary = (
        f"{count} of {found.holdout_items} holdout items share a {n}-gram with the training data "
        f"({len(found.exact_duplicate_ids)} exact duplicates)"
    )
    if count == 0:
        status, detail = PASS, summary
    else:
        status = FAIL if found.share > max_share else WARN
        detail = f"{summary}: ids {shown}"
    measurements = {
        "contaminated_ids": found.contaminated_ids,
        "exact_duplicate_ids": found.exact_duplicate_ids,
        "holdout_items": found.holdout_items,
        "ngram": n,
    }
    return CheckResult("leakage", status, found.share, max_share, detail, measurements)
