"""A tiny, fully offline pre -> post model pair that forgets, for the demo and the tests.

Real checkpoints are too big for CI and need the network, so everything here is built from
scratch in about a minute on two CPU cores and is deterministic given a seed:

* two fact skills over the same entities and the same answer words, differing in one word:
  old = "the coat of <entity> is <color>", new = "the car of <entity> is <color>";
* "pre" learns only the old skill; "post" is pre fine-tuned on the new skill only. The new
  answers overwrite the old ones, so post clearly forgets the old skill, and a linear merge
  of the two checkpoints brings much of it back;
* both skills are written as 4-way multiple-choice lm-eval tasks.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mergekit_lite.errors import InputError
from mergekit_lite.threads import torch_threads

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
SPECIAL_TOKENS = [PAD, UNK, BOS, EOS]
COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]
TEMPLATE_WORDS = ["the", "of", "is"]
N_CHOICES = 4
OLD_TASK, NEW_TASK = "toy_old", "toy_new"
MARKER_FILE = "toy.json"


@dataclass(frozen=True)
class Skill:
    """One fact table written as sentences; `relation` is the only word that tells skills apart."""

    task: str
    relation: str
    answers: dict[str, str]

    def prompt(self, entity: str) -> str:
        return f"the {self.relation} of {entity} is"

    def sentence(self, entity: str) -> str:
        return f"{self.prompt(entity)} {self.answers[entity]}"


@dataclass(frozen=True)
class ToyConfig:
    """Everything that shapes a toy pair; stored in toy.json so a finished pair can be reused."""

    seed: int = 0
    n_entities: int = 64
    hidden_size: int = 64
    n_layers: int = 2
    n_heads: int = 4
    intermediate_size: int = 128
    pre_steps: int = 150
    post_steps: int = 200
    learning_rate: float = 3e-3
    max_shard_size: str | None = None
    post_layers: list[int] | None = None  # post-train only these decoder layers (None: the whole model)
    post_checkpoints: list[int] | None = None  # also save post-training at these steps (a training run's checkpoints)
    # forgetting that sits in these decoder layers by construction (what a per-layer-group sweep should find):
    # post_layers learn the new skill beside the old one (no forgetting there), then these layers alone learn wrong
    # old answers while keeping the new ones
    forget_layers: list[int] | None = None
    forget_steps: int = 100


@dataclass(frozen=True)
class ToyPair:
    """Paths of a finished pair: two HF model folders, lm-eval task folder and typical texts."""

    pre_dir: Path
    post_dir: Path
    task_dir: Path
    old_tasks: list[str]
    new_tasks: list[str]
    typical_texts: Path
    checkpoints: tuple[Path, ...] = ()  # post-training's checkpoint-STEP folders, in step order (pre is step 0)


def make_entities(n: int, rng: random.Random) -> list[str]:
    """Made-up two-syllable names, so entities are single words no real text gives meaning to."""
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    syllables = [c + v for c in consonants for v in vowels]
    names = sorted({a + b for a in syllables for b in syllables})
    if n > len(names):
        raise InputError(f"the toy world has at most {len(names)} entities, asked for {n}")
    return rng.sample(names, n)


def make_skills(entities: list[str], rng: random.Random) -> tuple[Skill, Skill]:
    """Old and new fact tables; every entity's new color differs from its old one, so learning
    the new table has to overwrite the old answers (that conflict is what causes forgetting)."""
    old_answers = {e: rng.choice(COLORS) for e in entities}
    new_answers = {e: rng.choice([c for c in COLORS if c != old_answers[e]]) for e in entities}
    return Skill(OLD_TASK, "coat", old_answers), Skill(NEW_TASK, "car", new_answers)


def wrong_answers(old: Skill, new: Skill) -> dict[str, str]:
    """Per entity a color that is neither its old nor its new answer (the first such after the old one)."""
    wrong = {}
    for entity, answer in old.answers.items():
        start = COLORS.index(answer)
        candidates = [COLORS[(start + step) % len(COLORS)] for step in range(1, len(COLORS))]
        wrong[entity] = next(color for color in candidates if color != new.answers[entity])
    return wrong


def forget_in_layers(model, tokenizer, old: Skill, new: Skill, config: ToyConfig) -> None:
    """Post-training whose forgetting sits in `forget_layers`: `post_layers` (default: the other layers) learn the new
    skill while keeping the old one, then `forget_layers` alone learn wrong old answers while keeping the new ones."""
    entities = sorted(old.answers)
    learners = config.post_layers or [i for i in range(config.n_layers) if i not in config.forget_layers]
    wrong = Skill(old.task, old.relation, wrong_answers(old, new))
    for first, layers, steps in (
        (old, learners, config.post_steps),
        (wrong, config.forget_layers, config.forget_steps),
    ):
        batches = [answer_batch(tokenizer, skill, entities) for skill in (first, new)]
        parameters = [p for i in layers for p in model.model.layers[i].parameters()]
        fit(
            model,
            torch.cat([ids for ids, _ in batches]),
            torch.cat([labels for _, labels in batches]),
            steps,
            config.learning_rate,
            parameters,
        )


def build_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """Word-level tokenizer that prepends <bos>, matching how lm-eval encodes contexts."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + sorted(set(words)))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK)


def build_model(vocab_size: int, config: ToyConfig) -> LlamaForCausalLM:
    """A seeded tiny Llama: big enough to memorise two fact tables, small enough to train in seconds."""
    torch.manual_seed(config.seed)
    llama_config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_heads,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
    )
    return LlamaForCausalLM(llama_config)


def answer_batch(
    tokenizer: PreTrainedTokenizerFast, skill: Skill, entities: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the skill's sentences and labels that score only the answer word."""
    encoded = tokenizer([skill.sentence(e) for e in entities], return_tensors="pt")
    input_ids = encoded["input_ids"]
    labels = torch.full_like(input_ids, -100)
    labels[:, -1] = input_ids[:, -1]
    return input_ids, labels


def train(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    skill: Skill,
    steps: int,
    learning_rate: float,
    layers: list[int] | None = None,
    after_step: Callable[[int], None] | None = None,
) -> None:
    """Full-batch AdamW on the answer token only: no data order to shuffle, hence deterministic.
    `layers` limits training to those decoder layers: the rest of the model stays bit-identical,
    which gives a pair whose forgetting is concentrated in a few layers. `after_step(step)` runs after each
    optimizer step (1-based), e.g. to save checkpoints."""
    input_ids, labels = answer_batch(tokenizer, skill, sorted(skill.answers))
    trained = None if layers is None else [p for i in layers for p in model.model.layers[i].parameters()]
    fit(model, input_ids, labels, steps, learning_rate, trained, after_step)


def fit(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    steps: int,
    learning_rate: float,
    parameters=None,
    after_step: Callable[[int], None] | None = None,
) -> None:
    """`steps` full-batch AdamW steps on one batch (all of the model's parameters unless `parameters` says)."""
    optimizer = torch.optim.AdamW(
        model.parameters() if parameters is None else parameters, lr=learning_rate, weight_decay=0.0
    )
    model.train()
    for step in range(steps):
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step(step + 1)
    model.eval()


def multiple_choice_docs(skill: Skill, other: Skill, rng: random.Random) -> list[dict]:
    """One 4-way item per entity. Distractors never include the other skill's answer, so a
    model that knows only the other skill scores chance (0.25), not zero."""
    docs = []
    for entity in sorted(skill.answers):
        correct = skill.answers[entity]
        pool = [c for c in COLORS if c not in (correct, other.answers[entity])]
        choices = rng.sample(pool, N_CHOICES - 1) + [correct]
        rng.shuffle(choices)
        docs.append({"question": skill.prompt(entity), "choices": choices, "label": choices.index(correct)})
    return docs


def write_task(task_dir: Path, task: str, docs: list[dict]) -> None:
    """JSONL data plus an lm-eval YAML that points at it by absolute path (data_files resolve
    against the working directory otherwise)."""
    data_path = (task_dir / f"{task}.jsonl").resolve()
    data_path.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    task_config = {
        "task": task,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_path)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc"}],
    }
    (task_dir / f"{task}.yaml").write_text(yaml.safe_dump(task_config, sort_keys=False))


def save_model(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, folder: Path, config: ToyConfig) -> None:
    """HF folder with safetensors weights (sharded when max_shard_size is set) and the tokenizer."""
    shard_kwargs = {"max_shard_size": config.max_shard_size} if config.max_shard_size else {}
    model.save_pretrained(folder, **shard_kwargs)
    tokenizer.save_pretrained(folder)


def pair_paths(out_dir: Path, config: ToyConfig) -> ToyPair:
    """Where every part of a pair lives inside `out_dir`."""
    return ToyPair(
        pre_dir=out_dir / "pre",
        post_dir=out_dir / "post",
        task_dir=out_dir / "tasks",
        old_tasks=[OLD_TASK],
        new_tasks=[NEW_TASK],
        typical_texts=out_dir / "typical_texts.txt",
        checkpoints=tuple(
            out_dir / "post-checkpoints" / f"checkpoint-{step}" for step in sorted(config.post_checkpoints or ())
        ),
    )


def cached_pair(out_dir: Path, config: ToyConfig) -> ToyPair | None:
    """A pair finished earlier with the same config (its toy.json is written last), else None."""
    marker = out_dir / MARKER_FILE
    if marker.is_file() and json.loads(marker.read_text()) == asdict(config):
        return pair_paths(out_dir, config)
    return None


def clear_pair(out_dir: Path, paths: ToyPair) -> None:
    """Drop the marker first (an interrupted rebuild must not look finished) and old model
    folders (stale shards of an earlier build would mix with the new weights)."""
    (out_dir / MARKER_FILE).unlink(missing_ok=True)
    for folder in (paths.pre_dir, paths.post_dir, paths.pre_dir.parent / "post-checkpoints"):
        shutil.rmtree(folder, ignore_errors=True)


def build_toy_pair(out_dir: str | Path, seed: int = 0, **options) -> ToyPair:
    """Build (or reuse) pre/post checkpoints, lm-eval tasks and typical texts under `out_dir`.

    `options` are ToyConfig fields, e.g. max_shard_size="20KB" to get sharded checkpoints.
    """
    config = ToyConfig(seed=seed, **options)
    out_dir = Path(out_dir).resolve()
    cached = cached_pair(out_dir, config)
    if cached is not None:
        return cached
    if any(not 0 < step < config.post_steps for step in config.post_checkpoints or ()):
        raise InputError(f"post_checkpoints must lie strictly between 0 and post_steps ({config.post_steps})")
    paths = pair_paths(out_dir, config)
    clear_pair(out_dir, paths)
    paths.task_dir.mkdir(parents=True, exist_ok=True)

    rng = random.Random(seed)
    entities = make_entities(config.n_entities, rng)
    old_skill, new_skill = make_skills(entities, rng)
    tokenizer = build_tokenizer(TEMPLATE_WORDS + [old_skill.relation, new_skill.relation] + COLORS + entities)

    with torch_threads(1):
        model = build_model(len(tokenizer), config)
        train(model, tokenizer, old_skill, config.pre_steps, config.learning_rate)
        save_model(model, tokenizer, paths.pre_dir, config)
        steps = dict(zip(sorted(config.post_checkpoints or ()), paths.checkpoints, strict=True))

        def save_checkpoint(step: int) -> None:
            if step in steps:
                save_model(model, tokenizer, steps[step], config)

        if config.forget_layers:
            forget_in_layers(model, tokenizer, old_skill, new_skill, config)
        else:
            train(
                model,
                tokenizer,
                new_skill,
                config.post_steps,
                config.learning_rate,
                config.post_layers,
                save_checkpoint,
            )
        save_model(model, tokenizer, paths.post_dir, config)

    write_task(paths.task_dir, old_skill.task, multiple_choice_docs(old_skill, new_skill, rng))
    write_task(paths.task_dir, new_skill.task, multiple_choice_docs(new_skill, old_skill, rng))
    sentences = [skill.sentence(e) for e in entities for skill in (old_skill, new_skill)]
    paths.typical_texts.write_text("\n".join(sentences) + "\n")
    (out_dir / MARKER_FILE).write_text(json.dumps(asdict(config), indent=2))
    return paths
