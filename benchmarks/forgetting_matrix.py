"""The forgetting matrix on toy fine-tunes, end to end with lm-eval, and replay chosen by prediction.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/forgetting_matrix.py --out benchmarks/work/forgetting-matrix

A toy world after mergekit_lite/toy.py (its tokenizer, model and multiple-choice task builders): PRE learns three
old fact tables over the same made-up entities (coat, hat, shoe -> a color). Each fine-tune learns a new table
(car, boat, ...) over its own random half of the entities, so it overwrites old facts of those entities. The old
docs are split by entity: `toy_old_*` (the replay pool) and `toy_held_*` (held out, only ever evaluated).

1. PRE and six fine-tunes evaluated with lm-eval's own CLI (--log_samples) on the six old tasks;
   `mergekit-lite forgetting PRE FT_1..FT_6 --matrix DIR --known 10 --known 30` gives R^2 by rank and the
   completion table.
2. Replay: a seventh fine-tune, trained with no replay, random replay and predicted replay (the same budget of
   pool docs added to its training batch). Predicted: its forgetting on K = 30 pool docs is observed (from the
   no-replay run's log), the rest predicted from the six-row history with its best method, docs drawn by
   softmax(score / 0.1). F_true on the held-out tasks, with a 95 % bootstrap interval over docs.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaForCausalLM

from mergekit_lite.evaluate.forgetting import forgetting_metrics
from mergekit_lite.evaluate.matrix import forgetting_row, pre_docs, pre_seeds, predict_row, select_replay
from mergekit_lite.evaluate.matrix_files import prediction_rows, read_history
from mergekit_lite.evaluate.outcomes import load_lm_eval_run
from mergekit_lite.threads import torch_threads
from mergekit_lite.toy import (
    COLORS,
    TEMPLATE_WORDS,
    Skill,
    ToyConfig,
    build_model,
    build_tokenizer,
    fit,
    make_entities,
    multiple_choice_docs,
    save_model,
    write_task,
)

OLD = ["coat", "hat", "shoe"]
NEW = ["car", "boat", "house", "dog", "cup", "door", "kite"]  # the last one is the replay experiment's fine-tune


def skill(task: str, relation: str, entities, rng: random.Random, avoid: list[Skill] = ()) -> Skill:
    """A fact table over `entities`; a color differs from the ones `avoid` gives the entity (a conflict)."""
    answers = {}
    for entity in sorted(entities):
        taken = {other.answers[entity] for other in avoid if entity in other.answers}
        answers[entity] = rng.choice([color for color in COLORS if color not in taken])
    return Skill(task, relation, answers)


def train_on(model, tokenizer, sentences: list[str], steps: int, learning_rate: float) -> None:
    """Full-batch AdamW on the answer word (as toy.train), over any list of same-shape sentences."""
    encoded = tokenizer(sentences, return_tensors="pt")["input_ids"]
    labels = torch.full_like(encoded, -100)
    labels[:, -1] = encoded[:, -1]
    fit(model, encoded, labels, steps, learning_rate)


def lm_eval(model_dir: Path, tasks: list[str], task_dir: Path, output: Path) -> Path:
    """lm-eval's own CLI entry point (`lm_eval run ... --log_samples`, called in-process to spare an interpreter
    start per model) on the old tasks; the folder its samples went to."""
    from lm_eval.__main__ import cli_evaluate

    if not list(output.rglob("samples_*.jsonl")):
        saved, sys.argv = (
            sys.argv,
            [
                "lm_eval",
                "run",
                "--model",
                "hf",
                "--model_args",
                f"pretrained={model_dir},dtype=float32",
                "--tasks",
                ",".join(tasks),
                "--include_path",
                str(task_dir),
                "--device",
                "cpu",
                "--batch_size",
                "64",
                "--log_samples",
                "--output_path",
                str(output),
            ],
        )
        try:
            cli_evaluate()
        finally:
            sys.argv = saved
    return next(output.rglob("samples_*.jsonl")).parent


def f_true_interval(pre, post, tasks: list[str], draws: int = 2000, seed: int = 0) -> dict:
    """F_true pooled over the held-out docs, and a 95 % bootstrap interval over docs."""
    pairs = [
        (pre.outcomes[t][s].correct[key], post.outcomes[t][s].correct[key], pre.outcomes[t][s].n_choices)
        for t in tasks
        for s in pre.outcomes[t]
        for key in pre.outcomes[t][s].correct
    ]
    k = pairs[0][2]
    before, after = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
    point = forgetting_metrics(before.tolist(), after.tolist(), k).F_true
    rng = np.random.default_rng(seed)
    samples = [
        forgetting_metrics(before[idx].tolist(), after[idx].tolist(), k).F_true
        for idx in (rng.integers(0, len(pairs), len(pairs)) for _ in range(draws))
    ]
    low, high = np.percentile(samples, [2.5, 97.5])
    return {"F_true": point, "low": float(low), "high": float(high), "docs": len(pairs)}


def main() -> None:
    parser = argparse.ArgumentParser(description="forgetting matrix on toy fine-tunes")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/work/forgetting-matrix"))
    parser.add_argument("--entities", type=int, default=48)
    parser.add_argument("--pre-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-4, help="the fine-tunes' learning rate (PRE: 3e-3)")
    parser.add_argument("--budget", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    entities = make_entities(args.entities, rng)
    pool, held = entities[0::2], entities[1::2]
    old = [skill(f"toy_old_{relation}", relation, entities, rng) for relation in OLD]
    tokenizer = build_tokenizer(TEMPLATE_WORDS + OLD + NEW + COLORS + entities)
    task_dir = out / "tasks"
    task_dir.mkdir(exist_ok=True)
    tasks = []
    for table in old:
        for split, members in (("old", pool), ("held", held)):
            part = Skill(
                table.task.replace("toy_old", f"toy_{split}"), table.relation, {e: table.answers[e] for e in members}
            )
            write_task(task_dir, part.task, multiple_choice_docs(part, part, rng))
            tasks.append(part.task)
    config = ToyConfig(seed=args.seed)
    runs = out / "runs"
    with torch_threads(1):
        if not (out / "models" / "pre" / "config.json").exists():
            pre = build_model(len(tokenizer), config)
            train_on(pre, tokenizer, [table.sentence(e) for table in old for e in entities], args.pre_steps, 3e-3)
            save_model(pre, tokenizer, out / "models" / "pre", config)
        pre_log = lm_eval(out / "models" / "pre", tasks, task_dir, runs / "pre")
        logs, new_skills = [], []
        for index, relation in enumerate(NEW):
            members = random.Random(args.seed * 100 + index).sample(entities, len(entities) // 2)
            new_skills.append(skill(f"toy_new_{relation}", relation, members, rng, avoid=old))
        for index, table in enumerate(new_skills[:-1]):
            logs.append(
                fine_tune(out, tokenizer, config, table, [], f"ft{index}_{table.relation}", args, tasks, task_dir, runs)
            )
        history = out / "history"
        if not history.exists():
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "-m",
                    "mergekit_lite.cli",
                    "forgetting",
                    str(pre_log),
                    *map(str, logs),
                    "--matrix",
                    str(history),
                    "--known",
                    "10",
                    "--known",
                    "30",
                    "-q",
                ],
                check=True,
            )
        payload = json.loads((history / "matrix.json").read_text())
        replay = replay_experiment(
            out, tokenizer, config, new_skills[-1], pre_log, history, args, tasks, task_dir, runs
        )
    report = {
        "command": " ".join(sys.argv),
        "fine_tunes": len(logs),
        "docs": payload["docs"],
        "mean": payload["mean"],
        "r2_by_rank": payload["r2_by_rank"],
        "completion": payload["completion"],
        "replay": replay,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


def fine_tune(
    out, tokenizer, config, table: Skill, replay_sentences: list[str], name: str, args, tasks, task_dir, runs
) -> Path:
    """PRE fine-tuned on `table` (plus replayed sentences in the same batch), evaluated on the old tasks."""
    folder = out / "models" / name
    if not (folder / "config.json").exists():
        model = LlamaForCausalLM.from_pretrained(out / "models" / "pre")
        train_on(
            model, tokenizer, [table.sentence(e) for e in sorted(table.answers)] + replay_sentences, args.steps, args.lr
        )
        save_model(model, tokenizer, folder, config)
    return lm_eval(folder, tasks, task_dir, runs / name)


def replay_experiment(
    out, tokenizer, config, table: Skill, pre_log: Path, history: Path, args, tasks, task_dir, runs
) -> dict:
    """No replay, random replay and predicted replay of `args.budget` pool docs for one more fine-tune."""
    matrix, payload = read_history(history)
    pre = load_lm_eval_run(pre_log)
    docs, chosen = pre_docs(pre)
    seeds = pre_seeds(pre)
    plain_log = fine_tune(out, tokenizer, config, table, [], "replay_none", args, tasks, task_dir, runs)
    values, covered = forgetting_row(
        chosen, load_lm_eval_run(plain_log), str(plain_log), matrix.value, partial=True, pre_seeds=seeds
    )
    in_pool = np.char.startswith(docs.tasks.astype(str), "toy_old_")
    rng = np.random.default_rng(args.seed)
    probe = np.zeros(len(docs), dtype=bool)
    probe[rng.choice(np.flatnonzero(in_pool & matrix.forgettable), 30, replace=False)] = True
    method = payload["completion"][-1]["best"]
    prediction = predict_row(matrix, values, probe & covered, method)
    rows = prediction_rows(matrix, prediction, chosen, seeds)
    candidates = np.flatnonzero(in_pool & matrix.forgettable)
    truth = values[candidates] > 0.5
    results = {
        "method": method,
        "budget": args.budget,
        "candidates": len(candidates),
        "pool_forgotten_without_replay": int(truth.sum()),
    }
    for strategy in ("random", "sample"):
        selection = select_replay(prediction.scores[candidates], args.budget, strategy, 0.1, args.seed)
        picked = candidates[selection.chosen]
        sentences = [rows[i]["prompt"] + rows[i]["completion"] for i in picked]
        name = "replay_random" if strategy == "random" else "replay_predicted"
        log = fine_tune(out, tokenizer, config, table, sentences, name, args, tasks, task_dir, runs)
        results[name] = {
            "forgotten_among_replayed": int((values[picked] > 0.5).sum()),
            "held_out": f_true_interval(pre, load_lm_eval_run(log), [t for t in tasks if "held" in t]),
        }
    results["replay_none"] = {
        "held_out": f_true_interval(pre, load_lm_eval_run(plain_log), [t for t in tasks if "held" in t])
    }
    return results


if __name__ == "__main__":
    main()
