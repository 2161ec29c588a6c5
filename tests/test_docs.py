"""The README and docs/ stay true: every relative link resolves (file and heading), the README stays a short user
page, and every `mergekit-lite SUBCOMMAND --flag` they show names a subcommand and flags the CLI defines."""

import re
import shlex
from pathlib import Path

import click
import pytest

from mergekit_lite.cli.main import SUBCOMMANDS, main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
SHELL_STOPS = {"|", "||", "&&", ";", ">", ">>", "2>", "<"}


def prose_and_code(text: str) -> tuple[list[str], list[str]]:
    """The page's lines outside fenced code blocks, and its code blocks' lines (backslash continuations joined)."""
    prose, code, fenced, pending = [], [], False, ""
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            prose.append(line)
        elif line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            code.append(pending + line)
            pending = ""
    return prose, code


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lowercased, punctuation dropped, spaces as hyphens, -N on repeats."""
    anchors, seen = set(), {}
    for line in prose_and_code(page.read_text())[0]:
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def relative_links(page: Path) -> list[str]:
    prose = "\n".join(prose_and_code(page.read_text())[0])
    prose = INLINE_CODE.sub("", prose)
    return [target for target in LINK.findall(prose) if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


def test_docs_pages_exist():
    names = {page.name for page in PAGES if page.parent.name == "docs"}
    assert {
        "README.md",
        "methods.md",
        "mergekit.md",
        "audit.md",
        "sweep.md",
        "forgetting.md",
        "errors.md",
        "engine.md",
        "benchmarks.md",
    } <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page):
    links = relative_links(page)
    broken = []
    for link in links:
        path_part, _, anchor = link.partition("#")
        target = (page.parent / path_part).resolve() if path_part else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and (target.suffix != ".md" or anchor not in heading_anchors(target)):
            broken.append(f"{link}: no heading with anchor #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_readme_links_every_docs_page():
    linked = {(ROOT / link.partition("#")[0]).resolve() for link in relative_links(ROOT / "README.md")}
    assert {page.resolve() for page in PAGES if page.parent.name == "docs"} <= linked


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def command_options(command: click.Command) -> set[str]:
    options = {"--help", "-h"}
    for parameter in command.params:
        if isinstance(parameter, click.Option):
            options.update(parameter.opts + parameter.secondary_opts)
    return options


def subcommand_options() -> dict[str, set[str]]:
    """Each subcommand's option names, read from the click commands themselves (`audit fingerprint` apart)."""
    context = click.Context(main)
    options = {}
    for name in SUBCOMMANDS:
        command = main.get_command(context, name)
        if isinstance(command, click.Group):
            options[name] = command_options(command.default_command)
            for sub_name, sub_command in command.commands.items():
                options[f"{name} {sub_name}"] = command_options(sub_command)
        else:
            options[name] = command_options(command)
    return options


def words(snippet: str) -> list[str]:
    """A shell line's words; a prose snippet that shlex cannot split (an apostrophe) is split on spaces."""
    try:
        return shlex.split(snippet, comments=True, posix=True)
    except ValueError:
        return [word.strip("'\"(),;") for word in snippet.split()]


def invocations(page: Path) -> list[tuple[str, list[str], bool]]:
    """Every `mergekit-lite SUB ...` on a page: (subcommand, its words up to a shell operator, in a code block)."""
    prose, code = prose_and_code(page.read_text())
    snippets = [(line, True) for line in code]
    snippets += [(span, False) for line in prose for span in INLINE_CODE.findall(line) if "mergekit-lite " in span]
    found = []
    for snippet, in_code_block in snippets:
        tokens = words(snippet)
        for index, token in enumerate(tokens):
            if token != "mergekit-lite" and not token.endswith("/mergekit-lite"):
                continue
            rest = []
            for word in tokens[index + 1 :]:
                if word in SHELL_STOPS:
                    break
                rest.append(word)
            if rest:
                found.append((rest[0], rest[1:], in_code_block))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_commands_name_real_subcommands_and_flags(page):
    options = subcommand_options()
    wrong = []
    for subcommand, arguments, in_code_block in invocations(page):
        if subcommand not in SUBCOMMANDS:
            if in_code_block and not subcommand.startswith("-"):
                wrong.append(f"unknown subcommand {subcommand!r}")
            continue
        if arguments and f"{subcommand} {arguments[0]}" in options:
            subcommand, arguments = f"{subcommand} {arguments[0]}", arguments[1:]
        flags = [word.split("=")[0] for word in arguments if word.startswith("-") and not re.match(r"^-\d|^-$", word)]
        wrong += [f"mergekit-lite {subcommand}: no option {flag}" for flag in flags if flag not in options[subcommand]]
    assert not wrong, f"{page.relative_to(ROOT)}: {wrong}"


def test_command_check_sees_the_readme_examples():
    """The check above is not vacuous: the README shows every subcommand in a code block."""
    shown = {subcommand for subcommand, _, in_code_block in invocations(ROOT / "README.md") if in_code_block}
    assert set(SUBCOMMANDS) <= shown
