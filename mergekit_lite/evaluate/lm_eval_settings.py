"""lm-eval's evaluation settings (few-shot, chat template, system instruction, generation and model arguments, limit)
as its CLI takes them, checked without importing torch or reading a model, so a command that takes them fails on a
bad one before any work."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from mergekit_lite.errors import InputError
from mergekit_lite.io.validation import (
    TagsIgnoredLoader,
    is_regular_inside,
    parse_yaml,
    read_text,
    require_regular_inside,
)

# lm-eval's --model_args an in-memory model takes: HFLM's own (how prompts are cut and scored) and those that shape
# how transformers builds the model; the rest (pretrained, dtype, device, peft, ...) the sweep sets itself
HFLM_ARGS = (
    "max_length",
    "truncation",
    "add_bos_token",
    "prefix_token_id",
    "logits_cache",
    "max_batch_size",
    "softmax_dtype",
    "think_end_token",
    "enable_thinking",
)
LOADING_ARGS = ("attn_implementation", "trust_remote_code")
# the type each of them takes, as HFLM's __init__ and from_pretrained annotate it (tests compare with HFLM's
# signature): lm-eval passes the value through untyped, so `max_length=abc` would fail only once a prompt is cut
MODEL_ARG_TYPES = {
    "max_length": int,
    "truncation": bool,
    "add_bos_token": bool,
    "prefix_token_id": int,
    "logits_cache": bool,
    "max_batch_size": int,
    "softmax_dtype": str,
    "think_end_token": (str, int),
    "enable_thinking": bool,
    "attn_implementation": str,
    "trust_remote_code": bool,
}
POSITIVE_MODEL_ARGS = ("max_length", "max_batch_size")
# generation arguments lm-eval and transformers' generate() read as numbers or switches; a string there fails
# only at the first generation
GEN_KWARG_TYPES = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "max_gen_toks": int,
    "max_new_tokens": int,
    "min_new_tokens": int,
    "num_beams": int,
    "repetition_penalty": float,
    "do_sample": bool,
}
TYPE_NAMES = {int: "a whole number", float: "a number", bool: "True or False", str: "text"}


@dataclass(frozen=True)
class LmEvalSettings:
    """How lm-eval builds and scores the prompts, as its CLI's flags of the same names set them: few-shot
    demonstrations, the chat template (True: the tokenizer's default; a name: that one of its templates), few-shot
    turns as a conversation, a system instruction, generation arguments and model arguments ("k=v,k=v" strings as
    lm-eval parses them). Unset fewshot_as_multiturn follows the chat template, as lm-eval's CLI does."""

    num_fewshot: int | None = None
    apply_chat_template: bool | str = False
    fewshot_as_multiturn: bool | None = None
    system_instruction: str | None = None
    gen_kwargs: str | None = None
    model_args: str | None = None

    def __post_init__(self):
        if self.num_fewshot is not None and (
            isinstance(self.num_fewshot, bool) or not isinstance(self.num_fewshot, int) or self.num_fewshot < 0
        ):
            raise InputError(f"num_fewshot must be a whole number >= 0, got {self.num_fewshot!r}")
        if not isinstance(self.apply_chat_template, (bool, str)) or self.apply_chat_template == "":
            raise InputError(
                f"apply_chat_template must be true, false or a template name, got {self.apply_chat_template!r}"
            )
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise InputError("--fewshot-as-multiturn needs --apply-chat-template (the turns are chat messages)")
        for name in ("system_instruction", "gen_kwargs", "model_args"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InputError(f"{name} must be a string, got {value!r}")
        _check_types("gen_kwargs", self.generation_args(), GEN_KWARG_TYPES)
        unknown = [name for name in self.model_arguments() if name not in HFLM_ARGS + LOADING_ARGS]
        if unknown:
            raise InputError(
                f"model_args: {unknown[0]!r} is not one a sweep passes on (it sets the model, dtype and "
                f"device itself); it takes {', '.join(HFLM_ARGS + LOADING_ARGS)}"
            )
        _check_types("model_args", self.model_arguments(), MODEL_ARG_TYPES)

    @property
    def multiturn(self) -> bool:
        """Few-shot demonstrations as chat turns: as given, else on exactly when a chat template is applied."""
        return bool(self.apply_chat_template) if self.fewshot_as_multiturn is None else self.fewshot_as_multiturn

    def generation_args(self) -> dict:
        return _parsed("gen_kwargs", self.gen_kwargs)

    def model_arguments(self) -> dict:
        return _parsed("model_args", self.model_args)

    def hflm_args(self) -> dict:
        """The model arguments HFLM takes beside an in-memory model."""
        return {name: value for name, value in self.model_arguments().items() if name in HFLM_ARGS}

    def loading_args(self) -> dict:
        """The model arguments transformers' from_pretrained takes (attn_implementation, trust_remote_code)."""
        return {name: value for name, value in self.model_arguments().items() if name in LOADING_ARGS}

    @property
    def trusts_remote_code(self) -> bool:
        return self.loading_args().get("trust_remote_code") is True

    def given(self) -> dict:
        """The settings that differ from lm-eval's defaults: what a saved point and the report name."""
        defaults = LmEvalSettings()
        return {name: value for name, value in asdict(self).items() if value != getattr(defaults, name)}

    def simple_evaluate_args(self) -> dict:
        return {
            "num_fewshot": self.num_fewshot,
            "apply_chat_template": self.apply_chat_template,
            "fewshot_as_multiturn": self.multiturn,
            "system_instruction": self.system_instruction,
            "gen_kwargs": self.gen_kwargs,
        }

    def describe(self) -> str:
        """One line for a report: every setting given, as lm-eval's CLI flags."""
        given = self.given()
        if "fewshot_as_multiturn" not in given and self.multiturn:
            given["fewshot_as_multiturn"] = True
        return (
            ", ".join(f"--{name} {value!r}" if value is not True else f"--{name}" for name, value in given.items())
            or "lm-eval's defaults (no few-shot, no chat template)"
        )


LM_EVAL_KEYS = tuple(item.name for item in fields(LmEvalSettings))


def setting_items(name: str, text: str | None) -> list[tuple[str, str]]:
    """The NAME=VALUE items of a "k=v,k=v" setting (lm-eval's --model_args and --gen_kwargs syntax, --vllm-args),
    each checked: an item without '=', with no name or no value, or a name given twice is refused in one line
    naming it (lm-eval itself would pass `temperature` on as an empty string, and `=1` under an empty name)."""
    items, seen = [], set()
    for item in (text or "").split(","):
        if not item.strip():
            continue  # "a=1,,b=2": lm-eval skips empty items too
        key, equals, value = item.partition("=")
        key, shown = key.strip(), item.strip()[:200]
        if not equals:
            raise InputError(f"{name}: {shown!r} is not NAME=VALUE (no '='); write {shown}=VALUE")
        if not key:
            raise InputError(f"{name}: {shown!r} has no NAME before its '='")
        if not value.strip():
            raise InputError(f"{name}: {shown!r} gives {key} no value")
        if key in seen:
            raise InputError(f"{name}: {key!r} is given twice")
        seen.add(key)
        items.append((key, value.strip()))
    return items


def _check_types(name: str, values: dict, types: dict) -> None:
    """Values of the known arguments of the type their reader takes (lm-eval types a value by its look: 2048 is a
    number, True a boolean, anything else text), before any model is read."""
    for key, value in values.items():
        wanted = types.get(key)
        if wanted is None:
            continue
        kinds = wanted if isinstance(wanted, tuple) else (wanted,)
        fits = any(
            isinstance(value, kind)
            and (kind is bool or not isinstance(value, bool))
            or kind is float
            and isinstance(value, int)
            and not isinstance(value, bool)
            for kind in kinds
        )
        if fits and isinstance(value, float) and not math.isfinite(value):
            fits = False
        if fits and key in POSITIVE_MODEL_ARGS and value < 1:
            fits = False
        if not fits:
            expected = " or ".join(TYPE_NAMES[kind] for kind in kinds)
            if key in POSITIVE_MODEL_ARGS:
                expected = "a whole number >= 1"
            raise InputError(f"{name}: {key}={value!r} is not {expected}")


def _parsed(name: str, text: str | None) -> dict:
    """A "k=v,k=v" string as lm-eval reads it (values typed: numbers, booleans), a bad one as a one-line error."""
    if not text:
        return {}
    setting_items(name, text)
    from lm_eval.utils import simple_parse_args_string

    try:
        return simple_parse_args_string(text)
    except (ValueError, SyntaxError) as error:
        raise InputError(f"{name}: {text!r} is not NAME=VALUE,... ({error})") from None


def parse_limit(limit) -> int | float | None:
    """lm-eval's --limit: a number of docs per task (a whole number >= 1), or a share of each task's docs (a number
    in (0, 1), lm-eval scores ceil(share x docs)); a number as text is read too (a flag)."""
    if limit is None:
        return None
    value = limit
    if isinstance(limit, str):
        try:
            value = float(limit)
        except ValueError:
            value = None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
        or (value >= 1 and not float(value).is_integer())
    ):
        raise InputError(f"limit must be a whole number of docs >= 1 or a share of them in (0, 1), got {limit!r}")
    return int(value) if value >= 1 else float(value)


def check_task_folder(folder: str | os.PathLike) -> None:
    """Every file lm-eval reads under --include-path is a regular file inside it (a FIFO would block lm-eval for
    ever, a link out would be read), and so is every file a task YAML's `include:` names (lm-eval reads it relative
    to the YAML, or at an absolute path): checked before lm-eval indexes the folder."""
    root = Path(folder)
    for where, _, names in os.walk(root):
        for name in sorted(names):
            path = require_regular_inside(Path(where) / name, root)
            if not name.endswith((".yaml", ".yml")):
                continue
            data = parse_yaml(read_text(path), path, TagsIgnoredLoader)
            includes = data.get("include") if isinstance(data, dict) else None
            for include in includes if isinstance(includes, list) else [includes] if includes is not None else []:
                target = Path(where) / str(include)
                if not is_regular_inside(target, root):
                    raise InputError(
                        f"{path}: include: {str(include)[:200]!r} is not a regular file inside the --include-path "
                        f"{folder}; refused, nothing outside the folders named is read"
                    )
