"""Inputs as the merge engine sees them: one tensor by name at a time, whatever sits on disk.

Adapters present themselves as full models (base + scaling*B@A, computed per tensor), and models whose
names differ by a known wrapper prefix, or that tie their head to the embeddings, are mapped onto the
reference names. Tying goes both ways, with the tied names transformers declares for the architecture
(`architecture.tied_tensors`): a tied model that stores no head lends its embeddings to the reference's
head, and a head stored beside embeddings it is tied to (a duplicate transformers ignores on load) is
not an extra tensor. Everything here reads lazily; nothing holds a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from mergekit_lite.errors import InputError
from mergekit_lite.io.architecture import checkpoint_names, tied_tensors
from mergekit_lite.io.hub import split_lora_reference
from mergekit_lite.io.lora import LoraAdapter
from mergekit_lite.io.quantized import open_dense

KNOWN_PREFIXES = ("model.", "base_model.model.", "module.", "_orig_mod.", "transformer.")


class TensorSource(Protocol):
    path: Path
    config: dict | None

    @property
    def names(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> torch.dtype: ...
    def load(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor; a source may read it into `into` (a uint8 block of at least its bytes) instead of new memory."""

    def close(self) -> None:
        """Close the files read so far (a wrapper closes the source it reads through)."""


class RenamedSource:
    """A source read through a name map (reference name -> this model's name)."""

    def __init__(self, source: TensorSource, name_map: dict[str, str]):
        self.source, self.name_map = source, name_map
        self.path, self.config = source.path, source.config

    @property
    def names(self) -> list[str]:
        return list(self.name_map)

    def shape(self, name):
        return self.source.shape(self.name_map[name])

    def dtype(self, name):
        return self.source.dtype(self.name_map[name])

    def load(self, name, into=None):
        return self.source.load(self.name_map[name], into)

    def close(self) -> None:
        self.source.close()


def tied_head(config: dict | None) -> tuple[str, str] | None:
    """(head, embeddings) on disk when the architecture ties its output head to its input embeddings."""
    return next(iter(tied_tensors(config).items()), None)


def replaces_tied_head(adapter, base: TensorSource) -> bool:
    """modules_to_save on the head of a base that ties it to the embeddings and stores none, or on those embeddings
    without ensure_weight_tying (PEFT trains a copy of the embeddings and keeps the base's head): the merge unties."""
    pair, names, replaced = tied_head(base.config), set(base.names), set(adapter.replaced())
    if pair is None or pair[0] in names or pair[1] not in names:
        return False
    return pair[0] in replaced or (pair[1] in replaced and not adapter.config.get("ensure_weight_tying"))


class UntiedHeadSource(RenamedSource):
    """A tied model that also shows its head (its embeddings under the head's name), to merge with an untied head."""

    def __init__(self, source: TensorSource, pair: tuple[str, str]):
        super().__init__(source, {**{name: name for name in source.names}, pair[0]: pair[1]})


def untie_heads(sources: list[TensorSource]) -> list[TensorSource]:
    """When an adapter brings its own head for a tied base, every tied input shows one: the merge writes an
    untied head (and engine.py writes tie_word_embeddings false)."""
    if not any(isinstance(source, AdapterSource) and source.own_head for source in sources):
        return sources
    untied = []
    for source in sources:
        pair = tied_head(source.config)
        keep = pair is None or pair[0] in source.names or pair[1] not in source.names
        untied.append(source if keep else UntiedHeadSource(source, pair))
    return untied


class AdapterSource:
    """A LoRA adapter seen as the full model it makes: base tensor + scaling*B@A (DoRA: rescaled per row, see
    LoraAdapter.apply), in float32 where it applies.

    PEFT names the modules it adapts as they are in memory; where transformers converts names on load
    (e.g. a multimodal wrapper), they are mapped to the base's on-disk names through that conversion."""

    def __init__(self, adapter, base: TensorSource):
        self.adapter, self.base = adapter, base
        self.path, self.config = Path(adapter.path), base.config
        adapted = set(adapter.targets()) | set(adapter.replaced())
        unknown = sorted(adapted - set(base.names))
        on_disk = checkpoint_names(base.config, unknown) if unknown else {}
        self._adapter_name = {on_disk.get(name, name): name for name in adapted}
        self._head = tied_head(base.config) if replaces_tied_head(adapter, base) else None
        missing = sorted(set(self._adapter_name) - set(base.names) - ({self._head[0]} if self._head else set()))
        if missing:
            raise InputError(
                f"{adapter.path}: adapts {self._adapter_name[missing[0]]}, which the base {base.path} does not have"
            )

    @property
    def own_head(self) -> bool:
        """The adapter brings its own head (modules_to_save) for a base that ties it to the embeddings."""
        return self._head is not None

    @property
    def names(self) -> list[str]:
        return self.base.names + ([self._head[0]] if self._head else [])

    def _stored(self, name) -> str:
        """The base's name for a tensor this source shows: an untied head the adapter does not bring is the base's
        embeddings."""
        return self._head[1] if self._head and name == self._head[0] else name

    def base_tensor(self, adapter_name: str) -> torch.Tensor:
        """The base's tensor where the adapter puts (or adds to) its tensor `adapter_name` (PEFT's in-memory name),
        as stored: for an own head on a base that ties it, the embeddings the base's head is."""
        on_disk = next(name for name, adapted in self._adapter_name.items() if adapted == adapter_name)
        return self.base.load(self._stored(on_disk))

    def shape(self, name):
        if self._head and name == self._head[0] and name in self._adapter_name:
            return tuple(self.adapter.shape(name))
        return self.base.shape(self._stored(name))

    def dtype(self, name):
        return torch.float32 if name in self._adapter_name else self.base.dtype(self._stored(name))

    def load(self, name, into=None):
        if name not in self._adapter_name:
            return self.base.load(self._stored(name), into)
        adapter_name = self._adapter_name[name]
        if adapter_name in self.adapter.replaced():
            return self.adapter.replacement(adapter_name).to(torch.float32)
        return self.adapter.apply(adapter_name, self.base.load(name))

    def close(self) -> None:
        """The adapter's own file is opened per read; the base is the one to close."""
        self.base.close()


def adapter_of(reference: str) -> str | None:
    """The LoRA adapter folder a reference applies: the adapter of mergekit's model+lora, or the reference itself
    when it is an adapter folder (applied to the merge's base); None for a model."""
    lora = split_lora_reference(reference)
    adapter = lora[1] if lora else reference
    return adapter if LoraAdapter.is_adapter_dir(adapter) else None


def open_model_reference(reference: str, allow_pickle: bool) -> TensorSource:
    """A model, or mergekit's model+lora: the adapter applied to its own host model (not the merge's base). A
    quantized model is read as its dense model (io/quantized.py), so every command merges and measures weights,
    never codes and scales."""
    lora = split_lora_reference(reference)
    if not lora:
        return open_dense(reference, allow_pickle=allow_pickle)
    if not LoraAdapter.is_adapter_dir(lora[1]):
        raise InputError(
            f"{reference}: {lora[1]} is not a LoRA adapter folder (no adapter_config.json), so it "
            f"cannot be applied to {lora[0]}"
        )
    host = open_dense(lora[0], allow_pickle=allow_pickle)
    return AdapterSource(LoraAdapter.open(lora[1], allow_pickle=allow_pickle), host)


def open_inputs(paths: list[str], base: str | None, allow_pickle: bool) -> list[TensorSource]:
    """Open every input (adapter folders on top of the base, model+lora references on their own model) and map all
    names onto the first input's names."""
    opened: list[TensorSource] = []
    base_source = None
    for path in paths:
        if LoraAdapter.is_adapter_dir(path):
            if base is None:
                raise InputError(f"{path}: a LoRA adapter needs the base model it was trained on (--base)")
            base_source = base_source or open_model_reference(base, allow_pickle)
            opened.append(AdapterSource(LoraAdapter.open(path, allow_pickle=allow_pickle), base_source))
        else:
            source = open_model_reference(path, allow_pickle)
            if path == base:
                base_source = source
            opened.append(source)
    check_architectures(opened)
    opened = untie_heads(opened)
    reference = opened[0]
    return [reference] + [align(reference, source) for source in opened[1:]]


def check_architectures(sources: list[TensorSource]) -> None:
    """Refuse models whose config.json names a different model_type or architecture; shapes alone can coincide."""
    for key in ("model_type", "architectures"):
        described = [(source.path, (source.config or {}).get(key)) for source in sources]
        described = [(path, value) for path, value in described if value]
        for path, value in described[1:]:
            if value != described[0][1]:
                raise InputError(
                    f"different architectures: {described[0][0]} has {key} {described[0][1]}, {path} has {value}"
                )


def align(reference: TensorSource, source: TensorSource) -> TensorSource:
    """Map `source`'s names onto `reference`'s, or fail naming the first tensor that differs.

    Renames come first; the tied names (which need transformers) only when no rename fits."""
    wanted, have = set(reference.names), set(source.names)
    if wanted == have:
        return source
    for name_map, _ in _candidate_maps(reference.names, source, {}):
        if set(name_map.values()) == have:
            return RenamedSource(source, name_map)
    tied, reference_tied = tied_tensors(source.config), tied_tensors(reference.config)
    for name_map, rename in _candidate_maps(reference.names, source, tied):
        duplicates = set(tied) | {rename(name) for name in reference_tied}
        if have - set(name_map.values()) <= duplicates:
            return RenamedSource(source, name_map)
    missing = sorted(wanted - have)
    extra = sorted(have - wanted)
    if missing:
        raise InputError(f"{source.path}: missing tensor {missing[0]} (present in {reference.path}){_more(missing)}")
    raise InputError(f"{source.path}: extra tensor {extra[0]} (absent from {reference.path}){_more(extra)}")


def _more(names: list[str]) -> str:
    return f" and {len(names) - 1} more" if len(names) > 1 else ""


def _candidate_maps(reference_names: list[str], source: TensorSource, tied: dict[str, str]):
    """Name maps worth trying (with the rename that made each): a wrapper prefix added or removed, and
    a reference tensor the source does not store read from the one it is tied to (`tied`, source names)."""
    have = set(source.names)
    for prefix in ("", *KNOWN_PREFIXES):
        for rename in (lambda n, p=prefix: p + n, lambda n, p=prefix: n[len(p) :] if n.startswith(p) else None):
            name_map = {}
            for name in reference_names:
                actual = rename(name)
                if actual is not None and actual not in have:
                    actual = tied.get(actual)
                if actual is None or actual not in have:
                    break
                name_map[name] = actual
            else:
                yield name_map, rename
