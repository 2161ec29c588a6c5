"""A report as plain data, and the two renderers that read it: Markdown lines and one self-contained HTML page.

A report is a list of sections, each a title and blocks (prose, tables, plots); the Markdown renderer writes each
block's lines and the HTML renderer (Jinja2, autoescaped) the same blocks as elements, so the two cannot disagree.
The page opens from a disk, a shared drive or a Hub repo: no network, no file it links to. Plots are PNG data
URIs, the style and the script are inlined, and a sample list travels as a JSON script block that the script
renders row by row with textContent, a page at a time (no markup is ever built from a user string). I/O only:
the callers say what the sections hold; nothing here knows a merge method or a score.

Escaping (the model card's rules, io/model_card.py, for HTML): every user string reaches the page through
autoescape or textContent, control characters shown as Python escapes so a name stays on its line; the JSON
block escapes `<`, `>`, `&` and the JavaScript line separators, so no `</script>` in a doc can end it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from markupsafe import Markup, escape

from mergekit_lite.io.model_card import _one_line

TEMPLATES = Path(__file__).with_name("templates")
PAGE_TEMPLATE = "report.html.j2"


@dataclass(frozen=True)
class Cell:
    """One table cell: its text, the value its column sorts by (None: the text), shown in bold, linked, or a
    list of notes (text, bold) joined by commas."""

    text: str
    sort: float | str | None = None
    strong: bool = False
    link: str | None = None
    notes: tuple[tuple[str, bool], ...] | None = None

    def markdown(self) -> str:
        if self.notes is not None:
            return ", ".join(f"**{text}**" if strong else text for text, strong in self.notes)
        text = f"[{self.text}]({self.link})" if self.link else self.text
        return f"**{text}**" if self.strong else text


def number(value: float | None, spec: str = ".4f", empty: str = "-") -> Cell:
    """A numeric cell sorted by its value (missing values sort first)."""
    return Cell(empty if value is None else format(value, spec), None if value is None else float(value))


@dataclass
class Table:
    """A table: header, rows of cells, the alignment of each column ("l" or "r"). `markdown_text` is the
    Markdown that stands for it where the report prints a padded plain-text table (evaluate.forgetting's)."""

    columns: list[str]
    rows: list[list[Cell]]
    align: str = ""
    markdown_text: str | None = None
    caption: str = ""
    key: str = ""  # what names the table in the page (data-table), for tools and tests
    markdown_header: str | None = None  # the Markdown header line where it is not the columns joined

    def markdown(self) -> list[str]:
        if self.markdown_text is not None:
            return self.markdown_text.split("\n")
        align = self.align or "l" * len(self.columns)
        return [
            self.markdown_header or "| " + " | ".join(self.columns) + " |",
            "|" + "".join("---:|" if side == "r" else "---|" for side in align),
            *("| " + " | ".join(cell.markdown() for cell in row) + " |" for row in self.rows),
        ]


@dataclass
class Prose:
    """Markdown lines (sentences, bullets; `**bold**` and `code` the only marks): the page shows them escaped,
    the marks as elements."""

    lines: list[str]
    fold: str | None = None  # the page folds these lines under this summary (a glossary, say)

    def markdown(self) -> list[str]:
        return list(self.lines)


@dataclass
class Plot:
    """A PNG in the run folder: linked by Markdown, inlined as a data URI by the page."""

    file: str
    alt: str

    def markdown(self) -> list[str]:
        return [f"![{self.alt}]({self.file})"]


@dataclass
class Section:
    """A heading (level 1 or 2; none for a section that continues the one above) and its blocks. `key` names it
    in the page (the element's id), so readers and tests find it whatever its title."""

    key: str
    title: str | None
    blocks: list[Prose | Table | Plot] = field(default_factory=list)
    level: int = 2

    def markdown(self) -> list[str]:
        lines = [f"{'#' * self.level} {self.title}", ""] if self.title else []
        for block in self.blocks:
            lines += [*block.markdown(), ""]
        return lines


@dataclass
class Headline:
    """What the page says first: the pick, its scores with intervals, and the verdict in a sentence."""

    title: str
    pick: str
    scores: list[tuple[str, float, list[float] | None]]  # name, value, [low, high] or None
    verdict: str
    warnings: list[str] = field(default_factory=list)
    facts: list[tuple[str, str]] = field(default_factory=list)  # (label, text) lines under it: models, tasks
    pick_label: str = "pick"  # what the first line names: a sweep's pick, the models a map compares


@dataclass
class SampleList:
    """Every sample row (as the JSONL beside the page holds them) and how the page lists them: the filter fields,
    the model names of `scores`/`answers`, and the field that names each row's class."""

    rows: list[dict]
    models: list[str]
    filters: list[str]
    kind: str  # the field the page colours a row by (class, outcome)
    file: str = ""
    note: str = ""


def markdown(sections: list[Section]) -> str:
    """The sections as one Markdown document: each block's lines, a blank line after each."""
    return "\n".join(line for section in sections for line in section.markdown())


# --- HTML -------------------------------------------------------------------------------------------------

_CODE = re.compile(r"`+([^`]*?)`+")
_STRONG = re.compile(r"\*\*(.+?)\*\*")
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


def text(value) -> str:
    """A user string for the page: control characters as escapes (a name stays on its line); the template
    escapes the rest."""
    return _one_line("" if value is None else value)


def inline(line: str) -> Markup:
    """One Markdown line as HTML: everything escaped, then code spans and bold (the only marks the report's
    prose uses) as elements, links as their text. A user string inside a code span stays code."""
    parts, position = [], 0
    for match in _CODE.finditer(line):
        parts.append(_strong(line[position : match.start()]))
        parts.append(Markup("<code>{}</code>").format(text(match.group(1))))
        position = match.end()
    parts.append(_strong(line[position:]))
    return Markup("").join(parts)


def _strong(segment: str) -> Markup:
    segment = _LINK.sub(r"\1", segment)
    out, position = [], 0
    for match in _STRONG.finditer(segment):
        out += [escape(text(segment[position : match.start()])), Markup("<strong>{}</strong>").format(text(match[1]))]
        position = match.end()
    out.append(escape(text(segment[position:])))
    return Markup("").join(out)


def prose_items(prose: Prose) -> list[tuple[str, int, Markup]]:
    """Prose as ("p" | "li", depth, html) items: bullets (two spaces per level) and paragraphs."""
    items = []
    for line in prose.lines:
        if not line.strip():
            continue
        bullet = re.match(r"^( *)- (.*)$", line)
        if bullet:
            items.append(("li", len(bullet[1]) // 2, inline(bullet[2])))
        else:
            items.append(("p", 0, inline(line)))
    return items


def page_link(link: str) -> str:
    """A link of the Markdown report as the page gives it: another report's page rather than its Markdown."""
    return link[: -len(".md")] + ".html" if link.endswith("report.md") else link


def data_uri(path: Path) -> str | None:
    """A PNG as a data URI, None when the file is not there."""
    if not path.is_file():
        return None
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def script_json(data) -> Markup:
    """JSON for a <script type="application/json"> block: `<`, `>`, `&` and U+2028/9 as \\u escapes, so no text in
    it (`</script>`, `<!--`) can end the block or start markup; JSON.parse reads it back unchanged."""
    raw = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for char in "<>&\u2028\u2029":
        raw = raw.replace(char, f"\\u{ord(char):04x}")
    return Markup(raw)


def _environment():
    from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

    environment = Environment(
        loader=FileSystemLoader(TEMPLATES),
        autoescape=select_autoescape(["html", "j2"], default_for_string=True, default=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters["text"] = text
    environment.filters["page_link"] = page_link
    environment.filters["inline"] = inline
    environment.globals.update(prose_items=prose_items, isinstance=isinstance, Prose=Prose, Table=Table, Plot=Plot)
    return environment


def render_html(
    headline: Headline,
    sections: list[Section],
    folder: Path | None,
    samples: SampleList | None = None,
    plots: dict[str, Path] | None = None,
) -> str:
    """The page: the headline, every section (plots read from `folder`, or from `plots` by file name), the sample
    browser. Deterministic: the same inputs give the same bytes."""
    environment = _environment()
    images = {}
    for section in sections:
        for block in section.blocks:
            if isinstance(block, Plot):
                source = (plots or {}).get(block.file) or (folder / block.file if folder is not None else None)
                images[block.file] = data_uri(source) if source is not None else None
    style = (TEMPLATES / "report.css").read_text()
    script = (TEMPLATES / "report.js").read_text()
    sample_config = None
    if samples is not None:
        sample_config = {
            "models": samples.models,
            "filters": samples.filters,
            "kind": samples.kind,
            "file": samples.file,
        }
    return environment.get_template(PAGE_TEMPLATE).render(
        script_hash=f"sha256-{base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()}",
        headline=headline,
        sections=sections,
        images=images,
        style=Markup(style),
        script=Markup(script),
        samples=samples,
        sample_config=script_json(sample_config) if sample_config else None,
        sample_rows=script_json(samples.rows) if samples is not None else None,
    )
