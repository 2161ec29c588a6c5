"""The sweep itself: evaluate pre, post and the alphas (the full grid, a golden-section search or probe
mode; here one point after another, or on Ray actors), resuming saved points under the run folder's lock,
then build the result, write the report and, with --save-best, merge the pick; several methods in one run
folder (`run_comparison`), pre and post evaluated once for all of them."""

from __future__ import annotations

import os
from contextlib import ExitStack, closing
from dataclasses import replace
from pathlib import Path

from mergekit_lite import interrupts
from mergekit_lite.devices import usable_device
from mergekit_lite.errors import InputError
from mergekit_lite.io.outputs import (
    OUTPUT_MARKER,
    check_output_folder,
    check_output_path,
    check_run_folder,
    prepare_run_folder,
)
from mergekit_lite.merge.schema import config_from_dict
from mergekit_lite.sweep import grid
from mergekit_lite.sweep.adaptive import golden_search, run_probes
from mergekit_lite.sweep.budget import run_budget
from mergekit_lite.sweep.compare import (
    COMPARISON_HTML,
    COMPARISON_JSON,
    COMPARISON_MD,
    METHOD_FIELDS,
    PARETO_PLOT,
    Comparison,
    compare,
    write_comparison,
)
from mergekit_lite.sweep.evaluator import MERGE_TEMP, PointEvaluator, evaluate_point, evaluation_tokenizer
from mergekit_lite.sweep.models import check_pair
from mergekit_lite.sweep.result import SweepResult, build_result
from mergekit_lite.sweep.scoring import TaskRun
from mergekit_lite.sweep.settings import SweepSettings
from mergekit_lite.sweep.store import (
    LOCK_FILE,
    OUTPUTS_FILE,
    POINTS_DIR,
    PROBES_DIR,
    RECALL_DIR,
    load_points,
    point_file,
    point_label,
    record_written,
    run_lock,
    save_point,
    taken_back_if_unused,
    wrote_before,
)

ENDPOINTS = ("pre", "post")


def run_file(name: str) -> bool:
    """What a sweep writes in its run folder (relative paths): points, probes, RECALL's similarities, the report
    files (samples.jsonl among them), the lock, and the temporary files and merge folders of a run in progress or
    killed."""
    from mergekit_lite.sweep.report import HTML_FILE, LAYERS_PLOT_FILE, MAP_FILE, PLOT_FILE, REPORT_FILE, RESULTS_FILE
    from mergekit_lite.sweep.samples import SAMPLES_FILE

    top, _, rest = name.partition("/")
    if top in (POINTS_DIR, PROBES_DIR, RECALL_DIR):
        return not rest or rest.endswith(".json") and "/" not in rest
    own = (LOCK_FILE, RESULTS_FILE, REPORT_FILE, HTML_FILE, PLOT_FILE, MAP_FILE, LAYERS_PLOT_FILE, SAMPLES_FILE)
    own += (OUTPUTS_FILE,)
    return (
        top in own
        or top.startswith((f"{MERGE_TEMP}-", f".{MERGE_TEMP}-"))
        or any(top.startswith(f".{file}.tmp-") for file in own)
    )


def comparison_file(name: str, methods: tuple[str, ...]) -> bool:
    """What a comparison writes in its run folder: the shared pre/post points, the comparison files, the lock,
    and one sweep folder per method holding what a sweep writes."""
    top, _, rest = name.partition("/")
    if top in methods:
        return not rest or rest == OUTPUT_MARKER or run_file(rest)
    own = (LOCK_FILE, COMPARISON_JSON, COMPARISON_MD, COMPARISON_HTML, PARETO_PLOT)
    return (
        top in own
        or any(top.startswith(f".{file}.tmp-") for file in own)
        or top == POINTS_DIR
        and (not rest or rest.endswith(".json") and "/" not in rest)
    )


def run_sweep(settings: SweepSettings, progress: bool = False) -> SweepResult:
    """Evaluate pre, post and every alpha (resuming saved points), pick the best, write the report."""
    from tqdm import tqdm

    from mergekit_lite.sweep.report import card_section, write_report

    settings.check_inputs()
    inputs = [settings.pre, settings.post, settings.include_path, settings.recall_texts]
    check_save_best(settings, inputs)
    check_run_folder(settings.out, inputs, own=run_file)
    check_evaluation(settings)
    usable_device(settings.device)  # torch loads here: what needs no torch was checked first
    check_pair(settings)
    audit_adapter_post(settings)
    drift = post_drift(settings)  # reads every weight of pre and post: NaN or Inf refused before any point is scored
    identity = settings.identity()
    rows = grid.rows(settings)  # one per value of a 2-D grid's second coefficient; a 1-D sweep is one row
    n_tasks = len(settings.old_tasks) + len(settings.new_tasks)
    search = probed = budget = None
    traces = []  # each row's golden search or probe mode
    with (
        taken_back_if_unused(settings.out, lambda: prepared(settings.out, inputs, run_file)) as folder,
        run_lock(folder),
    ):
        found = grid.cells(rows, folder)  # label -> cell (a 1-D sweep's labels: alpha=A)
        plan = [("pre", None), ("post", None)] + [(label, cell.alpha) for label, cell in found.items()]
        runs = load_points(folder, identity)
        todo = [(label, alpha) for label, alpha in plan if label not in runs]
        evaluated = []
        probe_mode = settings.probe is not None and settings.budget is None
        total = len(plan) + (len(rows) if probe_mode else 0)  # probe mode: every alpha, then each row's pick
        with (
            tqdm(
                total=total * n_tasks,
                initial=(len(plan) - len(todo)) * n_tasks,
                unit="task",
                desc="sweep",
                disable=not progress,
            ) as bar,
            ExitStack() as opened,
        ):
            evaluator = None

            def point_evaluator() -> PointEvaluator:
                nonlocal evaluator
                interrupts.check()
                evaluator = evaluator or opened.enter_context(closing(PointEvaluator(rows[0], folder, bar)))
                return evaluator

            if settings.ray is not None and todo:
                from mergekit_lite.sweep.distributed import run_points_on_ray

                for index, row in enumerate(rows):  # each row saves its points under its own cell identity
                    points = [
                        (label, alpha, None if alpha is None else found[label].config().to_dict())
                        for label, alpha in todo
                        if (index == 0 if alpha is None else found[label].row is row)
                    ]
                    for _ in run_points_on_ray(row, points, settings.ray) if points else ():
                        bar.update(n_tasks)
                runs.update(load_points(folder, identity))
                evaluated = [label for label, _ in todo]
            else:

                def evaluate(label: str, alpha: float | None) -> None:
                    if label in runs:
                        return
                    point = point_evaluator()
                    bar.set_postfix_str(label)
                    cell = found.get(label)
                    runs[label] = evaluate_point(
                        point, cell.row if cell else settings, label, alpha, cell and cell.config()
                    )
                    evaluated.append(label)

                def probe(label: str, alpha: float, samples: dict) -> list[TaskRun]:
                    point = point_evaluator()
                    bar.set_postfix_str(f"{label} (probe)")
                    return point.merged(found[label].config(), samples)

                full_grid = settings.search == "grid" and settings.probe is None and settings.budget is None
                for label, alpha in plan if full_grid else plan[:2]:
                    evaluate(label, alpha)
                if settings.budget is not None:
                    budget = run_budget(settings, found, folder, runs, probe, evaluate)
                    plan = plan[:2] + [(label, found[label].alpha) for label in budget["full"]]
                elif probe_mode:
                    plan = plan[:2]
                    for row in rows:
                        probed, search = run_probes(row, folder, runs, probe)
                        label = point_label(row, probed.pick)
                        evaluate(label, probed.pick)  # the row's pick, scored on every doc
                        plan.append((label, probed.pick))
                        traces.append(grid.row_trace(row, search, probed))
                elif settings.search == "golden":
                    for row in rows:
                        search = golden_search(row, runs, evaluate)
                        traces.append(grid.row_trace(row, search, None))
                    bar.total = (sum(len(trace["evaluated"]) for trace in traces) + 2) * n_tasks
                    bar.refresh()
            realigned = (
                None if settings.realign_shots is None else realign_post(settings, folder, runs, point_evaluator)
            )
        plan = [(label, alpha) for label, alpha in plan if label in runs]
        result = build_result(settings, folder, plan, runs, evaluated, grid.seconds(found))
        result.realigned, result.drift = realigned, drift
        if settings.second is None:
            result.search, result.probe = search, probed
        else:
            result.rows = traces or None
        result.budget = budget
        write_report(result)
        if settings.save_best:
            from mergekit_lite.audited import run_merge

            again = wrote_before(folder, "save_best", settings.save_best)
            check_output_folder(settings.save_best, inputs, overwrite=again)
            best = found[result.best.label].config()
            if settings.copy_files_from:
                best = config_from_dict({**best.to_dict(), "copy_files_from": settings.copy_files_from})
            run_merge(
                best, settings.save_best, overwrite=again, progress=progress, card_sections=[card_section(result)]
            )
            record_written(folder, "save_best", settings.save_best)
    return result


def realign_post(
    settings: SweepSettings, folder: Path, runs: dict[str, list[TaskRun]], point_evaluator
) -> list[TaskRun]:
    """--realign-shots: post again with K demonstrations on the docs it forgot, saved as a point of its own (resumed
    when there)."""
    from mergekit_lite.sweep.realign import evaluate_realigned, realigned_identity, realigned_label

    def score(shots: int, docs: dict) -> list[TaskRun]:
        realigned = point_evaluator().realigned_post(shots, docs)
        label = realigned_label(shots)
        save_point(point_file(folder, label), realigned_identity(settings), label, None, realigned)
        return realigned

    return evaluate_realigned(settings, runs, score)


def post_drift(settings: SweepSettings):
    """Post's relative Frobenius drift from pre per tensor, grouped per layer (evaluate.drift), for the report; a
    tensor of pre or post with NaN or Inf values is refused (merge/finite.py: a merge of it scores as noise)."""
    from mergekit_lite.evaluate.drift import summarise, weight_drift

    remedy = "a sweep needs finite weights in pre and post"
    return summarise(settings.pre, settings.post, weight_drift(settings.pre, settings.post, remedy=remedy))


def check_evaluation(settings: SweepSettings) -> None:
    """Before any model is read: lm-eval knows every task (built in or under --include-path), and the tokenizer has
    the chat template --apply-chat-template asks for; a typo costs a second, not a model load."""
    from mergekit_lite.evaluate.lm_harness import check_chat_template, check_fewshot_pools, task_index
    from mergekit_lite.merge.recall import find_tokenizer_dir

    task_index(settings.old_tasks + settings.new_tasks, settings.include_path)
    check_fewshot_pools(
        settings.old_tasks + settings.new_tasks,
        settings.include_path,
        {"--num-fewshot": settings.lm_eval.num_fewshot, "--realign-shots": settings.realign_shots},
    )
    if settings.lm_eval.apply_chat_template:
        folder = find_tokenizer_dir([settings.pre, settings.post], 0)
        where = f"{settings.pre} or {settings.post}"
        check_chat_template(evaluation_tokenizer(settings, folder), settings.lm_eval, where)


def audit_adapter_post(settings: SweepSettings) -> None:
    """A LoRA adapter as post is audited against pre before anything is evaluated, as `merge` audits an adapter
    (a point streamed to disk merges through that gate, one held in memory would not): REJECTED stops the sweep."""
    if (Path(settings.post) / "adapter_config.json").is_file():
        from mergekit_lite.audited import gate_adapter

        gate_adapter(settings.post, settings.pre, forcible=False)


def prepared(out, inputs: list, own) -> Path:
    """The run folder made (or reused) with its points/ folder."""
    folder = prepare_run_folder(out, inputs, own=own)
    (folder / POINTS_DIR).mkdir(exist_ok=True)
    return folder


def check_save_best(settings: SweepSettings, inputs: list) -> None:
    """--save-best names a new model folder outside the run folder, or the one this run folder's sweep wrote there
    before (the same command run again writes it again); it replaces no other folder, and a model inside the run
    folder would stop the run from resuming (it holds only its own files)."""
    if not settings.save_best:
        return
    check_output_path(settings.save_best, inputs)
    best, run = (Path(os.path.realpath(path)) for path in (settings.save_best, settings.out))
    if best == run or run in best.parents or best in run.parents:
        raise InputError(
            f"{settings.save_best}: --save-best must lie outside the run folder {settings.out} (and not "
            "hold it); choose a folder beside it"
        )
    if os.path.lexists(settings.save_best) and not wrote_before(settings.out, "save_best", settings.save_best):
        raise InputError(
            f"{settings.save_best}: already exists and is not the model this run folder's sweep saved "
            "there; --save-best replaces only its own, choose a new folder"
        )


def run_comparison(settings: list[SweepSettings], baseline: str = "linear", progress: bool = False) -> Comparison:
    """Evaluate pre and post once into the run folder's points/, write them into each method's sweep folder
    (OUT/<method>) under that sweep's identity, so each method's ordinary sweep resumes them; then compare."""
    if baseline not in [s.method for s in settings]:
        raise InputError(f"baseline {baseline!r} is not among the methods ({', '.join(s.method for s in settings)})")
    for own in settings:
        own.check_inputs()
    first = settings[0]
    inputs = [first.pre, first.post, first.include_path, first.recall_texts]
    methods = tuple(Path(own.out).name for own in settings)
    top = Path(first.out).parent
    check_run_folder(top, inputs, own=lambda name: comparison_file(name, methods))
    check_evaluation(first)
    usable_device(first.device)
    check_pair(first)
    audit_adapter_post(first)
    post_drift(first)  # NaN or Inf in pre or post refused before the endpoints are scored
    shared = replace(first, out=str(top), stream=True, save_best=None)  # endpoints only: no resident pair
    pair = {key: value for key, value in shared.identity().items() if key not in METHOD_FIELDS}

    def saved_endpoints() -> dict[str, list[TaskRun]]:
        return {label: runs for label, runs in load_points(folder, pair).items() if label in ENDPOINTS}

    with (
        taken_back_if_unused(top, lambda: prepared(top, inputs, lambda name: comparison_file(name, methods))) as folder,
        run_lock(folder),
    ):
        endpoints = saved_endpoints()
        todo = [label for label in ENDPOINTS if label not in endpoints]
        if todo and shared.ray is not None:
            from mergekit_lite.sweep.distributed import run_points_on_ray

            run_points_on_ray(shared, [(label, None, None) for label in todo], shared.ray)
            endpoints = saved_endpoints()
        elif todo:
            from tqdm import tqdm

            with tqdm(disable=True) as bar, closing(PointEvaluator(shared, folder, bar)) as evaluator:
                for label in todo:
                    endpoints[label] = evaluate_point(evaluator, shared, label, None, None)
        sweeps = {}
        for own in settings:
            sub = prepare_run_folder(own.out, inputs, own=run_file)
            (sub / POINTS_DIR).mkdir(exist_ok=True)
            for label, runs in endpoints.items():
                if not point_file(sub, label).is_file():
                    save_point(point_file(sub, label), own.identity(), label, None, runs)
            sweeps[own.method] = run_sweep(own, progress=progress)
        comparison = compare(sweeps, baseline, folder, len(todo) + sum(len(r.evaluated) for r in sweeps.values()))
        write_comparison(comparison)
    return comparison
