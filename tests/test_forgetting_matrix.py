"""The example-forgetting matrix (`forgetting --matrix`), its prediction for a new fine-tune (`--history`) and the
replay set chosen from it, on lm-eval-shaped logs whose matrix is known by construction: R^2 by rank against
numpy's SVD with the authors' R^2 (fit_utils.r2_score), completion that must recover a held-out row of a block
structure, replay counts and softmax weights (scipy's softmax)."""

import json

import numpy as np
import pytest
from click.testing import CliRunner
from scipy.special import softmax

from mergekit_lite.cli.main import main
from mergekit_lite.evaluate.matrix import auc, select_replay

STAMP = "2024-05-01T12-00-00.123456"
DOCS, FORGETTABLE = 120, 96  # the pre gets docs 0..95 right
BLOCK_A, BLOCK_B = range(0, 30), range(40, 70)


def record(doc: int, correct: bool, gold_ll: float) -> dict:
    """A 4-choice record as lm-eval 0.4 writes it: the gold option is 0; log-likelihoods logged as strings."""
    lls = [gold_ll, gold_ll - 1.0, gold_ll - 2.0, gold_ll + (1.0 if not correct else -3.0)]
    arguments = {f"gen_args_{i}": {"arg_0": f"Question {doc}?", "arg_1": f" option {i}"} for i in range(4)}
    return {
        "doc_id": doc,
        "doc_hash": f"h{doc}",
        "target": "0",
        "arguments": arguments,
        "resps": [[[repr(ll), "False"]] for ll in lls],
        "filtered_resps": [[repr(ll), "False"] for ll in lls],
        "acc": float(correct),
        "filter": "none",
        "metrics": ["acc"],
    }


def write_run(folder, correct, gold_lls=None, docs=None, task="old"):
    """One model's lm-eval output folder: samples_<task>_<stamp>.jsonl over `docs` (default: all)."""
    folder.mkdir(parents=True)
    docs = range(len(correct)) if docs is None else docs
    lls = gold_lls if gold_lls is not None else np.zeros(len(correct))
    lines = [json.dumps(record(doc, bool(correct[doc]), float(lls[doc]))) for doc in docs]
    (folder / f"samples_{task}_{STAMP}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def run_cli(*args):
    return CliRunner().invoke(main, ["forgetting", *map(str, args)])


def pre_correct() -> np.ndarray:
    return np.arange(DOCS) < FORGETTABLE


def post_forgetting(forgotten) -> np.ndarray:
    correct = pre_correct().copy()
    correct[list(forgotten)] = False
    return correct


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    """Eight fine-tunes: four forget docs 0..29, four forget docs 40..69, each with one doc of its own."""
    root = tmp_path_factory.mktemp("blocks")
    pre = write_run(root / "pre", pre_correct())
    posts = []
    for index in range(8):
        block = list(BLOCK_A if index < 4 else BLOCK_B)
        posts.append(write_run(root / f"ft{index}", post_forgetting(block + [80 + index])))
    out = root / "history"
    result = run_cli(pre, *posts, "--matrix", out, "--known", 10, "--known", 30, "--json")
    assert result.exit_code == 0, result.output
    return root, pre, posts, out, json.loads(result.stdout)


def test_r2_by_rank_equals_numpy_svd_on_a_rank_three_logprob_matrix(tmp_path):
    rng = np.random.default_rng(0)
    drops = rng.normal(size=(7, 3)) @ rng.normal(size=(3, DOCS)) + 0.05 * rng.normal(size=(7, DOCS))
    pre_ll = -rng.uniform(1, 5, DOCS)
    pre = write_run(tmp_path / "pre", pre_correct(), pre_ll)
    posts = [write_run(tmp_path / f"ft{i}", pre_correct(), pre_ll - drops[i]) for i in range(7)]
    result = run_cli(pre, *posts, "--matrix", tmp_path / "out", "--value", "logprob", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    z = np.load(tmp_path / "out" / "matrix.npz")["z"]
    assert z.dtype == np.float32 and z.shape == (7, DOCS)
    np.testing.assert_allclose(z, drops, atol=1e-5)
    u, s, vh = np.linalg.svd(z.astype(np.float64), full_matrices=False)
    expected = []
    for rank in range(1, 8):
        fit = u[:, :rank] * s[:rank] @ vh[:rank]
        expected.append(1 - ((z - fit) ** 2).mean() / ((z - z.mean()) ** 2).mean())
    np.testing.assert_allclose(payload["r2_by_rank"], expected, atol=1e-9)
    assert payload["r2_by_rank"][2] > 0.99 > payload["r2_by_rank"][0]
    assert payload["value"] == "logprob" and payload["rows"] == [str(post) for post in posts]
    rmse = {name: row["rmse"] for name, row in payload["completion"][0]["methods"].items()}
    assert rmse["mf"] < 0.5 * rmse["per-doc mean"] and rmse["mf"] < 0.5 * rmse["random"]
    truth = rng.normal(size=3) @ drops[:3]  # a new fine-tune: a mix of the history's rows
    new = write_run(tmp_path / "new", pre_correct(), pre_ll - truth, docs=range(0, DOCS, 3))
    samples = tmp_path / "samples.jsonl"
    result = run_cli(pre, new, "--history", tmp_path / "out", "--samples", samples, "--predictor", "mf")
    assert result.exit_code == 0, result.output
    assert f"predicted by mf: {DOCS // 3} docs observed, {DOCS - DOCS // 3} predicted" in result.stdout
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert all("p_forgotten" not in row and row["predicted"] is (row["doc_id"] % 3 != 0) for row in rows)
    predicted = np.array([row["logprob_drop"] for row in rows])
    hidden = np.arange(DOCS) % 3 != 0
    assert np.sqrt(np.mean((predicted - truth)[hidden] ** 2)) < 0.2 * truth[hidden].std()


def test_the_block_matrix_is_written_whole(blocks):
    _, _, posts, out, payload = blocks
    z = np.load(out / "matrix.npz")["z"]
    expected = np.array(
        [np.isin(np.arange(DOCS), list(BLOCK_A if i < 4 else BLOCK_B) + [80 + i]) for i in range(8)], dtype=np.float32
    )
    np.testing.assert_array_equal(z, expected)
    assert payload["docs"] == {"count": DOCS, "forgettable": FORGETTABLE, "per_task": {"old": DOCS}}
    for name in ("matrix.png", "rank.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(payload["r2_by_rank"]) == 8 and payload["r2_by_rank"][1] > 0.9 > payload["r2_by_rank"][0] - 0.5


def test_completion_recovers_the_blocks_where_additive_and_the_baselines_cannot(blocks):
    tables = {table["known"]: table for table in blocks[4]["completion"]}
    assert sorted(tables) == [10, 30]
    for table in tables.values():
        methods = table["methods"]
        assert table["best"] in ("knn", "mf") and table["metric"] == "f1"
        for name in ("knn", "mf"):
            assert methods[name]["f1"] > 0.9 and methods[name]["auc"] > 0.95, (name, methods[name])
        assert methods["per-doc mean"]["f1"] < 0.5 and methods["random"]["f1"] < 0.5
        assert methods["additive"]["f1"] < methods["knn"]["f1"] - 0.2


def test_prediction_for_a_new_fine_tune_fills_the_unobserved_docs(blocks, tmp_path):
    root, pre, _, history, _ = blocks
    observed = list(range(0, DOCS, 4))  # a probe run over a quarter of the docs
    new = write_run(tmp_path / "new", post_forgetting(BLOCK_A), docs=observed)
    samples = tmp_path / "samples.jsonl"
    result = run_cli(pre, new, "--history", history, "--samples", samples, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["observed"] == len(observed) and report["predicted"] == DOCS - len(observed)
    assert report["method"] == blocks[4]["completion"][0]["best"]
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [row["doc_id"] for row in rows] == list(range(DOCS))
    for row in rows:
        assert row["predicted"] is (row["doc_id"] not in observed)
        forgotten = row["doc_id"] in BLOCK_A
        if row["predicted"] and row["pre_correct"]:
            assert (row["p_forgotten"] > 0.5) is forgotten, row
        elif not row["predicted"]:
            assert row["p_forgotten"] == float(forgotten)
        else:
            assert row["p_forgotten"] == 0.0  # pre was wrong: nothing to forget
    assert report["observed_forgotten"] == len([doc for doc in observed if doc in BLOCK_A])


@pytest.mark.parametrize("strategy", ["top", "sample", "random"])
def test_replay_writes_the_budget_as_trl_records(blocks, tmp_path, strategy):
    _, pre, _, history, _ = blocks
    new = write_run(tmp_path / "new", post_forgetting(BLOCK_B), docs=range(0, DOCS, 4))
    replay = tmp_path / "replay.jsonl"
    result = run_cli(
        pre, new, "--history", history, "--replay", replay, "--replay-budget", 20, "--replay-strategy", strategy
    )
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in replay.read_text().splitlines()]
    chosen = [record["doc_id"] for record in records]
    assert len(chosen) == len(set(chosen)) == 20 and all(doc < FORGETTABLE for doc in chosen)
    assert all(
        record["prompt"] == f"Question {record['doc_id']}?" and record["completion"] == " option 0"
        for record in records
    )
    in_block = sum(doc in BLOCK_B for doc in chosen)
    expected = {"top": (20, 20), "sample": (18, 20), "random": (0, 14)}[strategy]
    assert expected[0] <= in_block <= expected[1], chosen
    assert f"replay: 20 docs of {FORGETTABLE} candidates chosen by {strategy}" in result.stderr


def test_replay_weights_are_the_softmax_and_the_draw_follows_them():
    scores = np.array([0.9, 0.8, 0.5, 0.1, 0.0, 0.0])
    selection = select_replay(scores, 3, "sample", temperature=0.1, seed=0)
    np.testing.assert_allclose(selection.weights, softmax(scores / 0.1))
    assert len(set(selection.chosen.tolist())) == 3
    firsts = (
        np.bincount([select_replay(scores, 1, "sample", 0.5, seed).chosen[0] for seed in range(4000)], minlength=6)
        / 4000
    )
    np.testing.assert_allclose(firsts, softmax(scores / 0.5), atol=0.025)  # budget 1: one draw by the weights
    assert select_replay(scores, 2, "top").chosen.tolist() == [0, 1]
    assert select_replay(scores, 6, "random", seed=3).chosen.tolist() != list(range(6))


def test_auc_matches_the_pairwise_definition():
    rng = np.random.default_rng(1)
    truth, scores = rng.random(300) < 0.3, rng.integers(0, 5, 300).astype(float)
    pairs = [(p > n) + 0.5 * (p == n) for p in scores[truth] for n in scores[~truth]]
    assert auc(truth, scores) == pytest.approx(np.mean(pairs))


def test_bad_input_is_one_line_exit_2(blocks, tmp_path):
    root, pre, posts, history, _ = blocks
    short = write_run(tmp_path / "short", pre_correct(), docs=range(DOCS - 1))
    other_task = write_run(tmp_path / "other", pre_correct(), task="new")
    other_pre = write_run(tmp_path / "other_pre", np.arange(DOCS + 5) < FORGETTABLE)
    new = write_run(tmp_path / "new", post_forgetting(BLOCK_A), docs=range(10))
    cases = [
        ((pre, short, *posts[:3], "--matrix", tmp_path / "a"), "holds other docs than pre's"),
        ((pre, other_task, *posts[:3], "--matrix", tmp_path / "b"), "its tasks differ from pre's"),
        ((other_pre, new, "--history", history), "built on other docs"),
        ((pre, *posts[:3], "--matrix", tmp_path / "c", "--known", FORGETTABLE + 1), "larger than a row"),
        (
            (pre, new, "--history", history, "--replay", tmp_path / "r.jsonl", "--replay-budget", FORGETTABLE + 1),
            "--replay-budget",
        ),
        ((pre, *posts[:2], "--matrix", tmp_path / "d"), "at least 3 fine-tunes"),
        ((pre, new, "--replay-budget", 3), "go with --matrix DIR or --history DIR"),
        ((pre, new, "--history", history / "matrix.png"), "matrix.png"),
        ((pre, *posts[:3], "--matrix", history), "already exists"),
    ]
    for args, message in cases:
        result = run_cli(*args)
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (args, lines)
    assert not any((tmp_path / name).exists() for name in ("a", "b", "c", "d", "r.jsonl"))
