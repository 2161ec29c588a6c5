"""report.html at scale: the page's size and how long headless Chromium takes to render it with N sample rows
(samples.jsonl's shape: prompt, gold, three models' answers and scores), to switch a filter and to turn a page.

    python benchmarks/bench_report_html.py --samples 10000 [--samples 1000 ...]

Prints one JSON line per size (bytes, render ms, filter ms, next-page ms, rows in the first page). Needs chromium,
chromedriver and selenium (the test extra); the numbers in benchmarks/RESULTS.md come from it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from browser import browser  # noqa: E402

from mergekit_lite.io.report_page import Cell, Headline, SampleList, Section, Table, render_html  # noqa: E402
from mergekit_lite.sweep.samples import CLASSES  # noqa: E402

WORDS = "the coat of a an is what which color shade animal river town name old new".split()


def sample(index: int, rng: random.Random) -> dict:
    pre, post, pick = (rng.random() < share for share in (0.8, 0.6, 0.75))
    task = f"task_{index % 8}"
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))
    answers = [rng.choice(WORDS) for _ in range(3)]
    return {
        "task": task,
        "doc_id": index // 8,
        "doc_hash": f"{rng.getrandbits(128):032x}",
        "key": f"{index:08x}",
        "split": "report" if rng.random() < 0.5 else "selection",
        "class": CLASSES[pre, post, pick],
        "models": ["pre", "post", "alpha=0.5"],
        "seed": "-",
        "scores": [int(pre), int(post), int(pick)],
        "prompt": prompt,
        "gold": rng.choice(WORDS),
        "answers": answers,
        "answer_rule": "the option of highest loglikelihood (acc)",
        "completion": " " + answers[0],
        "group": "old" if index % 8 < 4 else "new",
    }


def page(n: int) -> str:
    rng = random.Random(0)
    rows = [sample(index, rng) for index in range(n)]
    table = Table(["alpha", "harmonic mean"], [[Cell(f"{a:g}", a), Cell(f"{a:.4f}", a)] for a in (0.1, 0.5, 0.9)])
    headline = Headline("Sweep at scale", "alpha = 0.5", [("harmonic mean", 0.9, [0.8, 0.95])], "A verdict.")
    samples = SampleList(rows, ["pre", "post", "alpha=0.5"], ["class", "task", "group", "split"], "class")
    return render_html(headline, [Section("scores", "Scores", [table])], None, samples)


def measure(n: int, driver) -> dict:
    started = time.perf_counter()
    html = page(n)
    build = time.perf_counter() - started
    path = Path(tempfile.mkdtemp()) / "report.html"
    path.write_text(html)
    started = time.perf_counter()
    driver.get(path.as_uri())
    shown = driver.execute_script("return document.querySelectorAll('#sample-body tr.sample').length")
    render = time.perf_counter() - started
    timing = driver.execute_script(
        "const t = performance.getEntriesByType('navigation')[0]; return [t.domContentLoadedEventEnd, t.loadEventEnd]"
    )
    started = time.perf_counter()
    driver.execute_script(
        "const s = document.querySelector(\"select[data-filter='class']\"); s.value = 'recovered';"
        "s.dispatchEvent(new Event('change'));"
    )
    filtered = time.perf_counter() - started
    started = time.perf_counter()
    driver.find_element("id", "sample-next").click()
    turned = time.perf_counter() - started
    return {
        "samples": n,
        "bytes": len(html.encode()),
        "build_s": round(build, 3),
        "open_to_first_page_ms": round(render * 1000),
        "dom_content_loaded_ms": round(timing[0]),
        "load_event_ms": round(timing[1]),
        "filter_ms": round(filtered * 1000),
        "next_page_ms": round(turned * 1000),
        "rows_shown": shown,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, action="append", help="sample rows (repeatable; default 10000)")
    sizes = parser.parse_args().samples or [10000]
    with browser() as driver:
        for n in sizes:
            print(json.dumps(measure(n, driver)))


if __name__ == "__main__":
    main()
