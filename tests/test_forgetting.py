"""Forgetting metrics checked against hand-computed cases (paper §2 of "Mapping Post-Training Forgetting in
Language Models at Scale"), the lm-eval samples loader on lm-eval-shaped records, and the CLI. Files written
by lm-eval itself are tested in test_lm_eval_outputs.py."""

import json
import math
import random

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from mergekit_lite.cli.main import main
from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.forgetting import aggregate, compare, forgetting_map, forgetting_metrics, format_table
from mergekit_lite.evaluate.outcomes import (
    LoadedRun,
    SampleOutcomes,
    ScoringRule,
    TaskSkipped,
    load_lm_eval_run,
    outcomes_from_lm_eval,
)

# 8 samples: kept 3 (1->1), forgotten 2 (1->0), gained 1 (0->1), never 2 (0->0).
PRE_8 = [1, 1, 1, 1, 1, 0, 0, 0]
POST_8 = [1, 1, 1, 0, 0, 1, 0, 0]


def test_hand_computed_eight_samples_four_choices():
    # a_pre = 5/8, a_post = 4/8; chance = (3/8)/3 * (1/2) = 1/16; a_pre_true = (4*5/8 - 1)/3 = 1/2;
    # a_post_true = (4*4/8 - 1)/3 = 1/3.
    row = forgetting_metrics(PRE_8, POST_8, k=4, task="toy")
    assert (row.task, row.n, row.k) == ("toy", 8, 4)
    assert (row.kept, row.gained, row.forgotten, row.never) == (3, 1, 2, 2)
    assert (row.acc_pre, row.acc_post) == (0.625, 0.5)
    assert (row.F, row.BT) == (0.25, 0.125)
    assert row.F_chance == pytest.approx(1 / 16) and row.BT_chance == pytest.approx(1 / 16)
    assert row.F_true == pytest.approx(3 / 16) and row.BT_true == pytest.approx(1 / 16)
    assert row.F_max == 0.5 and row.BT_max == pytest.approx(1 / 3)


def test_generative_has_no_chance_term():
    row = forgetting_metrics(PRE_8, POST_8, k=math.inf)
    assert (row.F_chance, row.BT_chance) == (0, 0)
    assert (row.F_true, row.BT_true) == (0.25, 0.125)
    assert (row.F_max, row.BT_max) == (0.625, 0.5)  # a_pre and a_post: nothing is a guess


def test_independent_random_binary_classifiers_forget_nothing_truly():
    rng = random.Random(0)
    pre = [rng.random() < 0.5 for _ in range(20_000)]
    post = [rng.random() < 0.5 for _ in range(20_000)]
    row = forgetting_metrics(pre, post, k=2)
    assert row.F == pytest.approx(0.25, abs=0.01)
    assert row.F_chance == pytest.approx(0.25, abs=0.01)
    assert row.F_true == pytest.approx(0, abs=0.01)
    assert row.BT_true == pytest.approx(0, abs=0.01)
    assert row.F_max == pytest.approx(0, abs=0.02)


@pytest.mark.parametrize("pre", [[1, 0, 0, 0], [0, 0, 0, 0]], ids=["at chance", "below chance"])
def test_accuracy_at_or_below_chance_has_nothing_to_forget(pre):
    row = forgetting_metrics(pre, [1, 1, 0, 0], k=4)
    assert row.F_max == 0 and row.BT_max == pytest.approx((4 * 0.5 - 1) / 3)  # BT_max = a_post_true


def test_two_random_guessers_on_four_options_forget_nothing_truly():
    """The issue's case: generative multiple choice scored by exact_match with k = 4, not inf."""
    rng = random.Random(1)
    pre = [rng.random() < 0.25 for _ in range(20_000)]
    post = [rng.random() < 0.25 for _ in range(20_000)]
    assert forgetting_metrics(pre, post, k=4).F_true == pytest.approx(0, abs=0.01)
    assert forgetting_metrics(pre, post, k=math.inf).F_true == pytest.approx(0.1875, abs=0.01)


@given(
    pairs=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=50),
    k=st.sampled_from([2, 3, 4, 10, math.inf]),
)
@settings(max_examples=60, deadline=None)
def test_invariants(pairs, k):
    pre, post = zip(*pairs, strict=True)
    row = forgetting_metrics(pre, post, k)
    assert row.kept + row.gained + row.forgotten + row.never == row.n == len(pairs)
    assert row.F - row.BT == pytest.approx(row.acc_pre - row.acc_post)
    assert 0 <= row.F_true <= row.F and 0 <= row.BT_true <= row.BT
    # paper §2 "Ceilings": F_max = a_pre_true, BT_max = a_post_true (not 1 - F_max)
    assert 0 <= row.F_max <= row.acc_pre and 0 <= row.BT_max <= row.acc_post
    assert row.F_max == pytest.approx(row.acc_pre if math.isinf(k) else max((k * row.acc_pre - 1) / (k - 1), 0))
    assert row.BT_max == pytest.approx(row.acc_post if math.isinf(k) else max((k * row.acc_post - 1) / (k - 1), 0))


@pytest.mark.parametrize(
    "pre, post, k, message",
    [([], [], 4, "no samples"), ([1, 0], [1], 4, "aligned"), ([1], [1], 1, "k must be > 1")],
)
def test_bad_metric_inputs(pre, post, k, message):
    with pytest.raises(InputError, match=message):
        forgetting_metrics(pre, post, k, task="toy")


def test_compare_aligns_by_key_not_order():
    pre = SampleOutcomes("toy", {"a": True, "b": True, "c": False}, 4)
    post = SampleOutcomes("toy", {"c": True, "b": False, "a": True}, 4)
    row = compare(pre, post)
    assert (row.kept, row.gained, row.forgotten, row.never) == (1, 1, 1, 0)


def test_compare_skips_misaligned_samples_and_k():
    pre = SampleOutcomes("toy", {"a": True, "b": True}, 4)
    with pytest.raises(TaskSkipped, match=r"pre 2, post 1.*1 only in pre, 0 only in post"):
        compare(pre, SampleOutcomes("toy", {"a": True}, 4))
    with pytest.raises(TaskSkipped, match="number of choices"):
        compare(pre, SampleOutcomes("toy", {"a": True, "b": True}, 2))
    with pytest.raises(InputError, match="different tasks"):
        compare(pre, SampleOutcomes("other", {"a": True, "b": True}, 4))


def test_aggregate_paper_is_the_unweighted_mean_of_task_values():
    """Paper Appendix B.2 / official create_pivot_table: a category is the mean of its tasks' values."""
    four_way = forgetting_metrics(PRE_8, POST_8, k=4, task="mc")
    generative = forgetting_metrics([1, 0], [0, 0], k=math.inf, task="gen")
    group = aggregate([four_way, generative], "old")
    assert (group.group, group.aggregation, group.tasks, group.n) == ("old", "paper", ("mc", "gen"), 10)
    assert group.F == pytest.approx((0.25 + 0.5) / 2)
    assert group.F_true == pytest.approx((3 / 16 + 0.5) / 2)
    assert group.BT_max == pytest.approx((1 / 3 + 0) / 2)


def test_aggregate_pooled_pools_samples_and_weights_chance_by_n():
    four_way = forgetting_metrics(PRE_8, POST_8, k=4, task="mc")
    generative = forgetting_metrics([1, 0], [0, 0], k=math.inf, task="gen")
    group = aggregate([four_way, generative], "old", "pooled")
    assert (group.acc_pre, group.acc_post, group.F, group.BT) == (0.6, 0.4, 0.3, 0.1)
    assert group.F_chance == pytest.approx(8 * (1 / 16) / 10)  # generative adds no chance term
    assert group.F_true == pytest.approx(0.3 - 0.05)
    assert group.F_max == pytest.approx((8 * 0.5 + 2 * 0.5) / 10)


def test_small_and_large_task_paper_mean_differs_from_pooled():
    """A 10-sample task forgetting everything beside a 1000-sample one forgetting nothing (k = inf):
    the paper's category mean gives each task equal weight, pooling drowns the small task."""
    small = forgetting_metrics([1] * 10, [0] * 10, k=math.inf, task="small")
    large = forgetting_metrics([1] * 1000, [1] * 1000, k=math.inf, task="large")
    assert aggregate([small, large], "g").F_true == pytest.approx(0.5)
    assert aggregate([small, large], "g", "pooled").F_true == pytest.approx(10 / 1010)


def outcomes(task, values, k):
    return SampleOutcomes(task, {f"d{i}": bool(value) for i, value in enumerate(values)}, k)


def test_a_misaligned_seed_skips_only_that_seed():
    """Official code (process_data.py compare_models): a sample-count mismatch skips that (task, seed) pair
    only; create_csv.py create_pivot_table then averages each task, and each category per seed, over the
    seeds that were compared (paper Appendix B.2 categories, §2 metrics)."""
    pre = LoadedRun(
        "pre",
        {
            "arc": {"1": outcomes("arc", PRE_8, 4), "2": outcomes("arc", PRE_8, 4)},
            "gen": {"1": outcomes("gen", [1, 0], math.inf), "2": outcomes("gen", [1, 1], math.inf)},
            "bad": {"1": outcomes("bad", [1, 0], 2), "2": outcomes("bad", [1, 0], 2)},
        },
    )
    post = LoadedRun(
        "post",
        {
            "arc": {"1": outcomes("arc", POST_8, 4), "2": outcomes("arc", POST_8[:7], 4)},
            "gen": {"1": outcomes("gen", [0, 0], math.inf), "2": outcomes("gen", [1, 1], math.inf)},
            "bad": {"1": outcomes("bad", [1], 2), "2": outcomes("bad", [1, 0], 3)},
        },
    )
    result = forgetting_map(pre, post)
    # arc: seed 2 misaligned (8 vs 7 samples), so arc is seed 1 alone: F = 2/8, F_true = 3/16 (see
    # test_hand_computed_eight_samples_four_choices)
    arc = result.rows["arc"]
    assert arc.seeds == 1 and arc.F == 0.25 and arc.F_true == pytest.approx(3 / 16)
    assert "seed 2: samples differ" in result.skipped["arc"] and "compared on seed 1 only" in result.skipped["arc"]
    assert sorted(result.rows_by_seed["1"]) == ["arc", "gen"] and sorted(result.rows_by_seed["2"]) == ["gen"]
    # gen (k = inf): seed 1 F = 1/2, seed 2 F = 0: the task's row is their mean
    assert result.rows["gen"].seeds == 2 and result.rows["gen"].F_true == pytest.approx(0.25)
    # bad: every seed misaligned (seed 1 samples, seed 2 k), so no row, and both reasons listed
    assert "bad" not in result.rows
    assert "seed 1: samples differ" in result.skipped["bad"] and "seed 2: number of choices" in result.skipped["bad"]
    # category per seed, then the mean over seeds: seed 1 = mean(arc, gen), seed 2 = gen alone
    group = result.group("old", ["arc", "gen", "bad"])
    assert group.F == pytest.approx(((0.25 + 0.5) / 2 + 0) / 2)  # 0.1875
    assert group.F_true == pytest.approx(((3 / 16 + 0.5) / 2 + 0) / 2)  # 11/64
    assert group.acc_pre == pytest.approx(((5 / 8 + 1 / 2) / 2 + 1) / 2)


def test_overall_weighs_each_group_the_same():
    """Official code (create_csv.py create_pivot_table): OVERALL is, per seed, the mean of the category means,
    then the mean over seeds, so a category of three tasks weighs as much as one of one task. k = inf here,
    so F is the forgotten share (paper §2)."""
    pre_rows, post_rows = {}, {}
    forgotten = {"a1": ([0, 1, 1, 1],) * 2, "a2": ([0, 0, 1, 1],) * 2, "a3": ([1, 1, 1, 1],) * 2, "b": ([0, 0], [1, 0])}
    for task, post_by_seed in forgotten.items():
        pre_rows[task] = {
            seed: outcomes(task, [1] * len(post), math.inf) for seed, post in zip("12", post_by_seed, strict=True)
        }
        post_rows[task] = {seed: outcomes(task, post, math.inf) for seed, post in zip("12", post_by_seed, strict=True)}
    result = forgetting_map(LoadedRun("pre", pre_rows), LoadedRun("post", post_rows))
    groups = [("knowledge", ["a1", "a2", "a3"]), ("math", ["b"])]
    overall = result.overall(groups)
    # knowledge: F = (1/4 + 1/2 + 0) / 3 = 1/4 in both seeds; math: 1 in seed 1, 1/2 in seed 2
    assert overall.group == "OVERALL" and overall.tasks == ("a1", "a2", "a3", "b")
    assert overall.F == pytest.approx(((0.25 + 1) / 2 + (0.25 + 0.5) / 2) / 2)  # 0.5
    # the mean over the four tasks is another number: (7/16 + 5/16) / 2
    assert result.group("all", ["a1", "a2", "a3", "b"]).F == pytest.approx(0.375)
    assert overall.F_true == overall.F and overall.acc_pre == 1.0


def test_cli_overall_needs_groups(tmp_path):
    result = run_cli(tmp_path, tmp_path, "--overall")
    assert result.exit_code == 2 and "give at least one --group" in result.output


def test_aggregate_of_nothing_errors():
    with pytest.raises(InputError, match="group 'old'"):
        aggregate([], "old")


def test_to_dict_is_strict_json():
    row = forgetting_metrics(PRE_8, POST_8, k=math.inf, task="gen")
    assert json.loads(json.dumps(row.to_dict(), allow_nan=False))["k"] is None


def test_format_table_is_a_pipe_table():
    lines = format_table([forgetting_metrics(PRE_8, POST_8, k=4, task="toy")]).splitlines()
    assert [cell.strip() for cell in lines[0].strip("|").split("|")][:5] == ["task", "metric", "n", "k", "acc_pre"]
    assert set(lines[1]) <= set("|-:")
    assert [cell.strip() for cell in lines[2].strip("|").split("|")][:6] == ["toy", "-", "8", "4", "0.625", "0.500"]


# --- lm-eval --log_samples input ---------------------------------------------------------------


def mc_sample(doc_id, acc, choices=4, **extra):
    """A multiple-choice record the way lm-eval 0.4 writes it to samples_*.jsonl."""
    arguments = {f"gen_args_{i}": {"arg_0": "Question?", "arg_1": f" choice {i}"} for i in range(choices)}
    record = {
        "doc_id": doc_id,
        "doc_hash": f"hash{doc_id}",
        "arguments": arguments,
        "acc": acc,
        "filter": "none",
        "metrics": ["acc"],
    }
    return {**record, **extra}


def gen_sample(doc_id, exact_match, filter_name="strict-match"):
    """A generative record: one generate_until request, scored by exact_match."""
    arguments = {"gen_args_0": {"arg_0": "Q:", "arg_1": {"until": ["\n"]}}}
    return {
        "doc_id": doc_id,
        "doc_hash": f"g{doc_id}",
        "arguments": arguments,
        "exact_match": exact_match,
        "filter": filter_name,
        "metrics": ["exact_match"],
    }


def write_samples(folder, task, samples, stamp="2024-05-01T12-00-00.123456"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"samples_{task}_{stamp}.jsonl"
    path.write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    return path


def test_outcomes_from_multiple_choice_records():
    outcomes = outcomes_from_lm_eval("arc_easy", [mc_sample(0, 1.0), mc_sample(1, 0)])
    assert outcomes == SampleOutcomes(
        "arc_easy", {"hash0": True, "hash1": False}, 4, "acc", "none", doc_ids={"hash0": 0, "hash1": 1}
    )  # lm-eval's ids, for probe samples=


def test_outcomes_arguments_as_list_and_key_fallback_to_doc_id():
    sample = {"doc_id": 7, "arguments": [["Q?", " yes"], ["Q?", " no"]], "acc": 1}  # older log: no "metrics"
    assert outcomes_from_lm_eval("boolq", [sample]) == SampleOutcomes(
        "boolq", {"7": True}, 2, "acc", "", doc_ids={"7": 7}
    )


def test_outcomes_generative_uses_first_filter_unless_told_and_no_chance():
    strict = [gen_sample(0, 1), gen_sample(1, 0)]
    flexible = [gen_sample(0, 0, "flexible-extract"), gen_sample(1, 1, "flexible-extract")]
    samples = strict + flexible
    assert outcomes_from_lm_eval("gsm8k", samples) == SampleOutcomes(
        "gsm8k", {"g0": True, "g1": False}, math.inf, "exact_match", "strict-match", doc_ids={"g0": 0, "g1": 1}
    )
    chosen = outcomes_from_lm_eval("gsm8k", samples, ScoringRule(filter="flexible-extract"))
    assert chosen.correct == {"g0": False, "g1": True} and chosen.filter == "flexible-extract"
    with pytest.raises(InputError, match="no filter 'typo'"):
        outcomes_from_lm_eval("gsm8k", samples, ScoringRule(filter="typo", required=True))


def test_generative_multiple_choice_takes_k_from_the_docs_or_the_rule():
    records = [{**gen_sample(i, 1), "doc": {"options": ["A", "B", "C", "D"]}} for i in range(2)]
    assert outcomes_from_lm_eval("gpqa_cot", records, config={"doc_to_choice": "{{options}}"}).n_choices == 4
    assert outcomes_from_lm_eval("gpqa_cot", records, config={"doc_to_choice": ["A", "B", "C"]}).n_choices == 3
    assert outcomes_from_lm_eval("gpqa_cot", records, ScoringRule(choices=5)).n_choices == 5
    assert outcomes_from_lm_eval("gpqa_cot", records).n_choices == math.inf  # free-form unless told


def test_generative_choices_follow_lm_evals_reading_of_doc_to_choice():
    """lm-eval's ConfigurableTask.doc_to_choice: a doc field, a mapping's values, or a Jinja template rendered
    against the doc and read as a Python literal (commonsense_qa-style nested options)."""
    doc = {"question": {"choices": [{"text": "a"}, {"text": "b"}, {"text": "c"}]}, "options": {"text": ["x", "y"]}}
    records = [{**gen_sample(i, 1), "doc": doc} for i in range(2)]
    for spec, k in [
        ("{{options.text}}", 2),
        ("{{question.choices | map(attribute='text') | list}}", 3),
        ({"A": "first", "B": "second", "C": "third", "D": "fourth", "E": "fifth"}, 5),
        ("{{options.missing}}", math.inf),
        ("{{ ''.__class__.__mro__ }}", math.inf),
    ]:
        assert outcomes_from_lm_eval("mc_gen", records, config={"doc_to_choice": spec}).n_choices == k, spec


def test_metric_is_chosen_from_the_config_or_the_rule_and_must_be_binary():
    both = [mc_sample(i, acc, acc_norm=1 - acc, metrics=["acc", "acc_norm"]) for i, acc in enumerate([1, 0])]
    assert outcomes_from_lm_eval("hellaswag", both).metric == "acc"
    config = {"metric_list": [{"metric": "acc_norm"}, {"metric": "acc"}]}
    assert outcomes_from_lm_eval("hellaswag", both, config=config).correct == {"hash0": False, "hash1": True}
    assert outcomes_from_lm_eval("hellaswag", both, ScoringRule(metric="acc_norm")).metric == "acc_norm"
    boolean = [mc_sample(0, 0, prompt_level_strict_acc=True, metrics=["prompt_level_strict_acc"])]
    assert outcomes_from_lm_eval("ifeval", boolean).correct == {"hash0": True}
    mass = [mc_sample(0, 0.73, metrics=["acc"])]  # truthfulqa_mc2: probability mass, not 0/1
    with pytest.raises(TaskSkipped, match="'acc' is not 0/1"):
        outcomes_from_lm_eval("truthfulqa_mc2", mass)


def test_outcomes_k_special_cases():
    mutual_info = mc_sample(0, 1, choices=8, acc_mutual_info=1)  # 4 choices + 4 unconditional requests
    assert outcomes_from_lm_eval("t", [mutual_info]).n_choices == 4
    loglikelihood = mc_sample(0, 1, choices=1)  # lambada-style: acc from a single continuation
    assert outcomes_from_lm_eval("t", [loglikelihood]).n_choices == math.inf
    varying = [mc_sample(0, 1, choices=2), mc_sample(1, 1, choices=4)]  # mean chance accuracy 3/8
    assert outcomes_from_lm_eval("t", varying).n_choices == pytest.approx(8 / 3)


def test_identical_documents_are_numbered_in_doc_order():
    twins = [mc_sample(1, 0, doc_hash="same"), mc_sample(0, 1, doc_hash="same")]
    assert outcomes_from_lm_eval("t", twins).correct == {"same": True, "same#2": False}


def test_outcomes_errors_name_the_sample():
    unscored = mc_sample(1, 0)
    del unscored["acc"]
    with pytest.raises(InputError, match=r"task 'arc' sample 1: no 'acc' field"):
        outcomes_from_lm_eval("arc", [mc_sample(0, 1), unscored])
    with pytest.raises(InputError, match="no samples"):
        outcomes_from_lm_eval("arc", [])


def test_load_file_takes_task_name_with_underscores(tmp_path):
    path = write_samples(tmp_path, "mmlu_high_school_math", [mc_sample(0, 1), mc_sample(1, 0)])
    assert list(load_lm_eval_run(path).outcomes) == ["mmlu_high_school_math"]


def test_load_folder_recursive_newest_timestamp_wins(tmp_path):
    write_samples(tmp_path / "model", "arc_easy", [mc_sample(0, 0)], stamp="2024-05-01T12-00-00.123456")
    write_samples(tmp_path / "model", "arc_easy", [mc_sample(0, 1)], stamp="2024-06-01T09-30-00.000001")
    write_samples(tmp_path / "model", "gsm8k", [gen_sample(0, 1)])
    loaded = load_lm_eval_run(tmp_path).outcomes
    assert sorted(loaded) == ["arc_easy", "gsm8k"]
    assert loaded["arc_easy"]["-"].correct == {"hash0": True}  # "-": no results_*.json, so no seed known


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"doc_id": 0, "acc": 1, "arguments": []}', "{not json"], r"line 2: not JSON"),
        (['{"doc_id": 0, "arguments": [[], []]}'], r"line 1: no metric logged"),
        (['{"doc_id": 0, "acc": "yes", "arguments": [[], []]}'], r"line 1: 'acc' must be a number"),
        ([""], "no samples in file"),
        (["\udcff"], r"line 1: not JSON \(not UTF-8\)"),
    ],
)
def test_bad_files_name_file_and_line(tmp_path, lines, message):
    path = tmp_path / "samples_arc_2024-05-01T12-00-00.123456.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"))
    with pytest.raises(InputError, match=rf"samples_arc_.*{message}"):
        load_lm_eval_run(path)


def test_load_rejects_unknown_names_and_empty_folders(tmp_path):
    other = tmp_path / "results.jsonl"
    other.write_text("{}\n")
    with pytest.raises(InputError, match="not an lm-eval samples file"):
        load_lm_eval_run(other)
    with pytest.raises(InputError, match="no samples_<task>"):
        load_lm_eval_run(tmp_path)


# --- CLI -----------------------------------------------------------------------------------------


@pytest.fixture
def runs(tmp_path):
    """Two lm-eval output folders: arc_easy is the 8-sample case, gsm8k forgets one of two, plus one-sided tasks."""
    pre, post = tmp_path / "pre" / "base", tmp_path / "post" / "instruct"
    write_samples(pre, "arc_easy", [mc_sample(i, acc) for i, acc in enumerate(PRE_8)])
    write_samples(post, "arc_easy", [mc_sample(i, acc) for i, acc in enumerate(POST_8)])
    write_samples(pre, "gsm8k", [gen_sample(0, 1), gen_sample(1, 0)])
    write_samples(post, "gsm8k", [gen_sample(0, 0), gen_sample(1, 0)])
    write_samples(pre, "only_pre", [mc_sample(0, 1)])
    write_samples(post, "only_post", [mc_sample(0, 1)])
    return tmp_path / "pre", tmp_path / "post"


def run_cli(*args):
    return CliRunner().invoke(main, ["forgetting", *map(str, args)])


def test_cli_json_per_task_and_group(runs):
    result = run_cli(*runs, "--group", "old=arc_*,gsm8k", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    tasks = {row["task"]: row for row in payload["tasks"]}
    assert sorted(tasks) == ["arc_easy", "gsm8k"]
    assert tasks["arc_easy"]["F_true"] == pytest.approx(3 / 16)
    assert tasks["gsm8k"]["k"] is None and tasks["gsm8k"]["forgotten"] == 1
    [old] = payload["groups"]
    assert (old["group"], old["aggregation"], old["n"]) == ("old", "paper", 10)
    assert old["F"] == pytest.approx((2 / 8 + 1 / 2) / 2)  # unweighted mean of the two tasks
    assert "'only_pre' skipped: only in pre" in result.stderr
    assert "'only_post' skipped: only in post" in result.stderr
    assert {row["task"] for row in payload["skipped"]} == {"only_pre", "only_post"}


@pytest.mark.parametrize(
    "linked", ["samples_gsm8k_2024-05-01T12-00-00.123456.jsonl", "results_2024-05-01T12-00-00.123456.json"]
)
def test_a_file_linking_out_of_the_named_folder_is_refused_not_read(runs, tmp_path, linked):
    outside = tmp_path / "secret.jsonl"
    outside.write_text(json.dumps(gen_sample(0, 1)) + "\n")
    target = runs[1] / "instruct" / linked
    target.unlink(missing_ok=True)
    target.symlink_to(outside)
    result = run_cli(*runs)
    assert result.exit_code == 2 and "a link out of the folder" in result.output, result.output


def test_cli_overall_row_follows_the_groups(runs):
    result = run_cli(*runs, "--group", "old=arc_*", "--group", "new=gsm8k", "--overall", "--json")
    assert result.exit_code == 0, result.output
    old, new, overall = json.loads(result.stdout)["groups"]
    assert overall["group"] == "OVERALL" and overall["F"] == pytest.approx((old["F"] + new["F"]) / 2)


def test_cli_tables_from_single_files(runs):
    pre_file = next(runs[0].rglob("samples_arc_easy_*.jsonl"))
    post_file = next(runs[1].rglob("samples_arc_easy_*.jsonl"))
    result = run_cli(pre_file, post_file, "--group", "old=arc_easy")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("| task ")
    header, arc_easy = (line.strip("|").split("|") for line in (lines[0], lines[2]))
    assert dict(zip(map(str.strip, header), map(str.strip, arc_easy), strict=True))["F_true"] == "0.188"
    assert lines[4].startswith("| group ") and lines[6].startswith("| old ")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--group", "old"], "expected NAME=task1,task2"),
        (["--group", "old=arc_easy", "--group", "old=gsm8k"], "names must be unique"),
        (["--group", "old=arc_typo"], "'arc_typo' matches no task"),
        (["--group", "old=only_pre"], "none of its tasks could be compared"),
    ],
)
def test_cli_group_errors(runs, extra, message):
    result = run_cli(*runs, *extra)
    assert result.exit_code == 2 and "error: --group" in result.stderr and message in result.stderr


def test_cli_no_common_task(runs):
    only_pre = next(runs[0].rglob("samples_only_pre_*.jsonl"))
    only_post = next(runs[1].rglob("samples_only_post_*.jsonl"))
    result = run_cli(only_pre, only_post)
    assert result.exit_code == 2 and "error: no task could be compared" in result.stderr


def test_cli_skips_a_non_binary_task_with_a_warning(runs):
    for side, values in ((runs[0] / "base", [0.2, 0.9]), (runs[1] / "instruct", [0.4, 0.1])):
        write_samples(side, "truthfulqa_mc2", [mc_sample(i, value) for i, value in enumerate(values)])
    result = run_cli(*runs, "--json")
    assert result.exit_code == 0, result.output
    assert "'truthfulqa_mc2' skipped: pre: metric 'acc' is not 0/1" in result.stderr
    assert "truthfulqa_mc2" not in {row["task"] for row in json.loads(result.stdout)["tasks"]}
