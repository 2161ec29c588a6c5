"""LiNeS (Wang et al., ICLR 2025, arXiv 2410.17146) against a float64 merge written here from the paper's rule.

The reference scales each tensor's task vector by alpha + beta * l / (L - 1) for decoder layer l (from 0), and by
alpha for every tensor outside the decoder layers, as the authors' `LiNeS_scaling` (src/eval/eval.py of
github.com/wang-kee/LiNeS) does for keys that name no residual block. Depths 3 and 5 put the middle layers at
1/2 and 1/4, 1/2, 3/4 of the way.
"""

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import save_tiny_llama

from mergekit_lite.audited import run_merge
from mergekit_lite.errors import InputError
from mergekit_lite.merge.plan import plan_merge
from mergekit_lite.merge.schema import config_from_dict


def state(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(shard))
    return {name: tensor.to(torch.float64) for name, tensor in tensors.items()}


def reference_lines(
    base: dict, models: list[dict], weights: list[float], alpha: float, beta: float, n_layers: int
) -> dict[str, torch.Tensor]:
    merged = {}
    for name, b in base.items():
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        factor = alpha if layer is None else alpha + beta * int(layer.group(1)) / (n_layers - 1)
        merged[name] = b + factor * sum(w * (m[name] - b) for w, m in zip(weights, models, strict=True))
    return merged


@pytest.fixture(scope="module", params=[3, 5], ids=lambda n: f"{n}-layers")
def checkpoints(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lines{request.param}")
    return request.param, [
        save_tiny_llama(seed, root / f"m{seed}", num_hidden_layers=request.param) for seed in range(3)
    ]


@pytest.mark.parametrize(
    "n_models,weights,alpha,beta",
    [
        (1, [1.0], 0.3, None),  # the authors' single-task editing: beta = 1 - alpha
        (1, [1.0], 0.2, 0.5),
        (2, [1.0, 1.0], 0.5, 0.4),  # their multi-task form: the summed task vector, alpha = 1/T
        (2, [0.7, -0.3], 0.25, 1.5),
    ],
)
def test_lines_equals_a_float64_reference_on_every_tensor(checkpoints, n_models, weights, alpha, beta, tmp_path):
    n_layers, folders = checkpoints
    parameters = {"alpha": alpha} if beta is None else {"alpha": alpha, "beta": beta}
    models = [
        {"model": str(folder), "weight": weight}
        for folder, weight in zip(folders[1 : 1 + n_models], weights, strict=True)
    ]
    run_merge(
        config_from_dict({"method": "lines", "base": str(folders[0]), "models": models, "parameters": parameters}),
        tmp_path / "out",
    )

    merged = state(tmp_path / "out")
    expected = reference_lines(
        state(folders[0]),
        [state(f) for f in folders[1 : 1 + n_models]],
        weights,
        alpha,
        1 - alpha if beta is None else beta,
        n_layers,
    )
    assert merged.keys() == expected.keys()
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= merged.keys()
    for name in expected:
        torch.testing.assert_close(merged[name], expected[name], rtol=0, atol=2e-6, msg=name)


def test_the_plan_names_each_tensors_depth(checkpoints):
    n_layers, folders = checkpoints
    config = config_from_dict(
        {
            "method": "lines",
            "base": str(folders[0]),
            "models": [str(folders[1])],
            "parameters": {"alpha": 0.2, "beta": 0.4},
        }
    )
    steps = {step.name: step.parameters.shown() for step in plan_merge(config).steps}
    assert steps["model.layers.1.mlp.up_proj.weight"] == {
        "alpha": 0.2,
        "beta": 0.4,
        "layer": 1,
        "n_layers": n_layers,
        "weights": [1.0],
    }
    for outside in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert steps[outside]["layer"] is None


@pytest.mark.parametrize(
    "data,message",
    [
        ({"parameters": {"beta": 0.5}}, "lines needs alpha"),
        ({"parameters": {"alpha": 0.5}, "base": None}, "lines needs a base model"),
        ({"parameters": {"alpha": 0.5, "beta": 0.5, "lambda": 1.0}}, "'lambda' does not apply to method lines"),
    ],
)
def test_lines_refuses_incomplete_configs(checkpoints, data, message):
    _, folders = checkpoints
    config = {"method": "lines", "base": str(folders[0]), "models": [str(folders[1])], **data}
    with pytest.raises(InputError, match=message):
        config_from_dict(config)


def test_lines_does_not_take_slices(checkpoints):
    _, folders = checkpoints
    config = config_from_dict(
        {
            "method": "lines",
            "parameters": {"alpha": 0.5},
            "base": str(folders[0]),
            "slices": [
                {
                    "sources": [
                        {"model": str(folders[0]), "layer_range": [0, 2]},
                        {"model": str(folders[1]), "layer_range": [0, 2]},
                    ]
                }
            ],
        }
    )
    with pytest.raises(InputError, match="lines does not take slices"):
        plan_merge(config)
