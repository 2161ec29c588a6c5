"""`--pre-results DIR` / `--post-results DIR`: pre or post scored from lm-eval `--log_samples` outputs the user already
has (results_*.json and samples_<task>_*.jsonl, read as `mergekit-lite forgetting` reads them), instead of being
evaluated again. [ours]

A folder is taken only when it scored what this sweep would score: every task of the sweep (an lm-eval group's
leaf tasks), on the same docs (the doc hashes lm-eval gives the docs this sweep's --limit takes), under the same
metrics and filters (the task config's metric_list and filter_list), few-shot count, chat template, few-shot turns,
system instruction and generation arguments, each as lm-eval's results_*.json records them. Anything else is
refused in one line naming the difference, before the run folder is made. The outcomes are scored by the code that
scores the sweep's own evaluations (`scoring.score_task`), and saved as the endpoint's point file, so the rest of the
sweep, and a rerun, never tell them apart from an evaluation.
"""

from __future__ import annotations

import hashlib
import json

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.lm_harness import TaskScore, _leaf_tasks, _silenced_stderr, task_index
from mergekit_lite.evaluate.outcomes import find_samples_files, read_samples_file
from mergekit_lite.evaluate.records import logged_names
from mergekit_lite.io.validation import read_json
from mergekit_lite.sweep.scoring import TaskRun, check_groups_disjoint, score_task
from mergekit_lite.sweep.settings import SweepSettings

FLAGS = {"pre": "--pre-results", "post": "--post-results"}


def sweep_tasks(settings: SweepSettings) -> dict[str, tuple[str, object]]:
    """Every leaf task the sweep scores: name -> (group, lm-eval's task object, as the sweep's evaluator loads it)."""
    from lm_eval.tasks import get_task_dict

    tasks = {}
    for group, names in (("old", settings.old_tasks), ("new", settings.new_tasks)):
        with _silenced_stderr():
            leaves = _leaf_tasks(get_task_dict(names, task_index(names, settings.include_path)))
        tasks.update({name: (group, task) for name, task in leaves.items()})
    return tasks


def expected_fewshot(settings: SweepSettings, task) -> int:
    """num_fewshot as lm-eval's simple_evaluate sets it: the sweep's, unless the task fixes 0; else the task's own, or
    0."""
    own = task.get_config("num_fewshot")
    if settings.lm_eval.num_fewshot is not None:
        return 0 if own == 0 else settings.lm_eval.num_fewshot
    return own or 0


def expected_generation(settings: SweepSettings, task) -> dict | None:
    """generation_kwargs of a generate_until task as simple_evaluate sets them: the task's, updated with --gen-kwargs."""
    if task.get_config("output_type") != "generate_until":
        return None
    from lm_eval.utils import simple_parse_args_string

    given = simple_parse_args_string(settings.lm_eval.gen_kwargs) if settings.lm_eval.gen_kwargs else {}
    return _plain({**(task.get_config("generation_kwargs") or {}), **given})


def _plain(value):
    """A config value as a results file holds it (JSON, lm-eval's handle_non_serializable for the rest)."""
    return json.loads(json.dumps(value, default=str))


def expected_doc_hashes(settings: SweepSettings, task) -> set[str]:
    """The doc_hash lm-eval logs for each doc the sweep's --limit takes (the first N docs; a share rounded up)."""
    from lm_eval.evaluator_utils import get_sample_size
    from lm_eval.utils import handle_non_serializable, hash_string

    docs = list(task.eval_docs)
    count = get_sample_size(task, settings.limit)
    return {
        hash_string(json.dumps(doc, indent=2, default=handle_non_serializable, ensure_ascii=False))
        for doc in docs[: len(docs) if count is None else count]
    }


def _names(entries, key: str) -> list:
    return [entry.get(key) if isinstance(entry, dict) else entry for entry in entries or []]


def expected_template(settings: SweepSettings) -> str | None:
    """The chat template text lm-eval applies in this sweep (its tokenizer's, the named one of several), or None."""
    if not settings.lm_eval.apply_chat_template:
        return None
    from mergekit_lite.merge.recall import find_tokenizer_dir
    from mergekit_lite.sweep.evaluator import evaluation_tokenizer

    template = evaluation_tokenizer(settings, find_tokenizer_dir([settings.pre, settings.post], 0)).chat_template
    if isinstance(template, dict):
        name = settings.lm_eval.apply_chat_template
        template = template.get(name if isinstance(name, str) else "default")
    return template if isinstance(template, str) else None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def differences(settings: SweepSettings, task, results: dict, config: dict, template: str | None = None) -> list[str]:
    """How one task of a results file differs from what this sweep scores: metrics, filters, prompt settings
    (`template`: the chat template text this sweep applies)."""
    lm_eval, found = settings.lm_eval, []
    wanted_metrics = _names(task.get_config("metric_list"), "metric")
    if wanted_metrics and _names(config.get("metric_list"), "metric") != wanted_metrics:
        found.append(f"metrics {_names(config.get('metric_list'), 'metric')} (this sweep: {wanted_metrics})")
    wanted_filters = _names(_plain(task.get_config("filter_list")), "name")
    if _names(config.get("filter_list"), "name") != wanted_filters:
        found.append(f"filters {_names(config.get('filter_list'), 'name')} (this sweep: {wanted_filters})")
    shots = expected_fewshot(settings, task)
    if config.get("num_fewshot", (results.get("n-shot") or {}).get(task.config.task)) != shots:
        found.append(f"num_fewshot {config.get('num_fewshot')!r} (this sweep: {shots})")
    templated = bool(results.get("chat_template"))
    if templated != bool(lm_eval.apply_chat_template):
        found.append(f"apply_chat_template {templated} (this sweep: {bool(lm_eval.apply_chat_template)})")
    elif templated:
        text = results["chat_template"]
        if template and isinstance(text, str) and text != template:
            found.append(f"chat template sha256 {_digest(text)} (this sweep's: {_digest(template)})")
    if templated and lm_eval.apply_chat_template and bool(results.get("fewshot_as_multiturn")) != lm_eval.multiturn:
        found.append(
            f"fewshot_as_multiturn {bool(results.get('fewshot_as_multiturn'))} (this sweep: {lm_eval.multiturn})"
        )
    if (results.get("system_instruction") or None) != (lm_eval.system_instruction or None):
        found.append(
            f"system_instruction {results.get('system_instruction')!r} (this sweep: {lm_eval.system_instruction!r})"
        )
    generation = expected_generation(settings, task)
    if generation is not None and _plain(config.get("generation_kwargs")) != generation:
        found.append(f"generation_kwargs {config.get('generation_kwargs')} (this sweep: {generation})")
    return found


def reused_runs(
    settings: SweepSettings, label: str, folder: str, tasks: dict | None = None, template: str | None = None
) -> list[TaskRun]:
    """`label`'s (pre or post) outcomes read from `folder`, checked against this sweep and scored as it scores its
    own evaluations; a folder that scored anything else is refused in one line naming the difference."""
    flag = FLAGS[label]
    tasks = sweep_tasks(settings) if tasks is None else tasks
    files = {}
    for entry in find_samples_files(folder):
        if entry.task in tasks and entry.task in files:
            raise InputError(
                f"{flag} {folder}: holds several lm-eval runs of task {entry.task!r} (seeds {files[entry.task].seed} "
                f"and {entry.seed}); give a folder of one run"
            )
        files[entry.task] = entry
    missing = [name for name in tasks if name not in files]
    if missing:
        raise InputError(
            f"{flag} {folder}: no samples of task(s) {', '.join(missing)} (this sweep scores {', '.join(tasks)}); "
            "run lm-eval with --log_samples on every task of the sweep"
        )
    scoring, read = settings.scoring(), {}
    for name, (group, task) in tasks.items():
        entry = files[name]
        results_path = entry.path.with_name(f"results_{entry.stamp}.json")
        if not entry.stamp or not results_path.is_file():
            raise InputError(
                f"{flag} {folder}: task {name!r} has no results_*.json beside its samples: the prompt settings it "
                "was scored with cannot be checked"
            )
        results = read_json(results_path)
        found = differences(settings, task, results, entry.config or {}, template)
        samples, _ = read_samples_file(entry.path)
        hashes = {str(sample.get("doc_hash")) for sample in samples if isinstance(sample, dict)}
        wanted = expected_doc_hashes(settings, task)
        if hashes != wanted:
            found.append(
                f"docs: {len(hashes - wanted)} not scored by this sweep and {len(wanted - hashes)} of its "
                f"{len(wanted)} missing (another --limit, or other docs)"
            )
        if found:
            raise InputError(f"{flag} {folder}: task {name!r} was scored differently: {'; '.join(found)}")
        read[name] = (group, TaskScore(name, samples, entry.config or {}))
    logged = [logged_names(score.samples, score.config) for _, score in read.values()]
    metrics, filters = (set().union(*(names[position] for names in logged)) for position in (0, 1))
    scoring.check_logged(metrics, filters, f"{flag} {folder}")  # a --metric no task logs: one line, not a skip each
    runs = [score_task(name, group, score, scoring) for name, (group, score) in read.items()]
    check_groups_disjoint(runs)
    return runs


def reused_endpoints(settings: SweepSettings) -> dict[str, list[TaskRun]]:
    """pre's and post's outcomes from --pre-results / --post-results (those given), checked before any work."""
    given = {label: folder for label, folder in (("pre", settings.pre_results), ("post", settings.post_results))}
    given = {label: folder for label, folder in given.items() if folder}
    if not given:
        return {}
    tasks, template = sweep_tasks(settings), expected_template(settings)
    return {label: reused_runs(settings, label, folder, tasks, template) for label, folder in given.items()}
