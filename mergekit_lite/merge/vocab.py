"""Different vocabularies in one merge (mergekit's `tokenizer_source`): embedding and head rows aligned by token.

The output vocabulary is the base's tokenizer (`base`), one model's (`<model>`), or the base's plus every
token the others add (`union`). Each input's vocabulary tensors are re-indexed onto it by token string; a
token an input lacks takes, as in mergekit (tokenizer/embed.py), the row of the only model that has it,
else the base's row, else the mean of the rows of the models that have it (zeros when none has it), counting
only the inputs of that tensor (a slice merge takes the embeddings from the first slice's sources and the head
from the last's). So a token only a fine-tune has keeps the fine-tune's row whatever the method. Rows past the
vocabulary (with `pad_to_multiple_of`) are the mean row. The chosen tokenizer is written with the output and the
config's `vocab_size` updated. Without a tokenizer setting, vocabularies of different sizes are an error naming it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from mergekit_lite.errors import InputError
from mergekit_lite.io.sources import TensorSource
from mergekit_lite.io.validation import check_folder_files

VOCABULARY_PARTS = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out", "word_embeddings")
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def is_vocabulary_tensor(name: str, shape: tuple[int, ...], vocab_size: int | None) -> bool:
    """Token-indexed tensors (embeddings, the head): a known name whose first axis is the vocabulary."""
    return bool(shape) and shape[0] == vocab_size and any(part in name for part in VOCABULARY_PARTS)


def _vocab_size(source: TensorSource) -> int | None:
    size = (source.config or {}).get("vocab_size")
    return size if isinstance(size, int) else None


def _load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    check_folder_files(folder)  # a tokenizer file or chat template linking out is refused, not followed
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError):
        return None


@dataclass
class Vocabulary:
    """The output tokenizer and, per input, the row of each output token (-1 where the input lacks it)."""

    tokenizer: object
    size: int
    rows: list[torch.Tensor]
    base_index: int

    def align(self, tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The inputs of one tensor (input index -> tensor) re-indexed onto the output vocabulary, missing rows
        filled as mergekit does, from these inputs alone (the base's row only when the base is one of them)."""
        indices = list(tensors)
        present = torch.stack([self.rows[index] >= 0 for index in indices])  # (inputs, tokens)
        n_tokens = present.shape[1]
        first = tensors[indices[0]]
        shape = (self.size, *first.shape[1:])
        fallback = torch.zeros((n_tokens, *shape[1:]), dtype=torch.float32)
        partial = (~present.all(dim=0)).nonzero().flatten().tolist()
        for token in partial:
            holders = [indices[k] for k in present[:, token].nonzero().flatten().tolist()]
            if len(holders) == 1 or self.base_index in holders:
                donor = holders[0] if len(holders) == 1 else self.base_index
                fallback[token] = tensors[donor][self.rows[donor][token]]
            elif holders:
                fallback[token] = torch.stack([tensors[i][self.rows[i][token]].float() for i in holders]).mean(0)
        aligned = {}
        for index, tensor in tensors.items():
            rows = self.rows[index]
            out = torch.empty(shape, dtype=tensor.dtype)
            have = rows >= 0
            out[:n_tokens][have] = tensor[rows[have]]
            out[:n_tokens][~have] = fallback[~have].to(tensor.dtype)
            if self.size > n_tokens:
                out[n_tokens:] = out[:n_tokens].float().mean(0).to(tensor.dtype)
            aligned[index] = out
        return aligned

    def write(self, folder: Path, chat_template: str | None = None) -> None:
        """The chosen tokenizer beside the weights, and config.json's vocab_size updated."""
        if chat_template:
            self.tokenizer.chat_template = chat_template
        self.tokenizer.save_pretrained(str(folder))
        config_file = folder / "config.json"
        if config_file.is_file():
            model_config = json.loads(config_file.read_text())
            model_config["vocab_size"] = self.size
            config_file.write_text(json.dumps(model_config, indent=2) + "\n")


def build_vocabulary(
    sources: list[TensorSource], tokenizer_source: str, base_index: int, pad_to_multiple_of: int | None = None
) -> Vocabulary:
    """The output tokenizer for `tokenizer_source` and each input's rows for it (by token string)."""
    tokenizers = [_load_tokenizer(source.path) for source in sources]
    base_tokenizer = tokenizers[base_index]
    if base_tokenizer is None:
        raise InputError(
            f"{sources[base_index].path}: no tokenizer to build the output vocabulary from "
            f"(tokenizer_source: {tokenizer_source})"
        )
    if tokenizer_source == "base":
        tokenizer = base_tokenizer
    elif tokenizer_source == "union":
        tokenizer = _union(base_tokenizer, [t for t in tokenizers if t is not None and t is not base_tokenizer])
    else:
        tokenizer = _load_tokenizer(Path(tokenizer_source))
        if tokenizer is None:
            raise InputError(f"tokenizer_source {tokenizer_source}: no tokenizer there")
    vocab = tokenizer.get_vocab()
    n_tokens = len(vocab)
    size = n_tokens
    if pad_to_multiple_of and size % pad_to_multiple_of:
        size += pad_to_multiple_of - size % pad_to_multiple_of
    rows = []
    for source, own in zip(sources, tokenizers, strict=True):
        model_vocab = (own or base_tokenizer).get_vocab()
        limit = _vocab_size(source) or len(model_vocab)
        index = torch.full((n_tokens,), -1, dtype=torch.long)
        for token, token_id in vocab.items():
            row = model_vocab.get(token, -1)
            if row < limit:
                index[token_id] = row
        rows.append(index)
    return Vocabulary(tokenizer, size, rows, base_index)


def _union(base, others):
    """The base tokenizer plus the tokens only the others have, appended in order (mergekit's union)."""
    import copy

    from transformers import AddedToken

    union = copy.deepcopy(base)
    have = set(union.get_vocab())
    for other in others:
        added = {info.content: info for info in other.added_tokens_decoder.values()}
        for token, _ in sorted(other.get_vocab().items(), key=lambda item: item[1]):
            if token not in have:
                union.add_tokens(added.get(token, AddedToken(token, normalized=False)))
                have.add(token)
    return union


class VocabularyAligner:
    """Loads one vocabulary tensor from each of its inputs at once and keeps the aligned set for the next reads.
    `inputs_of` names the inputs of each vocabulary tensor where they are not every input (slices)."""

    def __init__(self, sources: list[TensorSource], vocabulary: Vocabulary, names: set[str]):
        self.sources, self.vocabulary, self.names = sources, vocabulary, names
        self.inputs_of: dict[str, list[int]] = {}
        self._cached: tuple[str, dict[int, torch.Tensor]] | None = None

    def load(self, name: str, index: int) -> torch.Tensor:
        if self._cached is None or self._cached[0] != name:
            indices = self.inputs_of.get(name, range(len(self.sources)))
            self._cached = (name, self.vocabulary.align({i: self.sources[i].load(name) for i in indices}))
        return self._cached[1][index]


class AlignedSource:
    """One input as seen through the output vocabulary."""

    def __init__(self, source: TensorSource, index: int, aligner: VocabularyAligner):
        self.source, self.index, self.aligner = source, index, aligner
        self.path, self.config = source.path, source.config

    @property
    def names(self) -> list[str]:
        return self.source.names

    def shape(self, name):
        shape = self.source.shape(name)
        return (self.aligner.vocabulary.size, *shape[1:]) if name in self.aligner.names else shape

    def dtype(self, name):
        return self.source.dtype(name)

    def load(self, name, into=None):
        """Aligned vocabulary rows come from the aligner (new memory); other tensors read into `into` as usual."""
        return self.aligner.load(name, self.index) if name in self.aligner.names else self.source.load(name, into)

    def close(self) -> None:
        self.source.close()


def align_vocabularies(
    sources: list[TensorSource],
    tokenizer_source: str | None,
    base_index: int = 0,
    pad_to_multiple_of: int | None = None,
) -> tuple[list[TensorSource], Vocabulary | None]:
    """The plan's hook: inputs re-indexed onto the output vocabulary when a tokenizer source is set;
    without one, inputs whose vocabulary tensors differ in size are a one-line error naming the option."""
    reference = sources[0]
    names = {
        name for name in reference.names if is_vocabulary_tensor(name, reference.shape(name), _vocab_size(reference))
    }
    if tokenizer_source is None:
        for name in sorted(names):
            for source in sources[1:]:
                if name in source.names and source.shape(name)[0] != reference.shape(name)[0]:
                    raise InputError(
                        f"vocabularies differ ({reference.shape(name)[0]} tokens in {reference.path}, "
                        f"{source.shape(name)[0]} in {source.path}): set tokenizer_source: base, union "
                        "or a model (--tokenizer-source) to align them by token"
                    )
        return sources, None
    vocabulary = build_vocabulary(sources, tokenizer_source, base_index, pad_to_multiple_of)
    for source in sources[1:]:
        for name in names:
            if name in source.names and not is_vocabulary_tensor(name, source.shape(name), _vocab_size(source)):
                raise InputError(
                    f"{source.path}: {name} has {source.shape(name)[0]} rows but its config says "
                    f"vocab_size {_vocab_size(source)}"
                )
    aligner = VocabularyAligner(sources, vocabulary, names)
    return [AlignedSource(source, index, aligner) for index, source in enumerate(sources)], vocabulary


def limit_vocabulary_inputs(sources: list[TensorSource], inputs_of: dict[str, list[int]]) -> None:
    """The plan's hook once its steps are known (tensor name -> the inputs it merges): each vocabulary tensor's
    missing rows are then filled from its own inputs, as mergekit fills them, never from a model that does not
    make that tensor (a slice merge's embeddings come from the first slice's sources, its head from the last's)."""
    aligner = getattr(sources[0], "aligner", None) if sources else None
    if aligner is not None:
        aligner.inputs_of.update({name: list(indices) for name, indices in inputs_of.items() if name in aligner.names})


def chat_template_text(chat_template: str, sources: list[TensorSource]) -> str | None:
    """mergekit's chat_template: "auto" (the inputs' most common one), "chatml", or a Jinja template itself."""
    if chat_template == "auto":
        templates = [getattr(t, "chat_template", None) for t in map(_load_tokenizer, (s.path for s in sources)) if t]
        templates = [t for t in templates if isinstance(t, str)]
        return Counter(templates).most_common(1)[0][0] if templates else None
    return CHATML if chat_template == "chatml" else chat_template


def write_tokenizer(
    folder: Path, vocabulary: Vocabulary | None, chat_template: str | None, sources: list[TensorSource]
) -> None:
    """The engine's hook after side files are copied: the output tokenizer, and the chat template."""
    template = chat_template_text(chat_template, sources) if chat_template else None
    if vocabulary is not None:
        vocabulary.write(folder, template)
    elif template:
        tokenizer = _load_tokenizer(folder)
        if tokenizer is None:
            raise InputError(
                "chat_template: the output has no tokenizer to carry it (copy_files_from a model with one)"
            )
        tokenizer.chat_template = template
        tokenizer.save_pretrained(str(folder))
