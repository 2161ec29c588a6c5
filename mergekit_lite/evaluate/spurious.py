"""Spurious against genuine forgetting: is a forgotten sample lost knowledge, or lost task alignment?

Source: Zheng et al., "Spurious Forgetting in Continual Learning of Language Models" (ICLR 2025): much of a
post-trained model's drop on old tasks comes back with a few in-context examples or light re-alignment, so it
was the task's format that was lost, not the knowledge. Given post's lm-eval log under a re-alignment (few-shot
demonstrations, a chat template, a system prompt), each forgotten sample (pre right, post wrong; see
`forgetting`) is
    spurious  when the re-aligned post gets it right,
    genuine   when it still gets it wrong.

Chance correction [ours, after the paper's F_true in "Mapping Post-Training Forgetting", §2]: a forgotten
K-choice sample the re-aligned model does not know still comes back right by a lucky guess with chance 1/K.
If a share s of the forgotten samples is truly recovered and the rest is guessed, the observed share of
spurious ones is r = s + (1 - s) / K, so
    spurious_share_true = max((K r - 1) / (K - 1), 0)        genuine_share_true = 1 - spurious_share_true
(for free-form generation, K = inf: no correction). A group's shares are its tasks' corrected shares weighted by
their forgotten counts (the share of the group's forgotten samples that is spurious, chance removed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.outcomes import LoadedRun, SampleOutcomes

SPURIOUS, GENUINE = "spurious", "genuine"


@dataclass(frozen=True)
class SpuriousSplit:
    """The forgotten samples of a task (or group) split by the re-aligned log (counts: seed means)."""

    name: str
    forgotten: float
    spurious: float
    genuine: float
    spurious_share: float | None
    spurious_share_true: float | None
    genuine_share_true: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def recovered_share(observed: float, k: float) -> float:
    """The share truly recovered when `observed` of the forgotten samples came back right (see the module)."""
    if math.isinf(k):
        return observed
    return max((k * observed - 1) / (k - 1), 0.0)


def split(name: str, forgotten: float, spurious: float, k: float) -> SpuriousSplit:
    if not forgotten:
        return SpuriousSplit(name, 0, 0, 0, None, None, None)
    true = recovered_share(spurious / forgotten, k)
    return SpuriousSplit(name, forgotten, spurious, forgotten - spurious, spurious / forgotten, true, 1 - true)


def realigned_outcomes(realigned: LoadedRun, task: str, seed: str) -> SampleOutcomes | None:
    """The re-aligned log's outcomes for a task at `seed`, or at its only seed (a re-alignment run once)."""
    seeds = realigned.outcomes.get(task, {})
    if seed in seeds:
        return seeds[seed]
    return next(iter(seeds.values())) if len(seeds) == 1 else None


def forgotten_kinds(pre: SampleOutcomes, post: SampleOutcomes, realigned: SampleOutcomes, where: str) -> dict[str, str]:
    """Each forgotten sample's key -> spurious or genuine; a log missing one of them is of other docs: refused."""
    kinds = {}
    for key in sorted(pre.correct):
        if pre.correct[key] and not post.correct.get(key, True):
            if key not in realigned.correct:
                raise InputError(
                    f"{where}: task {pre.task!r} has no sample of a forgotten doc "
                    f"(doc_id {pre.doc_ids.get(key, key)}); the re-aligned log must score the same docs"
                )
            kinds[key] = SPURIOUS if realigned.correct[key] else GENUINE
    return kinds


@dataclass
class SpuriousMap:
    """Per task: its split (seed means) and each seed's forgotten keys' kinds; tasks the log lacks, listed."""

    tasks: dict[str, SpuriousSplit]
    kinds: dict[tuple[str, str], dict[str, str]]  # (task, seed) -> sample key -> kind
    doc_kinds: dict[tuple[str, str], dict[object, str]]  # (task, seed) -> lm-eval doc_id (else key) -> kind
    missing: list[str]
    k: dict[str, float]

    def group(self, name: str, tasks: Sequence[str]) -> SpuriousSplit:
        """Counts summed; shares from the tasks' chance-corrected shares weighted by their forgotten counts."""
        rows = [self.tasks[task] for task in tasks if task in self.tasks]
        forgotten = math.fsum(row.forgotten for row in rows)
        if not forgotten:
            return SpuriousSplit(name, 0, 0, 0, None, None, None)
        spurious = math.fsum(row.spurious for row in rows)
        true = math.fsum(row.forgotten * row.spurious_share_true for row in rows if row.forgotten) / forgotten
        return SpuriousSplit(name, forgotten, spurious, forgotten - spurious, spurious / forgotten, true, 1 - true)

    def kind(self, task: str, seed: str, doc) -> str | None:
        """The kind of a forgotten doc by its lm-eval doc_id (its sample key where the log has no doc_id)."""
        return self.doc_kinds.get((task, seed), {}).get(doc)


def spurious_map(
    pre: LoadedRun, post: LoadedRun, realigned: LoadedRun, compared: dict[str, dict[str, object]], where: str
) -> SpuriousMap:
    """Split every compared task's forgotten samples (`compared`: task -> seed -> its row, as the forgetting map
    compared them); k is pre's, as in the map."""
    common = [task for task in compared if task in realigned.outcomes]
    if not common:
        raise InputError(f"{where}: scores none of the compared tasks ({', '.join(sorted(compared))})")
    tasks, kinds, doc_kinds, ks = {}, {}, {}, {}
    for task in common:
        per_seed = []
        for seed in sorted(compared[task]):
            again = realigned_outcomes(realigned, task, seed)
            if again is None:
                raise InputError(f"{where}: task {task!r} has no run at seed {seed} nor a single seed to use")
            kinds[(task, seed)] = forgotten_kinds(pre.outcomes[task][seed], post.outcomes[task][seed], again, where)
            doc_ids = pre.outcomes[task][seed].doc_ids
            doc_kinds[(task, seed)] = {doc_ids.get(key, key): kind for key, kind in kinds[(task, seed)].items()}
            per_seed.append(list(kinds[(task, seed)].values()))
        k = pre.outcomes[task][sorted(compared[task])[0]].n_choices
        ks[task] = k
        forgotten = math.fsum(len(seed_kinds) for seed_kinds in per_seed) / len(per_seed)
        spurious = math.fsum(seed_kinds.count(SPURIOUS) for seed_kinds in per_seed) / len(per_seed)
        tasks[task] = split(task, forgotten, spurious, k)
    return SpuriousMap(tasks, kinds, doc_kinds, sorted(set(compared) - set(common)), ks)


SPLIT_COLUMNS = (
    "name",
    "forgotten",
    "spurious",
    "genuine",
    "spurious_share",
    "spurious_share_true",
    "genuine_share_true",
)


def format_split_table(rows: Sequence[SpuriousSplit], header: str = "task") -> str:
    """Pipe table of the splits: counts as integers (one decimal when seed means), shares to 3 decimals."""

    def cell(column: str, value) -> str:
        if value is None:
            return "-"
        if column in ("forgotten", "spurious", "genuine"):
            return str(int(value)) if value == int(value) else f"{value:.1f}"
        return f"{value:.3f}"

    lines = [[header, *SPLIT_COLUMNS[1:]]] + [
        [row.name, *(cell(column, getattr(row, column)) for column in SPLIT_COLUMNS[1:])] for row in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    render = [
        (
            "| "
            + " | ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))
            )
            + " |"
        )
        for line in lines
    ]
    rule = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([render[0], rule, *render[1:]])
