"""The report page's renderer (io/report_page) on hostile strings, without a browser: the JSON block reads back
unchanged and holds nothing that ends it, and every user string reaches the page as text, as Python's own HTML
parser reads the file (no element, attribute or script a payload would add)."""

import json
from html.parser import HTMLParser

from mergekit_lite.io.report_page import (
    Cell,
    Headline,
    Plot,
    Prose,
    SampleList,
    Section,
    Table,
    markdown,
    render_html,
    script_json,
)

PAYLOADS = [
    "<script>alert(1)</script>",
    '<img src=x onerror="alert(2)">',
    "</script><script>alert(3)</script>",
    "<!--",
    "a\u2028b\u2029c & d",
    "`code` **bold** [link](https://example.com)",
    "line\nbreak\tand \x1b escape",
]


class Parsed(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.data = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.data.append(data)


def test_script_json_reads_back_and_cannot_end_its_block():
    data = {"rows": PAYLOADS, "nested": [{"prompt": payload} for payload in PAYLOADS]}
    raw = str(script_json(data))
    assert json.loads(raw) == data
    for forbidden in ("<", ">", "&", "\u2028", "\u2029"):
        assert forbidden not in raw


def hostile_page(tmp_path):
    sections = [
        Section(
            "one",
            PAYLOADS[0],
            [
                Prose([f"- {payload}" for payload in PAYLOADS] + [f"`{PAYLOADS[1]}` **{PAYLOADS[0]}**"]),
                Table(
                    ["name", PAYLOADS[1]],
                    [[Cell(payload), Cell(payload, notes=((payload, True), (payload, False)))] for payload in PAYLOADS],
                    key="hostile",
                ),
                Plot("missing.png", PAYLOADS[1]),
            ],
        )
    ]
    headline = Headline(PAYLOADS[0], PAYLOADS[1], [(PAYLOADS[2], 0.5, [0.1, 0.9])], PAYLOADS[3], [PAYLOADS[0]])
    rows = [
        {"task": payload, "prompt": payload, "gold": payload, "answers": [payload], "scores": [1]}
        for payload in PAYLOADS
    ]
    samples = SampleList(rows, [PAYLOADS[1]], ["task"], "task", PAYLOADS[2], PAYLOADS[0])
    return render_html(headline, sections, tmp_path, samples)


def test_every_user_string_is_text(tmp_path):
    page = hostile_page(tmp_path)
    parsed = Parsed()
    parsed.feed(page)
    tags = {tag for tag, _ in parsed.tags}
    assert tags <= {
        "html",
        "head",
        "meta",
        "title",
        "style",
        "body",
        "header",
        "h1",
        "h2",
        "dl",
        "div",
        "dt",
        "dd",
        "span",
        "strong",
        "p",
        "nav",
        "a",
        "main",
        "section",
        "table",
        "thead",
        "tbody",
        "tr",
        "th",
        "td",
        "code",
        "figure",
        "figcaption",
        "input",
        "button",
        "script",
        "footer",
        "details",
        "summary",
    }
    assert "img" not in tags  # the plot file does not exist and the payloads add none
    assert not [attrs for _, attrs in parsed.tags if any(name.startswith("on") for name in attrs)]
    assert [attrs.get("type") for tag, attrs in parsed.tags if tag == "script"] == [
        "application/json",
        "application/json",
        None,
    ]
    assert [attrs["href"] for tag, attrs in parsed.tags if tag == "a" and not attrs["href"].startswith("#")] == []
    text = "".join(parsed.data)
    assert PAYLOADS[0] in text and PAYLOADS[1] in text  # shown as written
    assert "line\\nbreak\\tand \\x1b escape" in text  # control characters as escapes: a name stays on its line


def test_the_page_allows_only_its_own_script():
    """The Content-Security-Policy names the page's script by its hash: no other script or handler could run."""
    import base64
    import hashlib
    import re

    page = hostile_page_no_folder()
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page)[1]
    script_source = next(part for part in policy.split(";") if part.strip().startswith("script-src"))
    assert "default-src 'none'" in policy and "unsafe-inline" not in script_source
    script = page.rsplit("<script>", 1)[1].split("</script>", 1)[0]
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in policy


def hostile_page_no_folder():
    return render_html(Headline("t", "p", [], "v"), [Section("s", "S", [Prose(["x"])])], None)


def test_markdown_of_the_blocks():
    table = Table(
        ["a", "b"],
        [[Cell("1"), Cell("x", strong=True)], [Cell("2"), Cell("", notes=(("n", False), ("w", True)))]],
        "lr",
    )
    sections = [Section("t", "Title", [Prose(["- one", "- two"]), table, Plot("p.png", "plot")], level=1)]
    assert markdown(sections) == "\n".join(
        [
            "# Title",
            "",
            "- one",
            "- two",
            "",
            "| a | b |",
            "|---|---:|",
            "| 1 | **x** |",
            "| 2 | n, **w** |",
            "",
            "![plot](p.png)",
            "",
        ]
    )
