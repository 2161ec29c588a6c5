"""A model whose output does not depend on its input (its head zeroed: every token equally likely) gives lm-eval
logs in which every choice of a doc has the same log-likelihood; `forgetting` says how many docs of how many are
such ties, for which model, in its table and its JSON."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mergekit_lite.evaluate.ties import run_ties


def constant_model(model: Path, folder: Path) -> Path:
    """A copy of a toy model with its output head zeroed: uniform logits, so equal-length choices tie."""
    shutil.copytree(model, folder)
    for path in folder.glob("*.safetensors"):
        tensors = load_file(path)
        tensors = {name: torch.zeros_like(t) if "lm_head" in name else t for name, t in tensors.items()}
        save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        pytest.skip("the toy model ties its head to its embeddings")
    return folder


@pytest.mark.slow
def test_forgetting_names_tied_answers_of_a_constant_model(toy_pair, tmp_path):
    from lm_eval_tasks import run_lm_eval

    broken = constant_model(toy_pair.post_dir, tmp_path / "constant")
    tasks = [*toy_pair.old_tasks, *toy_pair.new_tasks]
    pre = run_lm_eval(toy_pair.pre_dir, tasks, toy_pair.task_dir, tmp_path / "pre", limit=12)
    post = run_lm_eval(broken, tasks, toy_pair.task_dir, tmp_path / "post", limit=12)
    # lm-eval's own logged log-likelihoods: every choice of every doc equal for the constant model, none for pre
    records = [json.loads(line) for file in post.glob("samples_*.jsonl") for line in file.read_text().splitlines()]
    equal = sum(len({float(r[0]) for r in record["filtered_resps"]}) == 1 for record in records)
    ties = run_ties(post)
    assert ties.tied == equal == len(records) and len(ties.mostly_tied) == len(tasks)
    assert run_ties(pre).tied == 0
    command = [str(Path(sys.executable).with_name("mergekit-lite")), "forgetting", str(pre), str(post)]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    table = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)
    assert table.returncode == 0, table.stderr
    assert f"{toy_pair.old_tasks[0]} 12 of 12 docs tied (equal log-likelihoods)" in table.stdout
    assert "warning: tied answers" in table.stderr
    payload = json.loads(subprocess.run([*command, "--json"], capture_output=True, text=True, env=environment).stdout)
    assert payload["ties"]["pre"]["tasks"] == []
    assert {row["task"]: (row["tied"], row["docs"]) for row in payload["ties"]["post"]["tasks"]} == {
        task: (12, 12) for task in tasks
    }
    # the sweep scores lm-eval's records as these files hold them: the constant model's are refused in one line
    from mergekit_lite.errors import InputError
    from mergekit_lite.evaluate.lm_harness import TaskScore
    from mergekit_lite.evaluate.outcomes import Scoring
    from mergekit_lite.sweep.scoring import check_not_mostly_tied, score_task

    def scored(folder: Path) -> list:
        runs = []
        for task in tasks:
            file = next(folder.glob(f"samples_{task}_*.jsonl"))
            samples = [json.loads(line) for line in file.read_text().splitlines()]
            runs.append(score_task(task, "old", TaskScore(task, samples, {}), Scoring()))
        return runs

    check_not_mostly_tied("pre", scored(pre))
    with pytest.raises(InputError, match="post's answers are mostly ties .* 12 of 12"):
        check_not_mostly_tied("post", scored(post))
