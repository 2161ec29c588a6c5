"""`sweep --pre-results / --post-results` (sweep.reuse) on folders lm-eval's own CLI wrote (--log_samples): the
report is the one evaluating pre and post gives, and a folder scored otherwise is refused in one line, exit 2,
nothing written."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from lm_eval_tasks import run_lm_eval

from cli.main import main
from mergekit_lite.sweep import SweepSettings, run_sweep

pytestmark = pytest.mark.slow
LIMIT = 16


@pytest.fixture(scope="module")
def lm_eval_folders(toy_pair, tmp_path_factory):
    """lm-eval's CLI on the toy pre and post, the sweep's two tasks, its first LIMIT docs."""
    root = tmp_path_factory.mktemp("reuse")
    tasks = [*toy_pair.old_tasks, *toy_pair.new_tasks]
    return {
        label: run_lm_eval(folder, tasks, Path(toy_pair.task_dir), root / label, limit=LIMIT)
        for label, folder in (("pre", toy_pair.pre_dir), ("post", toy_pair.post_dir))
    }


def settings(pair, out, **changes):
    options = {"limit": LIMIT, **changes}
    return SweepSettings(
        pair.pre_dir, pair.post_dir, "linear", [0.5], pair.old_tasks, pair.new_tasks, pair.task_dir, out, **options
    )


def comparable(folder: Path) -> tuple[dict, str]:
    """results.json without its settings (the reused folders are named there), and report.md without the lines
    that name the run folder."""
    results = json.loads((folder / "results.json").read_text())
    results.pop("settings")
    report = "\n".join(line for line in (folder / "report.md").read_text().splitlines() if str(folder) not in line)
    return results, report


def test_reusing_lm_eval_outputs_gives_the_report_evaluating_gives(toy_pair, lm_eval_folders, tmp_path):
    evaluated = run_sweep(settings(toy_pair, tmp_path / "evaluated"))
    reused = run_sweep(
        settings(
            toy_pair,
            tmp_path / "reused",
            pre_results=str(lm_eval_folders["pre"]),
            post_results=str(lm_eval_folders["post"]),
        )
    )
    assert sorted(evaluated.evaluated) == ["alpha=0.5", "post", "pre"]
    assert reused.evaluated == ["alpha=0.5"]  # pre and post were read, not evaluated
    assert comparable(tmp_path / "reused") == comparable(tmp_path / "evaluated")
    again = run_sweep(settings(toy_pair, tmp_path / "reused", pre_results=str(lm_eval_folders["pre"])))
    assert again.evaluated == []  # the reused endpoints are saved points: a rerun resumes them


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--limit", "8"], "docs: 8 not scored by this sweep"),
        (["--limit", str(LIMIT), "--num-fewshot", "2"], "num_fewshot 0 (this sweep: 2)"),
        (["--limit", str(LIMIT), "--metric", "acc_norm"], "--metric 'acc_norm'"),
    ],
)
def test_a_folder_scored_otherwise_is_refused_and_nothing_written(toy_pair, lm_eval_folders, tmp_path, flags, named):
    out = tmp_path / "run"
    arguments = ["sweep", "--pre", toy_pair.pre_dir, "--post", toy_pair.post_dir, "--alphas", "0.5"]
    arguments += ["--old-tasks", ",".join(toy_pair.old_tasks), "--new-tasks", ",".join(toy_pair.new_tasks)]
    arguments += ["--include-path", toy_pair.task_dir, "--pre-results", lm_eval_folders["pre"], "--out", out, *flags]
    done = CliRunner().invoke(main, [str(argument) for argument in arguments])
    assert done.exit_code == 2, done.output
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and named in line, line
    assert not out.exists()


def test_a_folder_without_a_task_of_the_sweep_is_refused(toy_pair, lm_eval_folders, tmp_path):
    from mergekit_lite.errors import InputError
    from mergekit_lite.sweep.reuse import reused_endpoints

    only_old = run_lm_eval(
        toy_pair.pre_dir, toy_pair.old_tasks, Path(toy_pair.task_dir), tmp_path / "old-only", limit=LIMIT
    )
    with pytest.raises(InputError, match=f"no samples of task\\(s\\) {toy_pair.new_tasks[0]}"):
        reused_endpoints(settings(toy_pair, tmp_path / "run", pre_results=str(only_old)))
    assert not (tmp_path / "run").exists()


def edited(folder: Path, into: Path, edit) -> Path:
    """A copy of an lm-eval output folder whose results_*.json `edit` changed (as another run's would read)."""
    import shutil

    shutil.copytree(folder, into)
    [results] = into.glob("results_*.json")
    data = json.loads(results.read_text())
    edit(data)
    results.write_text(json.dumps(data))
    return into


def _set(**values):
    return lambda data: data.update(values)


def _task_config(task: str, key: str, value):
    return lambda data: data["configs"][task].update({key: value})


@pytest.mark.parametrize(
    "edit, named",
    [
        (_set(chat_template="{{ messages }}"), "apply_chat_template True (this sweep: False)"),
        (_set(system_instruction="Be brief."), "system_instruction 'Be brief.' (this sweep: None)"),
        (
            _task_config("toy_old", "metric_list", [{"metric": "acc_norm"}]),
            "metrics ['acc_norm'] (this sweep: ['acc'])",
        ),
        (_task_config("toy_old", "filter_list", [{"name": "strict"}]), "filters ['strict'] (this sweep: [])"),
        (_task_config("toy_old", "num_fewshot", 3), "num_fewshot 3 (this sweep: 0)"),
    ],
)
def test_each_prompt_setting_of_the_results_file_is_checked(toy_pair, lm_eval_folders, tmp_path, edit, named):
    from mergekit_lite.errors import InputError
    from mergekit_lite.sweep.reuse import reused_endpoints

    folder = edited(lm_eval_folders["pre"], tmp_path / "edited", edit)
    with pytest.raises(InputError) as refused:
        reused_endpoints(settings(toy_pair, tmp_path / "run", pre_results=str(folder)))
    assert f"--pre-results {folder}: task 'toy_old' was scored differently: " in str(refused.value)
    assert named in str(refused.value)
