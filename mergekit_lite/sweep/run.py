"""The sweep itself: evaluate pre, post and the alphas (the full grid, a golden-section search or probe
mode; here one point after another, or on Ray actors), resuming saved points under the run folder's lock,
then build the result, write the report and, with --save-best, merge the pick; several methods in one run
folder (`run_comparison`), pre and post evaluated once for all of them."""

from __future__ import annotations

import os
from contextlib import ExitStack, closing
from dataclasses import replace
from pathlib import Path

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
from mergekit_lite.sweep.reuse import reused_endpoints
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
    record_written,
    run_lock,
    save_point,
    taken_back_if_unused,
    wrote_before,
)
from mergekit_lite.sweep.strategies import SweepRun, strategy_for
from mergekit_lite.sweep.vector import MERGEKIT_FILE, STUDY_FILE, VECTORS_DIR
from mergekit_lite.sweep.vector_search import chosen_merge, judge, with_vector

ENDPOINTS = ("pre", "post")


def run_file(name: str) -> bool:
    """What a sweep writes in its run folder (relative paths): points, probes, RECALL's similarities, the report
    files (samples.jsonl among them), the lock, and the temporary files and merge folders of a run in progress or
    killed."""
    from mergekit_lite.sweep.report import HTML_FILE, LAYERS_PLOT_FILE, MAP_FILE, PLOT_FILE, REPORT_FILE, RESULTS_FILE
    from mergekit_lite.sweep.samples import SAMPLES_FILE

    top, _, rest = name.partition("/")
    if top in (POINTS_DIR, PROBES_DIR, RECALL_DIR, VECTORS_DIR):
        return not rest or rest.endswith(".json") and "/" not in rest
    own = (LOCK_FILE, RESULTS_FILE, REPORT_FILE, HTML_FILE, PLOT_FILE, MAP_FILE, LAYERS_PLOT_FILE, SAMPLES_FILE)
    own += (OUTPUTS_FILE, STUDY_FILE, f"{STUDY_FILE}-journal", MERGEKIT_FILE)
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
    """Evaluate pre, post and the points the search chooses (resuming saved points), pick the best, write the
    report, save the pick."""
    from tqdm import tqdm

    from mergekit_lite.sweep.report import write_report

    inputs = check_sweep(settings)
    reused = reused_endpoints(settings)  # --pre-results / --post-results checked before the run folder is made
    drift = post_drift(settings)  # reads every weight of pre and post: NaN or Inf refused before any point is scored
    with (
        taken_back_if_unused(settings.out, lambda: prepared(settings.out, inputs, run_file)) as folder,
        run_lock(folder),
    ):
        rows = grid.rows(settings)  # one per value of a 2-D grid's second coefficient; a 1-D sweep is one row
        sweep = SweepRun(settings, rows, grid.cells(rows, folder), folder, load_points(folder, settings.identity()))
        keep_reused(folder, settings.cell_identity(), reused, sweep.runs)
        saved = sum(label in sweep.runs for label, _ in sweep.plan)
        strategy = with_vector(strategy_for(settings, resuming_everything=saved == len(sweep.plan)), settings)
        total = strategy.bar_points(sweep) * sweep.n_tasks
        with (
            tqdm(total=total, initial=saved * sweep.n_tasks, unit="task", desc="sweep", disable=not progress) as bar,
            ExitStack() as opened,  # the evaluator, closed once the points are scored
        ):
            sweep.bar, sweep.opened = bar, opened
            searched = strategy.run(sweep)
            realigned = None if settings.realign_shots is None else realign_post(settings, folder, sweep)
        plan = [(label, alpha) for label, alpha in searched.plan if label in sweep.runs]
        result = build_result(settings, folder, plan, sweep.runs, sweep.evaluated, grid.seconds(sweep.found))
        result.realigned, result.drift = realigned, drift
        searched.annotate(result)
        best, sections = sweep.found[result.best.label].config(), []
        if searched.vector is not None:
            result.vector = judge(searched.vector, result)
            best, sections = chosen_merge(searched.vector, settings, folder)
        write_report(result)
        if settings.save_best:
            save_best(settings, inputs, folder, result, best, progress, sections)
        if settings.save_best_adapter:
            save_best_adapter(settings, inputs, folder, result, best)
    return result


def keep_reused(folder: Path, identity: dict, reused: dict[str, list[TaskRun]], found: dict) -> None:
    """--pre-results / --post-results outcomes not saved yet, saved as their endpoint's point and put in `found`:
    the sweep and a rerun resume them as an evaluation."""
    for label, runs in reused.items():
        if label not in found:
            save_point(point_file(folder, label), identity, label, None, runs)
            found[label] = runs


def check_sweep(settings: SweepSettings) -> list:
    """Everything checked before the run folder is made, cheapest first; returns the inputs no output may touch."""
    settings.check_inputs()
    inputs = settings.read_paths
    check_save_best(settings, inputs)
    check_save_best_adapter(settings, inputs)
    check_run_folder(settings.out, inputs, own=run_file)
    check_evaluation(settings)
    usable_device(settings.device)  # torch loads here: what needs no torch was checked first
    check_pair(settings)
    audit_adapter_post(settings)
    return inputs


def save_best(
    settings: SweepSettings, inputs: list, folder: Path, result: SweepResult, best, progress: bool, sections=()
) -> None:
    """--save-best: the pick's merge `best` written as a model folder with the sweep's sections in its card."""
    from mergekit_lite.audited import run_merge
    from mergekit_lite.sweep.report import card_section

    again = wrote_before(folder, "save_best", settings.save_best)
    check_output_folder(settings.save_best, inputs, overwrite=again)
    if settings.copy_files_from:
        best = config_from_dict({**best.to_dict(), "copy_files_from": settings.copy_files_from})
    run_merge(
        best, settings.save_best, overwrite=again, progress=progress, card_sections=[card_section(result), *sections]
    )
    record_written(folder, "save_best", settings.save_best)


def save_best_adapter(settings: SweepSettings, inputs: list, folder: Path, result: SweepResult, best) -> None:
    """--save-best-adapter: the pick pre + alpha * (post - pre) of an adapter post written as that adapter with its
    update scaled by alpha (merge/scaled_adapter.py), its card naming the base, the recipe and the sweep's scores."""
    from mergekit_lite.io.lora import LoraAdapter
    from mergekit_lite.io.model_card import input_name
    from mergekit_lite.io.sources import open_inputs
    from mergekit_lite.merge.engine import merge_card
    from mergekit_lite.merge.scaled_adapter import write_scaled_adapter
    from mergekit_lite.sweep.report import card_section

    out, alpha = settings.save_best_adapter, result.best.alpha
    again = wrote_before(folder, "save_best_adapter", out)
    adapter = LoraAdapter.open(settings.post)
    recipe = merge_card(best, [], [card_section(result)])  # the merge the adapter is: its recipe and the scores
    card = replace(
        recipe,
        bases=[input_name(settings.pre)],
        relation="adapter",
        heading="LoRA adapter of a sweep's pick",
        method=f"{settings.method} at {settings.coefficient}={alpha:g}, as a LoRA adapter",
        parameters={
            **recipe.parameters,
            "adapter": input_name(settings.post),
            "update": f"{alpha:g} x the adapter's (lora_B scaled; DoRA: its B rows and magnitudes rewritten)",
        },
    )
    sources = open_inputs([settings.pre, settings.post], settings.pre, allow_pickle=False)
    try:
        write_scaled_adapter(
            adapter, alpha, sources[1].base_tensor, out, card, overwrite=again, inputs=[*inputs, settings.save_best]
        )
    finally:
        for source in sources:
            source.close()
    record_written(folder, "save_best_adapter", out)


def realign_post(settings: SweepSettings, folder: Path, sweep: SweepRun) -> list[TaskRun]:
    """--realign-shots: post again with K demonstrations on the docs it forgot, saved as a point of its own (resumed
    when there)."""
    from mergekit_lite.sweep.realign import evaluate_realigned, realigned_identity, realigned_label

    def score(shots: int, docs: dict) -> list[TaskRun]:
        realigned = sweep.point_evaluator().realigned_post(shots, docs)
        label = realigned_label(shots)
        save_point(point_file(folder, label), realigned_identity(settings), label, None, realigned)
        return realigned

    return evaluate_realigned(settings, sweep.runs, score)


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
    before (the same command run again writes it again)."""
    if settings.save_best:
        _check_pick_folder(settings, settings.save_best, "--save-best", "save_best", "model", inputs)


def check_save_best_adapter(settings: SweepSettings, inputs: list) -> None:
    """--save-best-adapter: post is a LoRA adapter and the method's merge at every coefficient c is pre + c * (post -
    pre) (its registry declaration `scales_task_vector`), so the pick is the adapter with its update scaled; one
    coefficient for the whole model (no --groups/--modules); its folder follows --save-best's rules and is another."""
    out = settings.save_best_adapter
    if not out:
        return
    from mergekit_lite.io.lora import LoraAdapter  # torch: only when an adapter is to be written
    from mergekit_lite.merge import methods

    if not LoraAdapter.is_adapter_dir(settings.post):
        raise InputError(
            f"--save-best-adapter writes the pick as a LoRA adapter, and --post {settings.post} is a model, not a "
            "PEFT adapter folder: use --save-best for a model folder"
        )
    method = methods.method(settings.method)
    if not method.scales_task_vector:
        scaled = ", ".join(name for name, each in methods.SWEEPABLE.items() if each.scales_task_vector)
        raise InputError(
            f"--save-best-adapter: {settings.method}'s merge is not pre + {settings.coefficient} * (post - pre) "
            f"({method.alpha_meaning}), so its pick is no scaled adapter; sweep {scaled}, or use --save-best"
        )
    if settings.groups is not None or settings.modules:
        raise InputError(
            "--save-best-adapter writes one coefficient's pick; --groups/--modules pick one per slot: use --save-best"
        )
    if settings.save_best and os.path.realpath(settings.save_best) == os.path.realpath(out):
        raise InputError(f"{out}: --save-best and --save-best-adapter name the same folder; give each its own")
    _check_pick_folder(
        settings, out, "--save-best-adapter", "save_best_adapter", "adapter", [*inputs, settings.save_best]
    )


def _check_pick_folder(settings: SweepSettings, out: str, flag: str, kind: str, what: str, inputs: list) -> None:
    """A folder the sweep writes its pick to (`what`: model or adapter): a new one outside the run folder, or the one
    this run folder's sweep wrote there before; it replaces no other folder, and one inside the run folder would stop
    the run from resuming (a run folder holds only its own files)."""
    check_output_path(out, inputs)
    best, run = (Path(os.path.realpath(path)) for path in (out, settings.out))
    if best == run or run in best.parents or best in run.parents:
        raise InputError(
            f"{out}: {flag} must lie outside the run folder {settings.out} (and not hold it); choose a folder beside it"
        )
    if os.path.lexists(out) and not wrote_before(settings.out, kind, out):
        raise InputError(
            f"{out}: already exists and is not the {what} this run folder's sweep saved there; {flag} replaces only "
            "its own, choose a new folder"
        )


def run_comparison(settings: list[SweepSettings], baseline: str = "linear", progress: bool = False) -> Comparison:
    """Evaluate pre and post once into the run folder's points/, write them into each method's sweep folder
    (OUT/<method>) under that sweep's identity, so each method's ordinary sweep resumes them; then compare."""
    if baseline not in [s.method for s in settings]:
        raise InputError(f"baseline {baseline!r} is not among the methods ({', '.join(s.method for s in settings)})")
    for own in settings:
        own.check_inputs()
    first = settings[0]
    inputs = first.read_paths
    methods = tuple(Path(own.out).name for own in settings)
    top = Path(first.out).parent
    check_run_folder(top, inputs, own=lambda name: comparison_file(name, methods))
    check_evaluation(first)
    usable_device(first.device)
    check_pair(first)
    audit_adapter_post(first)
    post_drift(first)  # NaN or Inf in pre or post refused before the endpoints are scored
    reused = reused_endpoints(first)
    shared = replace(first, out=str(top), stream=True, save_best=None)  # endpoints only: no resident pair
    pair = {key: value for key, value in shared.identity().items() if key not in METHOD_FIELDS}

    def saved_endpoints() -> dict[str, list[TaskRun]]:
        return {label: runs for label, runs in load_points(folder, pair).items() if label in ENDPOINTS}

    with (
        taken_back_if_unused(top, lambda: prepared(top, inputs, lambda name: comparison_file(name, methods))) as folder,
        run_lock(folder),
    ):
        endpoints = saved_endpoints()
        keep_reused(folder, pair, reused, endpoints)
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
