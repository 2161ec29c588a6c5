"""One lm-eval per-sample record read as lm-eval reads it: its kind (loglikelihood or generation), its number
of choices k, the metrics and filters it logged, and what it says as text (prompt, gold answer, the model's
answer, a replay completion). Records come from `--log_samples` files or lm-eval's in-process results; a field a
record lacks gives None, never a guess. evaluate/outcomes.py turns a task's records into 0/1 outcomes.
"""

from __future__ import annotations

import ast
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mergekit_lite.errors import InputError


@dataclass(frozen=True)
class SampleText:
    """One lm-eval record as text [ours]: the prompt (the context of its requests), the gold answer (the
    correct option's continuation for multiple choice, the target for generation), the model's answer (the
    option its metric chose, or its filtered generation) and the completion a replay set trains on. None
    where the log does not say (several contexts per doc, a target that names no option, ...)."""

    prompt: str | None
    gold: str | None
    answer: str | None
    completion: str | None
    doc_hash: str | None = None
    # multiple choice: the log-likelihood lm-eval logged for the gold option (a score, not text: not compared)
    gold_loglikelihood: float | None = field(default=None, compare=False)


def is_generative(sample: dict) -> bool:
    """generate_until requests carry (context, generation kwargs); loglikelihood ones (context, continuation)."""
    arguments = sample.get("arguments")
    first = next(iter(arguments.values()), None) if isinstance(arguments, dict) else (arguments or [None])[0]
    second = (
        first.get("arg_1")
        if isinstance(first, dict)
        else first[1]
        if isinstance(first, (list, tuple)) and len(first) > 1
        else None
    )
    return isinstance(second, dict)


def _doc_choices(sample: dict, config: dict | None) -> list | None:
    """The options a generative multiple-choice doc offers, read from the task's doc_to_choice as lm-eval
    reads it (`ConfigurableTask.doc_to_choice`: a list, a mapping's values, a doc field, or a Jinja template
    giving a list, "{{choices.text}}" included); None for free-form generation (no doc_to_choice), even if
    docs list options, and where the template gives no list."""
    doc = sample.get("doc") if isinstance(sample.get("doc"), dict) else {}
    spec = (config or {}).get("doc_to_choice")
    if isinstance(spec, (list, dict)):
        return list(spec.values()) if isinstance(spec, dict) else spec
    if isinstance(spec, str):
        choices = doc[spec] if spec in doc else _rendered_literal(spec, doc)
        return choices if isinstance(choices, list) else None
    return None


@functools.cache
def _template(text: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment().from_string(text)


def _rendered_literal(template: str, doc: dict) -> Any:
    """A template rendered against the doc and read as a Python literal, as lm-eval does; in Jinja's sandbox,
    because a results file is an input that may run nothing. None where it does not render or parse."""
    try:
        return ast.literal_eval(_template(template).render(**doc))
    except Exception:  # any template or literal error: the doc names no options, so k stays inf
        return None


def sample_choices(sample: dict, config: dict | None, label: str) -> float:
    """k of one record: one loglikelihood request per choice for multiple choice (half of them when
    acc_mutual_info adds unconditional ones); the doc's choices for generative multiple choice; inf for
    free-form generation and single-continuation loglikelihood tasks (lambada)."""
    if is_generative(sample):
        choices = len(_doc_choices(sample, config) or ())
        return float(choices) if choices > 1 else math.inf
    arguments = sample.get("arguments")
    if not isinstance(arguments, (list, dict)):
        raise InputError(f"{label}: 'arguments' missing, cannot count the choices")
    choices = len(arguments) // 2 if "acc_mutual_info" in sample else len(arguments)
    return math.inf if choices < 2 else float(choices)


# The keys of an lm-eval per-sample record that are not a metric's value (lm_eval/evaluator.py, `example`, v0.4.0
# to v0.4.13): logs before v0.4.7 list no `metrics` and no `filter`, so there every other key is a metric.
RECORD_FIELDS = frozenset(
    {
        "doc_id",
        "doc",
        "target",
        "arguments",
        "resps",
        "filtered_resps",
        "filter",
        "metrics",
        "doc_hash",
        "prompt_hash",
        "target_hash",
    }
)


def _listed_metrics(config: dict | None) -> list:
    """The metric names of the task's metric_list, in its order."""
    return [entry.get("metric") for entry in (config or {}).get("metric_list") or [] if isinstance(entry, dict)]


def logged_metrics(sample: dict, config: dict | None = None) -> list[str]:
    """The metric names lm-eval logged for one record: its `metrics` list (lm-eval >= 0.4.7); older logs name
    none, so the task's metric_list entries the record holds, else every key that is not a record field."""
    if isinstance(sample.get("metrics"), list):
        return [str(name) for name in sample["metrics"]]
    listed = [name for name in _listed_metrics(config) if isinstance(name, str) and name in sample]
    return listed or [name for name in sample if name not in RECORD_FIELDS]


def record_filters(samples: Sequence[dict], config: dict | None, label: str) -> list[str | None]:
    """The filter each record was scored under. lm-eval >= 0.4.7 names it in the record. Before, it wrote one
    record per doc and filter, filter after filter in the order of the task's filter_list ("none" without one;
    `evaluate`: for each filter key, every doc), so a doc's i-th record is the i-th filter of the task config
    in results_*.json; None where one record per doc and no config names it."""
    if any("filter" in sample for sample in samples):
        return [sample.get("filter") for sample in samples]
    seen: dict = {}
    positions = []
    for sample in samples:
        doc = str(sample.get("doc_id", sample.get("doc_hash")))
        positions.append(seen.get(doc, 0))
        seen[doc] = positions[-1] + 1
    names = _filter_names(config)
    per_doc = max(seen.values())
    if names is None and per_doc == 1:
        return [None] * len(samples)
    if names is None or len(names) != per_doc:
        told = "names no filters" if names is None else f"names {len(names)} filter(s)"
        raise InputError(
            f"{label}: records name no filter and each doc has up to {per_doc} (lm-eval before 0.4.7 "
            f"logs one per filter), but the task config in results_*.json {told}"
        )
    return [names[position] for position in positions]


def _filter_names(config: dict | None) -> list[str] | None:
    """The task's filter names in lm-eval's order; ["none"] without a filter_list; None without a config."""
    if config is None:
        return None
    filters = config.get("filter_list")
    if not isinstance(filters, list):
        return ["none"]
    return [str(entry.get("name")) if isinstance(entry, dict) else str(entry) for entry in filters]


def logged_names(
    samples: Sequence, config: dict | None = None, label: str = "lm-eval records"
) -> tuple[set[str], set[str]]:
    """The metrics and the filters lm-eval logged across a task's records: what a global --metric or --filter
    may name (`Scoring.check_logged`)."""
    records = [sample for sample in samples if isinstance(sample, dict)]
    filters = record_filters(records, config, label) if records else []
    metrics = {name for sample in records for name in logged_metrics(sample, config)}
    return metrics, {str(name) for name in filters}


def default_metric(logged: list[str], config: dict | None) -> str | None:
    """The first metric of the task's metric_list that was logged, else the first logged one."""
    return next((name for name in _listed_metrics(config) if name in logged), logged[0] if logged else None)


def binary_outcome(value) -> bool | None:
    """0/1 (or true/false) as a bool; anything else (a probability, a BLEU score) is None."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    return None


# --- what each sample said, as text [ours] ------------------------------------------------------------

# How lm-eval's multiple-choice metrics pick an option (`ConfigurableTask.process_results`): the argmax of the
# loglikelihoods, divided by the option's length in characters (acc_norm) or UTF-8 bytes (acc_bytes), or
# minus the option's unconditional loglikelihood (acc_mutual_info). Any other metric: the acc rule.
ANSWER_RULES = {
    "acc": "the option of highest loglikelihood (acc)",
    "acc_norm": "the option of highest loglikelihood per character (acc_norm)",
    "acc_bytes": "the option of highest loglikelihood per UTF-8 byte (acc_bytes)",
    "acc_mutual_info": "the option of highest loglikelihood minus its unconditional one (acc_mutual_info)",
}


def _requests(sample: dict) -> list[list]:
    """The arguments of each request, in order: lm-eval's {"gen_args_0": {"arg_0": ...}} or older lists."""
    arguments = sample.get("arguments")
    if isinstance(arguments, dict):
        requests = [
            arguments[name]
            for name in sorted(
                arguments, key=lambda name: int(name.rpartition("_")[2]) if name.rpartition("_")[2].isdigit() else 0
            )
        ]
        return [
            [request[name] for name in sorted(request)] if isinstance(request, dict) else [] for request in requests
        ]
    return [list(request) if isinstance(request, (list, tuple)) else [] for request in arguments or []]


def _number(value) -> float | None:
    """A logged loglikelihood (lm-eval writes them as strings) as a float, else None."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


def _loglikelihoods(sample: dict, count: int) -> list[float] | None:
    """The (filtered) loglikelihood of each of the first `count` requests: [ll, is_greedy] pairs, or bare lls."""
    responses = sample.get("filtered_resps")
    if not isinstance(responses, list) or len(responses) < count:
        return None
    values = [
        _number(response[0] if isinstance(response, (list, tuple)) and response else response)
        for response in responses[:count]
    ]
    return None if None in values else values


def _target_text(target) -> str | None:
    """doc_to_target(doc) as text: lm-eval's files log str() of it, its in-process records (the sweep's) the
    value itself. A list of several targets (multiple_target) has no single gold answer (None); a one-element
    list is its element."""
    if isinstance(target, list):
        return _target_text(target[0]) if len(target) == 1 else None
    if isinstance(target, int) and not isinstance(target, bool):
        return str(target)
    if not isinstance(target, str):
        return None
    text = target.strip()
    if text.startswith("[") and text.endswith("]"):
        try:
            listed = ast.literal_eval(text)
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            return target
        if isinstance(listed, list):
            return str(listed[0]) if len(listed) == 1 else None
    return target


def _index(text: str) -> int | None:
    """A target that is an option's index (digits, as lm-eval's doc_to_target reads them), else None."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) < 10 else None


def _option_index(target, options: list[str], delimiter: str) -> int | None:
    """The gold option's index from the logged target: an index, as lm-eval reads a digit target of a
    multiple-choice task, or the text of exactly one option."""
    text = _target_text(target)
    if text is None:
        return None
    if _index(text) is not None:
        return _index(text) if _index(text) < len(options) else None
    matches = [i for i, option in enumerate(options) if option in (text, delimiter + text)]
    return matches[0] if len(matches) == 1 else None


def _chosen_option(
    lls: list[float], options: list[str], unconditional: list[float] | None, metric: str, delimiter: str
) -> int:
    """The option `metric` picks, as lm-eval's process_results does (ANSWER_RULES); the first on a tie, as
    numpy's argmax."""
    choices = [option[len(delimiter) :] if delimiter and option.startswith(delimiter) else option for option in options]
    if metric == "acc_norm":
        scores = [ll / max(len(choice), 1) for ll, choice in zip(lls, choices, strict=True)]
    elif metric == "acc_bytes":
        scores = [ll / max(len(choice.encode()), 1) for ll, choice in zip(lls, choices, strict=True)]
    elif metric == "acc_mutual_info" and unconditional is not None:
        scores = [ll - free for ll, free in zip(lls, unconditional, strict=True)]
    else:
        scores = lls
    return max(range(len(scores)), key=scores.__getitem__)


def _generation(sample: dict) -> str | None:
    """The filtered generation (the first one when lm-eval kept several repeats)."""
    responses = sample.get("filtered_resps")
    response = responses[0] if isinstance(responses, list) and responses else responses
    while isinstance(response, (list, tuple)) and response:
        response = response[0]
    return response if isinstance(response, str) else None


def sample_text(sample: dict, metric: str, config: dict | None) -> SampleText:
    """What one record says as text, never failing: a part the log does not give is None.

    The prompt is the requests' shared context. Multiple choice: the gold answer is the continuation lm-eval
    scored for the target's option, the model's answer the option its metric picks, and the replay completion
    the gold continuation itself (target_delimiter included, so prompt + completion is the text lm-eval
    scored). Generation: the gold answer is the target (the option it indexes when the task has a
    doc_to_choice, as lm-eval's process_results maps it), the answer the filtered generation, and the
    completion target_delimiter + target, the way lm-eval joins a few-shot example's answer to its question."""
    delimiter = (config or {}).get("target_delimiter", " ")
    delimiter = delimiter if isinstance(delimiter, str) else " "
    doc_hash = str(sample["doc_hash"]) if sample.get("doc_hash") else None
    requests = _requests(sample)
    if not requests or not all(len(request) >= 2 for request in requests):
        return SampleText(None, None, None, None, doc_hash)
    if is_generative(sample):
        prompt = requests[0][0] if isinstance(requests[0][0], str) else None
        gold = _target_text(sample.get("target"))
        choices = _doc_choices(sample, config)
        if choices is not None and gold is not None and _index(gold) is not None:
            gold = str(choices[_index(gold)]) if _index(gold) < len(choices) else None
        completion = delimiter + gold if gold is not None and prompt is not None else None
        return SampleText(prompt, gold, _generation(sample), completion, doc_hash)
    count = len(requests) // 2 if "acc_mutual_info" in sample else len(requests)
    contexts, options = [request[0] for request in requests[:count]], [request[1] for request in requests[:count]]
    if not all(isinstance(text, str) for text in contexts + options) or len(set(contexts)) != 1:
        return SampleText(None, None, None, None, doc_hash)  # several contexts (multiple_input): no one prompt
    index = _option_index(sample.get("target"), options, delimiter)
    gold = options[index] if index is not None else None
    lls = _loglikelihoods(sample, len(requests))
    answer = None
    if lls is not None and count > 1:
        answer = options[
            _chosen_option(lls[:count], options, lls[count:] if len(lls) > count else None, metric, delimiter)
        ]
    gold_ll = lls[index] if lls is not None and index is not None else None
    return SampleText(contexts[0], gold, answer, gold, doc_hash, gold_ll)


def answer_rule(sample: dict, metric: str, filter_: str | None) -> str:
    """How `sample_text` read the model's answer for this task, said in the sample list."""
    if is_generative(sample):
        return f"the generation under filter {filter_!r}" if filter_ not in (None, "none") else "the generation"
    return ANSWER_RULES.get(metric, ANSWER_RULES["acc"])
