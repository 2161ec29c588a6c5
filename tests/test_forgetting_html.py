"""`forgetting --html` and `drift --html` in headless Chromium: the pages of lm-eval's own logs of the toy pre, post
and post-training's step-25 checkpoint (`lm_eval_runs`, `lm_eval_checkpoint`), read as the browser renders them:
the map's rows against `--json`, one sample row per `--samples` line reached by paging, no console error, no
request outside the file; and drift's table against `drift --json`."""

import json

import pytest
from browser import browser, console_errors, open_page
from click.testing import CliRunner

from mergekit_lite.cli.main import main

pytestmark = pytest.mark.slow


def run(*args):
    result = CliRunner().invoke(main, [*map(str, args)])
    assert result.exit_code == 0, result.output
    return result


def every_sample_row(driver) -> list[int]:
    reached = []
    while True:
        reached += driver.execute_script(
            "return [...document.querySelectorAll('#sample-body tr.sample')].map(r => +r.dataset.row)"
        )
        following = driver.find_element("id", "sample-next")
        if not following.is_enabled():
            return reached
        following.click()


@pytest.mark.parametrize("checkpoints", [False, True], ids=["two-models", "checkpoints"])
def test_the_forgetting_page(lm_eval_runs, lm_eval_checkpoint, tmp_path, checkpoints):
    inputs = [lm_eval_runs.pre, *([lm_eval_checkpoint] if checkpoints else []), lm_eval_runs.post]
    groups = ["--group", "old=toy_old", "--group", "new=toy_new"]
    page, samples = tmp_path / "forgetting.html", tmp_path / "samples.jsonl"
    run("forgetting", *inputs, *groups, "--html", page, "--samples", samples, "-q")
    printed = json.loads(run("forgetting", *inputs, *groups, "--json", "-q").stdout)
    tasks = printed["rows"] if checkpoints else [{"tasks": printed["tasks"], "groups": printed["groups"]}]
    lines = samples.read_text().splitlines()
    with browser() as driver:
        requests = open_page(driver, page)
        assert [url for url in requests if url != page.as_uri() and not url.startswith("data:")] == []
        count = "return document.querySelectorAll('table[data-table=\"{}\"] tbody tr').length"
        assert driver.execute_script(count.format("tasks")) == sum(len(entry["tasks"]) for entry in tasks)
        assert driver.execute_script(count.format("groups")) == sum(len(entry["groups"]) for entry in tasks)
        assert sorted(every_sample_row(driver)) == list(range(len(lines)))
        assert console_errors(driver) == []
        driver.save_screenshot(str(tmp_path / "forgetting.png"))


def test_the_drift_page(toy_pair, tmp_path):
    page = tmp_path / "drift.html"
    run("drift", toy_pair.pre_dir, toy_pair.post_dir, "--html", page, "-q")
    printed = json.loads(run("drift", toy_pair.pre_dir, toy_pair.post_dir, "--json").stdout)
    with browser() as driver:
        requests = open_page(driver, page)
        assert [url for url in requests if url != page.as_uri() and not url.startswith("data:")] == []
        rows = driver.execute_script("return document.querySelectorAll('table[data-table=\"drift\"] tbody tr').length")
        assert rows == len(printed["layers"]) + bool(printed["outside_layers"])
        assert driver.execute_script("return document.querySelectorAll('img[src^=\"data:image/png\"]').length") == 1
        assert console_errors(driver) == []
