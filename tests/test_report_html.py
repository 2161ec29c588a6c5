"""report.html in headless Chromium: a real sweep of the toy pair whose old task's docs and pre's folder name carry
HTML payloads (a script element, an event attribute, a `</script>` that would close the data block). The page is
read as the browser renders it: its tables and their row counts against results.json, every samples.jsonl line
reachable through the filters, no console error, no request outside the file, and no element or attribute a
payload would create; a screenshot stays in the test's run folder."""

import json
import shutil
from html.parser import HTMLParser

import pytest
import yaml
from browser import browser, console_errors, open_page

from mergekit_lite.sweep import SweepSettings, run_sweep

pytestmark = pytest.mark.slow

SCRIPT = "<script>document.body.setAttribute('data-pwned', 'script')</script>"
ATTRIBUTE = "<img src=x onerror=\"document.body.setAttribute('data-pwned', 'onerror')\">"
BREAKOUT = "</script><script>window.pwned = 'breakout'</script><!--"
PAYLOADS = (SCRIPT, ATTRIBUTE, BREAKOUT)


def hostile_tasks(task_dir, folder):
    """The toy tasks, with payloads in the first docs' questions and in a gold answer of the old task."""
    folder.mkdir()
    for config_file in task_dir.glob("*.yaml"):
        config = yaml.safe_load(config_file.read_text())
        data = task_dir / f"{config['task']}.jsonl"
        docs = [json.loads(line) for line in data.read_text().splitlines()]
        if config["task"] == "toy_old":
            for index, payload in enumerate(PAYLOADS):
                docs[index]["question"] = f"{payload} {docs[index]['question']}"
            docs[0]["choices"][docs[0]["label"]] += f" {ATTRIBUTE}"
        (folder / data.name).write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        config["dataset_kwargs"]["data_files"]["test"] = str(folder / data.name)
        (folder / config_file.name).write_text(yaml.safe_dump(config, sort_keys=False))
    return folder


@pytest.fixture(scope="module")
def sweep(toy_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("report-html")
    pre = root / f"pre {ATTRIBUTE}"
    shutil.copytree(toy_pair.pre_dir, pre)
    tasks = hostile_tasks(toy_pair.task_dir, root / "tasks")
    settings = SweepSettings(
        str(pre),
        str(toy_pair.post_dir),
        "linear",
        [0.3, 0.7],
        toy_pair.old_tasks,
        toy_pair.new_tasks,
        str(tasks),
        str(root / "run"),
        limit=24,
    )
    return run_sweep(settings)


class Elements(HTMLParser):
    """Every start tag of a page with its attributes, as an HTML parser reads the file."""

    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_the_file_holds_no_element_or_attribute_of_a_payload(sweep):
    page = (sweep.out / "report.html").read_text()
    parser = Elements()
    parser.feed(page)
    scripts = [attrs for tag, attrs in parser.tags if tag == "script"]
    assert [attrs.get("type") for attrs in scripts] == ["application/json", "application/json", None]
    assert not [attrs for _, attrs in parser.tags if any(name.startswith("on") for name in attrs)]
    assert all(attrs["src"].startswith("data:image/png;base64,") for tag, attrs in parser.tags if tag == "img")
    assert not [attrs for _, attrs in parser.tags if {"href", "src"} & set(attrs) and tag_link(attrs)]


def tag_link(attrs: dict) -> bool:
    """A link or source that leaves the file: anything but a data URI, an anchor on the page or a sibling report."""
    target = attrs.get("src") or attrs.get("href")
    return not (target.startswith(("data:", "#")) or target.endswith("report.html"))


def test_the_page_in_chromium(sweep):
    folder = sweep.out
    results = json.loads((folder / "results.json").read_text())
    lines = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    with browser() as driver:
        requests = open_page(driver, folder / "report.html")
        page_url = (folder / "report.html").resolve().as_uri()
        assert page_url in requests and any(url.startswith("data:image/png") for url in requests)
        assert [url for url in requests if url != page_url and not url.startswith("data:")] == []
        assert driver.execute_script("return performance.getEntriesByType('resource').length") == 0

        def rows(key):
            return driver.execute_script(
                f"return document.querySelectorAll('table[data-table=\"{key}\"] tbody tr').length"
            )

        assert rows("scores") == len(results["points"]) + 2
        assert rows("map-post") == len(results["post"]["forgetting"]["tasks"])
        assert rows("map-post-groups") == 2
        samples = results["samples"]
        assert rows("samples") == len(samples["counts"]) + len(samples["groups"])
        pick = driver.find_element("id", "pick").text
        assert pick == f"alpha = {results['pick']['alpha']!r}"

        # every line of samples.jsonl once per class, and the classes' counts add up to the file
        reached = set()
        select = driver.find_element("css selector", "select[data-filter='class']")
        values = [option.get_attribute("value") for option in select.find_elements("tag name", "option")][1:]
        assert sorted(values) == sorted({line["class"] for line in lines})
        for value in values:
            driver.execute_script(
                "const s = arguments[0]; s.value = arguments[1]; s.dispatchEvent(new Event('change'));", select, value
            )
            while True:
                shown = driver.execute_script(
                    "return [...document.querySelectorAll('#sample-body tr.sample')].map(r => +r.dataset.row)"
                )
                assert all(lines[index]["class"] == value for index in shown)
                reached |= set(shown)
                following = driver.find_element("id", "sample-next")
                if not following.is_enabled():
                    break
                following.click()
        assert reached == set(range(len(lines)))

        # a payload is text: the search finds its doc, whose details show it as written
        driver.execute_script("const s = arguments[0]; s.value = ''; s.dispatchEvent(new Event('change'));", select)
        search = driver.find_element("id", "sample-search")
        search.send_keys("pwned")
        found = driver.find_elements("css selector", "#sample-body tr.sample")
        assert len(found) == len(PAYLOADS)
        found[0].click()
        details = driver.find_element("css selector", "#sample-body tr.detail").text
        assert any(payload in details for payload in PAYLOADS)
        assert ATTRIBUTE in driver.find_element("css selector", ".facts").text  # pre's folder name, as text

        assert driver.execute_script("return document.body.getAttribute('data-pwned')") is None
        assert driver.execute_script("return window.pwned === undefined")
        assert driver.execute_script("return document.querySelectorAll('[onerror]').length") == 0
        assert driver.execute_script("return document.querySelectorAll('img:not([src^=\"data:\"])').length") == 0
        assert driver.execute_script("return document.scripts.length") == 3
        assert console_errors(driver) == []

        # sorting a table by a numeric column orders its rows by value
        header = driver.find_elements("css selector", "table[data-table='scores'] thead th")[4]
        header.click()
        values = driver.execute_script(
            "return [...document.querySelectorAll('table[data-table=\"scores\"] tbody tr')]"
            ".map(r => +r.cells[4].dataset.sort)"
        )
        assert values == sorted(values)
        driver.execute_script("window.scrollTo(0, 0)")
        height = driver.execute_script("return document.body.scrollHeight")
        driver.set_window_size(1400, min(height, 6000))
        assert driver.save_screenshot(str(folder / "report.png"))


class Tables(HTMLParser):
    """The cell texts of each table of a page with a data-table key, as the file holds them."""

    def __init__(self):
        super().__init__()
        self.tables, self.current, self.cell = {}, None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table" and "data-table" in attrs:
            self.current = self.tables.setdefault(attrs["data-table"], [])
        elif tag == "tr" and self.current is not None:
            self.current.append([])
        elif tag in ("td", "th") and self.current is not None:
            self.cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            self.current[-1].append("".join(self.cell).strip())
            self.cell = None
        elif tag == "table":
            self.current = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def test_the_page_and_report_md_show_the_same_table(sweep):
    """The score table of report.md, cell by cell, is the page's (bold marks aside)."""
    parser = Tables()
    parser.feed((sweep.out / "report.html").read_text())
    lines = (sweep.out / "report.md").read_text().splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("| alpha | HM (selection)"))
    markdown = [line for line in lines[start:] if line.startswith("|")]
    markdown = [markdown[0]] + markdown[2 : 2 + len(parser.tables["scores"]) - 1]
    cells = [[cell.strip().replace("**", "") for cell in line.strip("|").split(" | ")] for line in markdown]
    assert cells == parser.tables["scores"]
