"""The toy pair really forgets (measured through lm-eval), and its parts load as advertised."""

import json
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.lm_harness import Evaluator
from mergekit_lite.toy import MARKER_FILE, N_CHOICES, ToyConfig, build_toy_pair


@pytest.fixture(scope="module")
def scores(toy_pair):
    """Old/new task scores of pre and post, evaluated once for the whole module."""
    evaluator = Evaluator(toy_pair.old_tasks + toy_pair.new_tasks, include_path=toy_pair.task_dir)
    tokenizer = AutoTokenizer.from_pretrained(toy_pair.pre_dir)
    return {
        name: evaluator.evaluate(AutoModelForCausalLM.from_pretrained(folder), tokenizer)
        for name, folder in (("pre", toy_pair.pre_dir), ("post", toy_pair.post_dir))
    }


@pytest.mark.slow
def test_toy_pair_forgets_old_skill_while_learning_new(toy_pair, scores):
    old, new = toy_pair.old_tasks[0], toy_pair.new_tasks[0]
    pre, post = scores["pre"], scores["post"]
    assert pre[old].acc >= 0.9
    assert pre[new].acc <= 0.5  # near chance (0.25): pre never saw the new skill
    assert post[new].acc >= 0.9
    assert post[old].acc <= pre[old].acc - 0.3


@pytest.mark.slow
def test_task_scores_carry_k_and_per_sample_records(toy_pair, scores):
    n_docs = ToyConfig().n_entities
    for score in scores["post"].values():
        assert score.n_choices == N_CHOICES
        assert len(score.samples) == n_docs
        assert {"doc", "target", "arguments", "acc"} <= set(score.samples[0])
        assert score.acc == pytest.approx(sum(s["acc"] for s in score.samples) / n_docs)


def test_limit_caps_the_number_of_samples(toy_pair):
    evaluator = Evaluator(toy_pair.old_tasks, include_path=toy_pair.task_dir, limit=5)
    model = AutoModelForCausalLM.from_pretrained(toy_pair.pre_dir)
    score = evaluator.evaluate(model, AutoTokenizer.from_pretrained(toy_pair.pre_dir))[toy_pair.old_tasks[0]]
    assert len(score.samples) == 5


def test_tokenizer_round_trips_and_prepends_bos(toy_pair):
    tokenizer = AutoTokenizer.from_pretrained(toy_pair.post_dir)
    sentence = toy_pair.typical_texts.read_text().splitlines()[0]
    ids = tokenizer(sentence)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == sentence
    assert tokenizer("the coat of nobody")["input_ids"][-1] == tokenizer.unk_token_id


def test_typical_texts_hold_both_skills(toy_pair):
    lines = toy_pair.typical_texts.read_text().splitlines()
    assert len(lines) == 2 * ToyConfig().n_entities
    assert {line.split()[1] for line in lines} == {"coat", "car"}


def test_checkpoints_are_sharded_safetensors(toy_pair):
    for folder in (toy_pair.pre_dir, toy_pair.post_dir):
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1


def test_task_files_load_in_lm_eval(toy_pair):
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(toy_pair.task_dir), include_defaults=False)
    tasks = manager.load(toy_pair.old_tasks + toy_pair.new_tasks)["tasks"]
    for name in toy_pair.old_tasks + toy_pair.new_tasks:
        config = yaml.safe_load((toy_pair.task_dir / f"{name}.yaml").read_text())
        assert config["dataset_kwargs"]["data_files"]["test"].startswith("/")
        doc = tasks[name].eval_docs[0]
        assert len(tasks[name].doc_to_choice(doc)) == N_CHOICES
        assert tasks[name].doc_to_target(doc) in range(N_CHOICES)


@pytest.mark.slow
def test_unknown_task_names_task_and_include_path(toy_pair):
    with pytest.raises(InputError, match=f"no_such_task.*{toy_pair.task_dir}"):
        Evaluator(["no_such_task"], include_path=toy_pair.task_dir)


def quick_pair(out_dir, seed=0):
    """A barely trained pair: enough to test build mechanics in well under a second."""
    return build_toy_pair(out_dir, seed=seed, n_entities=8, pre_steps=2, post_steps=2)


def test_same_seed_gives_identical_weights(tmp_path):
    first, second = quick_pair(tmp_path / "a"), quick_pair(tmp_path / "b")
    weights_a = load_file(first.post_dir / "model.safetensors")
    weights_b = load_file(second.post_dir / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)


def test_finished_pair_is_reused_and_other_options_rebuild(tmp_path):
    pair = quick_pair(tmp_path)
    weights = pair.post_dir / "model.safetensors"
    built_at = weights.stat().st_mtime_ns
    time.sleep(0.01)
    assert quick_pair(tmp_path) == pair
    assert weights.stat().st_mtime_ns == built_at
    quick_pair(tmp_path, seed=1)
    assert weights.stat().st_mtime_ns != built_at
    assert json.loads((tmp_path / MARKER_FILE).read_text())["seed"] == 1


def test_post_checkpoints_are_the_training_runs_own_steps(tmp_path):
    """A checkpoint at step 1 of 2 is what post-training alone for 1 step gives, bit for bit; it differs from
    both ends. Steps outside the run are refused."""
    run = build_toy_pair(tmp_path / "run", seed=0, n_entities=8, pre_steps=2, post_steps=2, post_checkpoints=[1])
    [checkpoint] = run.checkpoints
    assert checkpoint.name == "checkpoint-1"
    one_step = build_toy_pair(tmp_path / "one", seed=0, n_entities=8, pre_steps=2, post_steps=1)
    middle = load_file(checkpoint / "model.safetensors")
    assert all(
        torch.equal(tensor, load_file(one_step.post_dir / "model.safetensors")[name]) for name, tensor in middle.items()
    )
    for end in (run.pre_dir, run.post_dir):
        assert not all(
            torch.equal(tensor, load_file(end / "model.safetensors")[name]) for name, tensor in middle.items()
        )
    with pytest.raises(InputError, match="post_checkpoints must lie strictly between 0 and post_steps"):
        build_toy_pair(tmp_path / "bad", seed=0, n_entities=8, pre_steps=2, post_steps=2, post_checkpoints=[2])
