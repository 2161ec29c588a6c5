"""The `README.md` model card every output folder gets, as the Hugging Face Hub reads it, and the cards of inputs.

The front matter holds what the Hub indexes (https://huggingface.co/docs/hub/model-cards): `base_model` (the
inputs' hub ids where known, else their folder names), `base_model_relation` (`merge`, or `adapter` for an
extracted LoRA), `library_name`, `tags` and the inputs' `license` when their own cards declare one. The body
says how the folder was made. I/O only: the card is rendered from plain data the caller gives; nothing here
knows a merge method.

An input's card is a user input: read with the limits of every YAML we read (io/validation.py: size, depth, alias
expansion), which huggingface_hub's own metadata_load (a plain yaml.safe_load) does not have; its front matter is
found with huggingface_hub's own pattern.
"""

from __future__ import annotations

import math
import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mergekit_lite.errors import InputError
from mergekit_lite.io.validation import require_regular_inside

CARD_FILE = "README.md"
MAX_CARD_BYTES = 1 << 20
TAGS = ["merge", "mergekit-lite"]


def read_card_metadata(folder) -> dict:
    """The front matter of a folder's README.md, or {} when there is none or it is not a readable card: a card only
    adds information, so a bad one is simply not used; one that links out of the folder is refused, never read."""
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    from mergekit_lite.io.validation import parse_yaml, read_text

    path = Path(folder) / CARD_FILE
    if not Path(folder).is_dir() or not os.path.lexists(path):
        return {}
    require_regular_inside(path, Path(folder))
    try:
        match = REGEX_YAML_BLOCK.search(read_text(path, limit=MAX_CARD_BYTES).removeprefix("\ufeff"))
        data = parse_yaml(match.group(2), path) if match else None
    except InputError:
        return {}
    return data if isinstance(data, dict) else {}


def input_name(path) -> str:
    """How a card names an input: its hub id when it is a snapshot of the Hugging Face cache, else its folder name;
    a model+lora reference as the names of its two parts."""
    from mergekit_lite.io.hub import hub_id_of, reference_paths

    parts = reference_paths(str(path))
    if len(parts) > 1:
        return "+".join(input_name(part) for part in parts)
    return hub_id_of(path) or Path(os.path.abspath(path)).name


def licenses_of(folders) -> list[str]:
    """The licenses the inputs' own cards declare, each once, in input order."""
    found = []
    for folder in folders:
        declared = read_card_metadata(folder).get("license")
        for name in declared if isinstance(declared, list) else [declared]:
            if isinstance(name, str) and name and name not in found:
                found.append(name)
    return found


@dataclass
class ModelCard:
    """What a card says, as plain data: the bases, how they were combined, and free sections (title, markdown)."""

    bases: list[str]
    relation: str  # "merge" or "adapter"
    method: str
    parameters: dict
    config_yaml: str | None = None
    licenses: list[str] = field(default_factory=list)
    audits: list[dict] = field(default_factory=list)  # {"adapter", "verdict", "reasons"} per adapter merged
    sections: list[tuple[str, str]] = field(default_factory=list)
    heading: str | None = None  # what the folder is, for the title (default: by relation)

    def front_matter(self) -> dict:
        data = {
            "base_model": list(dict.fromkeys(self.bases)),
            "base_model_relation": self.relation,
            "library_name": "transformers",
            "tags": TAGS,
        }
        if self.licenses:
            data["license"] = self.licenses[0] if len(self.licenses) == 1 else "other"
            if len(self.licenses) > 1:
                data["license_name"] = " AND ".join(self.licenses)
        return data

    def render(self) -> str:
        what = self.heading or ("merge" if self.relation == "merge" else "LoRA adapter extracted")
        front_matter = yaml.safe_dump(self.front_matter(), sort_keys=False, width=math.inf)  # never folded
        lines = [
            "---",
            front_matter.rstrip(),
            "---",
            "",
            f"# {what} made with mergekit-lite",
            "",
            f"Method: {_code(self.method)}, from: " + ", ".join(map(_code, dict.fromkeys(self.bases))),
            "",
        ]
        if self.parameters:
            lines += [
                "## Parameters",
                "",
                *(f"- {_code(key)}: {_code(value)}" for key, value in self.parameters.items()),
                "",
            ]
        if self.licenses:
            lines += ["## Licenses", "", "The inputs' cards declare: " + ", ".join(map(_text, self.licenses)) + ".", ""]
        if self.audits:
            lines += ["## Adapter audits", "", "| adapter | verdict | reasons |", "|---|---|---|"]
            lines += [
                f"| {_cell(_code(a['adapter']))} | {_text(a['verdict'])} | "
                f"{_cell(_text('; '.join(a['reasons']) or '-'))} |"
                for a in self.audits
            ]
            lines.append("")
        for title, text in self.sections:
            lines += [f"## {title}", "", text.rstrip(), ""]
        if self.config_yaml:
            fence = "`" * max(3, _longest_backtick_run(self.config_yaml) + 1)  # no line inside can close it
            lines += ["## Configuration", "", f"{fence}yaml", self.config_yaml.rstrip(), fence, ""]
        return "\n".join(lines)


def _one_line(text) -> str:
    """Control characters (a line break in a folder name, say) as Python escapes: a user string stays on its line
    and cannot start a heading or a list of its own."""
    return "".join(repr(char)[1:-1] if unicodedata.category(char).startswith("C") else char for char in str(text))


def _longest_backtick_run(text: str) -> int:
    return max((len(run) for run in re.findall("`+", text)), default=0)


def _code(text) -> str:
    """A user string as inline code (CommonMark 6.1): delimited by more backticks than any run inside it, padded
    where it starts or ends with one, so nothing in it closes the span."""
    text = _one_line(text)
    ticks = "`" * (_longest_backtick_run(text) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text.strip(" ") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _text(text) -> str:
    """A user string as plain text inside a line: each mark markdown acts on there backslash-escaped (CommonMark
    2.4; `$` for the Hub's math), so it renders as written and adds no link, image, emphasis, code or HTML."""
    return re.sub(r"([\\`*_\[\]<>!|~&$])", r"\\\1", _one_line(text))


def _cell(text: str) -> str:
    """A table cell: GFM ends a cell at any `|` not escaped, inline code included."""
    return re.sub(r"(?<!\\)\|", r"\\|", text.replace("\n", " "))


def write_card(folder, card: ModelCard) -> Path:
    """README.md in an output folder being written (ours: any input's card copied there before is replaced)."""
    path = Path(folder) / CARD_FILE
    path.write_text(card.render())
    return path


def selection_section(
    alpha: float, scores: list[dict], tied: list[float] | None = None, separation: str | None = None
) -> tuple[str, str]:
    """The section a sweep's --save-best adds: the pick and every point's scores with their intervals. `scores`: one
    {"label", "old", "new", "harmonic_mean"} per point, each value a number, plus optional "intervals": {name: [lo,
    hi]}; `separation`: how many report docs would tell the pick from its runner-up, in words."""

    def shown(point: dict, name: str) -> str:
        interval = (point.get("intervals") or {}).get(name)
        value = f"{point[name]:.4f}"
        return f"{value} [{interval[0]:.4f}, {interval[1]:.4f}]" if interval else value

    lines = [
        f"The sweep picked alpha = {alpha:g} (highest harmonic mean of old and new skills on the selection "
        "split; intervals on the report split).",
        "",
    ]
    if tied:
        told = f" ({separation})" if separation else ""
        lines += [f"Alphas the report split cannot tell from the pick: {', '.join(f'{a:g}' for a in tied)}{told}.", ""]
    lines += ["| point | old | new | harmonic mean |", "|---|---|---|---|"]
    lines += [f"| {p['label']} | {shown(p, 'old')} | {shown(p, 'new')} | {shown(p, 'harmonic_mean')} |" for p in scores]
    return "Sweep selection", "\n".join(lines)
