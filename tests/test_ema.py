"""`merge --method ema`: the exponential moving average of a toy training run's checkpoints (pre = step 0, the
step-25 and step-50 checkpoints, post = step 200; `toy_pair`), against the EMA recursion computed here in
float64, tensor by tensor, and the order rules for a folder of checkpoints."""

import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from mergekit_lite.cli.main import main
from mergekit_lite.merge.methods.ema import ema_weights


def state(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def ema_recursion(folders, decay: float) -> dict[str, torch.Tensor]:
    """s_0 = c_0, s_i = decay * s_(i-1) + (1 - decay) * c_i, in float64."""
    states = [state(folder) for folder in folders]
    average = {name: tensor.double() for name, tensor in states[0].items()}
    for checkpoint in states[1:]:
        average = {name: decay * average[name] + (1 - decay) * checkpoint[name].double() for name in average}
    return average


def merge_cli(*args):
    return CliRunner().invoke(main, ["merge", "--method", "ema", "-q", *map(str, args)])


@pytest.fixture(scope="module")
def trajectory(toy_pair):
    return [toy_pair.pre_dir, *toy_pair.checkpoints, toy_pair.post_dir]


@pytest.mark.parametrize("decay", [0.9, 0.5])
def test_ema_equals_the_recursion_on_every_tensor(trajectory, tmp_path, decay):
    out = tmp_path / "ema"
    result = merge_cli("--decay", decay, *[part for folder in trajectory for part in ("--model", folder)], "--out", out)
    assert result.exit_code == 0, result.output
    merged, expected = state(out), ema_recursion(trajectory, decay)
    assert merged.keys() == expected.keys() and len(merged) > 10
    for name, tensor in merged.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor.double(), expected[name], rtol=1e-6, atol=1e-6, msg=name)
    moved = [name for name in merged if not torch.equal(merged[name], state(trajectory[-1])[name])]
    assert moved  # the average is not the last checkpoint


def test_decay_zero_is_the_last_checkpoint_and_one_the_first(trajectory, tmp_path):
    for decay, expected in ((0.0, trajectory[-1]), (1.0, trajectory[0])):
        out = tmp_path / f"ema-{decay}"
        result = merge_cli(
            "--decay", decay, *[part for folder in trajectory for part in ("--model", folder)], "--out", out
        )
        assert result.exit_code == 0, result.output
        reference = state(expected)
        assert all(torch.equal(tensor, reference[name]) for name, tensor in state(out).items())


def test_weights_are_the_recursion_unrolled():
    weights = ema_weights(4, 0.8)
    assert weights == pytest.approx([0.8**3, 0.2 * 0.8**2, 0.2 * 0.8, 0.2], abs=1e-15)
    assert sum(weights) == pytest.approx(1, abs=1e-15)


def test_a_folder_of_checkpoints_needs_its_order_given(toy_pair, tmp_path):
    folder = tmp_path / "run"
    for checkpoint in toy_pair.checkpoints:  # checkpoint-25, checkpoint-50, as a Trainer's output_dir holds them
        shutil.copytree(checkpoint, folder / checkpoint.name)
    refused = merge_cli("--decay", 0.9, "--model", folder, "--out", tmp_path / "ema")
    assert refused.exit_code == 2 and refused.stderr.count("\n") == 1
    assert "a folder of 2 checkpoints (checkpoint-25, checkpoint-50) gives no training order" in refused.stderr
    assert not (tmp_path / "ema").exists()
    ordered = merge_cli(
        "--decay", 0.9, "--model", toy_pair.pre_dir, "--model", folder, "--order", "step", "--out", tmp_path / "ema"
    )
    assert ordered.exit_code == 0, ordered.output
    expected = ema_recursion([toy_pair.pre_dir, *toy_pair.checkpoints], 0.9)
    for name, tensor in state(tmp_path / "ema").items():
        torch.testing.assert_close(tensor.double(), expected[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--decay", "0.9", "--model", "{pre}"], "ema averages at least two checkpoints"),
        (["--model", "{pre}", "--model", "{post}"], "ema needs decay (--decay)"),
        (["--decay", "1.5", "--model", "{pre}", "--model", "{post}"], "decay must be in [0.0, 1.0]"),
        (["--decay", "0.9", "--model", "{pre}", "--model", "{post}", "--order", "step"], "--order step orders"),
    ],
)
def test_bad_ema_requests_are_one_line(toy_pair, tmp_path, args, message):
    args = [arg.format(pre=toy_pair.pre_dir, post=toy_pair.post_dir) for arg in args]
    result = merge_cli(*args, "--out", tmp_path / "ema")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_order_is_for_ema_only(toy_pair, tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "merge",
            "--method",
            "linear",
            "--model",
            str(toy_pair.pre_dir),
            "--model",
            str(toy_pair.post_dir),
            "--order",
            "step",
            "--out",
            str(tmp_path / "m"),
        ],
    )
    assert result.exit_code == 2 and "--order applies to --method ema" in result.stderr
