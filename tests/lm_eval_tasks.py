"""Local lm-eval task YAMLs of every output type the forgetting map reads, over the toy pair's fact docs,
and a runner for lm-eval's own CLI (`lm_eval run ... --log_samples`), so tests read the files lm-eval writes."""

import sys
from pathlib import Path

import yaml

# A gsm8k-style free-form task: two filters lm-eval logs side by side. Generation is 2 words, so
# strict-match (the whole answer must be one word) and flexible-extract (first word) disagree.
TWO_FILTERS = [
    {
        "name": "strict-match",
        "filter": [{"function": "regex", "regex_pattern": r"^\s*(\w+)\s*$"}, {"function": "take_first"}],
    },
    {
        "name": "flexible-extract",
        "filter": [{"function": "regex", "regex_pattern": r"(\w+)"}, {"function": "take_first"}],
    },
]
EXACT_MATCH = [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True, "ignore_case": True}]


def _base(task: str, data_file: Path) -> dict:
    return {
        "task": task,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "test_split": "test",
        "doc_to_text": "{{question}}",
    }


def task_configs(toy_task_dir: Path) -> dict[str, dict]:
    """Task name -> lm-eval config, reading the toy pair's jsonl docs (question, choices, label)."""
    old, new = (Path(toy_task_dir).resolve() / f"{name}.jsonl" for name in ("toy_old", "toy_new"))
    generate = {
        "output_type": "generate_until",
        "doc_to_target": "{{choices[label]}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 2, "do_sample": False},
    }
    return {
        # free-form generation with two filters, for both skills (k = inf: no chance term)
        "gen_old": {**_base("gen_old", old), **generate, "filter_list": TWO_FILTERS, "metric_list": EXACT_MATCH},
        "gen_new": {**_base("gen_new", new), **generate, "filter_list": TWO_FILTERS, "metric_list": EXACT_MATCH},
        # generative multiple choice: the answer is generated and exact-matched, the doc lists 4 choices
        # (lm-eval maps the target index to the choice text when doc_to_choice is set)
        "genmc_old": {
            **_base("genmc_old", old),
            **generate,
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "label",
            "filter_list": TWO_FILTERS[1:],
            "metric_list": EXACT_MATCH,
        },
        # multiple choice that logs only acc_norm (like leaderboard_bbh_*, gpqa, musr)
        "norm_old": {
            **_base("norm_old", old),
            "output_type": "multiple_choice",
            "doc_to_choice": "choices",
            "doc_to_target": "label",
            "metric_list": [{"metric": "acc_norm"}],
        },
    }


def write_tasks(toy_task_dir: Path, folder: Path) -> Path:
    """The toy pair's two multiple-choice tasks plus task_configs(), as YAMLs in one include folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("toy_old", "toy_new"):
        (folder / f"{name}.yaml").write_text((Path(toy_task_dir) / f"{name}.yaml").read_text())
    for name, config in task_configs(toy_task_dir).items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder


def lm_eval_arguments(model_dir: Path, tasks: str, include_path: Path, output: Path, *options: str) -> list[str]:
    """`lm_eval run` on a local model and local tasks with --log_samples, and `options` (--limit, --samples, ...)."""
    return [
        "run",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={model_dir},dtype=float32",
        "--tasks",
        tasks,
        "--include_path",
        str(include_path),
        "--device",
        "cpu",
        "--batch_size",
        "32",
        "--log_samples",
        "--output_path",
        str(output),
        *options,
    ]


def samples_folder(output: Path) -> Path:
    """The one model folder lm-eval wrote into under `output` (its escaped model name)."""
    folders = {path.parent for path in output.rglob("samples_*.jsonl")}
    assert len(folders) == 1, folders
    return folders.pop()


def run_lm_eval(
    model_dir: Path,
    tasks: list[str],
    include_path: Path,
    output: Path,
    seed: int | None = None,
    limit: int | None = None,
) -> Path:
    """lm-eval's own CLI entry point (`lm_eval run ... --log_samples`), called in-process to spare the
    interpreter start and imports; it writes the same results_*.json and samples_*.jsonl. Returns the
    model folder lm-eval wrote into."""
    from lm_eval.__main__ import cli_evaluate

    options = (["--seed", str(seed)] if seed is not None else []) + (
        ["--limit", str(limit)] if limit is not None else []
    )
    saved_argv = sys.argv
    sys.argv = ["lm_eval", *lm_eval_arguments(model_dir, ",".join(tasks), include_path, output, *options)]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved_argv
    return samples_folder(output)
