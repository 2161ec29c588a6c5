"""Quantized checkpoints read as their dense models: FP8 block-scaled against transformers' own dequantizing load,
compressed-tensors FP8 against the compressed-tensors package, MXFP4 against a float64 decoding of the OCP MX
spec; merges and drift through the CLI; every other scheme refused in one line."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_safety import cli, one_error_line
from tiny_models import tiny_model

from mergekit_lite.io.quantized import E2M1_VALUES, scaled_dense
from mergekit_lite.io.sources import open_model_reference

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


# --- a float64 reference quantizer and dequantizer ---------------------------------------------------------


def is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    """The weights FP8 checkpoints quantize: the linear layers' (experts' too), not embeddings, norms, head or router."""
    skipped = ("embed", "norm", "lm_head", "mlp.gate.weight", "shared_expert_gate")
    return name.endswith(".weight") and tensor.ndim == 2 and not any(part in name for part in skipped)


def quantize_blocks(weight, block, dtype=torch.float8_e4m3fn, power_of_two=False):
    """Block-scaled FP8 in float64: each block's scale maps its largest magnitude to the format's largest value
    (rounded up to a power of two with `power_of_two`, as ue8m0 scales are); codes = weight / scale."""
    w = weight.double()
    rows, cols = w.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    scales = torch.ones(grid, dtype=torch.float64)
    codes = torch.empty_like(w)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            amax = w[part].abs().max().item()
            scale = amax / FP8_MAX[dtype] if amax else 1.0
            scales[i, j] = 2.0 ** math.ceil(math.log2(scale)) if power_of_two else scale
            codes[part] = w[part] / scales[i, j]
    return codes.to(dtype), scales.float()


def dequantize_blocks(codes, scales, block):
    """float64: every entry its code times its block's scale."""
    rows, cols = codes.shape
    by_entry = scales.double().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return codes.double() * by_entry


def fp8_config(block):
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}


def save_dense(state: dict, config: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in state.items()}, folder / "model.safetensors", {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def tiny_checkpoint(architecture: str, folder: Path, shift: float = 0.0, seed: int = 0) -> tuple[dict, dict]:
    """A tiny model's tensors as transformers saves them, and its config.json."""
    tiny_model(architecture, seed=seed, shift=shift).save_pretrained(folder)
    return load_file(folder / "model.safetensors"), json.loads((folder / "config.json").read_text())


def save_fp8(state, config, folder, block=(128, 128), power_of_two=False) -> tuple[Path, dict]:
    """The FP8 block-scaled checkpoint (DeepSeek-V3's layout) of `state`, and its float64 dequantization."""
    stored, dense = {}, {}
    for name, tensor in state.items():
        if is_linear_weight(name, tensor):
            codes, scales = quantize_blocks(tensor, block, power_of_two=power_of_two)
            stored[name], stored[name + "_scale_inv"] = codes, scales
            dense[name] = dequantize_blocks(codes, scales, block)
        else:  # stored in bf16, as FP8 checkpoints store what they leave unquantized
            stored[name] = tensor.bfloat16()
            dense[name] = stored[name].double()
    settings = {**config, "dtype": "bfloat16", "quantization_config": fp8_config(block)}
    return save_dense(stored, settings, folder), dense


def read_all(path) -> dict[str, torch.Tensor]:
    source = open_model_reference(str(path), False)
    try:
        return {name: source.load(name) for name in source.names}
    finally:
        source.close()


def fused_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """On-disk per-expert weights as transformers holds MoE experts in memory: gate and up stacked per expert
    (`experts.gate_up_proj`), down stacked (`experts.down_proj`); mixtral's w1/w3/w2 under its `mlp` name."""
    fused, experts = {}, {}
    for name, tensor in tensors.items():
        match = re.match(r"(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$", name)
        if match is None:
            fused[name.replace("block_sparse_moe", "mlp")] = tensor
            continue
        prefix, index, projection = match.groups()
        kind = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(projection, projection)
        experts.setdefault((prefix, kind), {})[int(index)] = tensor
    for (prefix, kind), by_index in experts.items():
        stacked = torch.stack([by_index[i] for i in sorted(by_index)])
        if kind == "down_proj":
            fused[f"{prefix}.mlp.experts.down_proj"] = stacked
    for (prefix, kind), by_index in experts.items():
        if kind == "gate_proj":
            up = experts[(prefix, "up_proj")]
            fused[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([by_index[i], up[i]]) for i in sorted(by_index)]
            )
    return fused


# --- FP8 block-scaled ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("architecture", "block"),
    [("llama", (128, 128)), ("qwen3", (8, 8)), ("qwen2_moe", (8, 16)), ("mixtral", (16, 8))],
)
def test_fp8_block_scaled_reads_as_transformers_dequantizes_it(tmp_path, architecture, block):
    import transformers
    from transformers import FineGrainedFP8Config

    state, config = tiny_checkpoint(architecture, tmp_path / "dense")
    folder, dense = save_fp8(state, config, tmp_path / "fp8", block)
    ours = read_all(folder)
    assert set(ours) == set(state)  # dense names, no scales
    class_name = tiny_model(architecture).__class__.__name__
    loaded = getattr(transformers, class_name).from_pretrained(
        folder, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    )
    theirs = loaded.state_dict()
    assert all(tensor.dtype == torch.float32 for tensor in theirs.values())
    ours_fused = fused_experts(ours)
    assert set(ours_fused) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours_fused[name].float(), tensor), name
    for name, tensor in dense.items():  # and the float64 dequantization, rounded once to float32
        assert torch.equal(ours[name].float(), tensor.float()), name


def test_ue8m0_scales_read_as_transformers_reads_them(tmp_path):
    """MXFP8-style fp8 checkpoints store power-of-two block scales as e8m0 bytes (scale_fmt ue8m0)."""
    import transformers
    from transformers import FineGrainedFP8Config

    state, config = tiny_checkpoint("llama", tmp_path / "dense")
    folder, dense = save_fp8(state, config, tmp_path / "fp8", (8, 8), power_of_two=True)
    stored = load_file(folder / "model.safetensors")
    for name in [name for name in stored if name.endswith("_scale_inv")]:
        stored[name] = (stored[name].log2() + 127).round().to(torch.uint8)
    settings = json.loads((folder / "config.json").read_text())
    settings["quantization_config"]["scale_fmt"] = "ue8m0"
    save_dense(stored, settings, folder)
    ours = read_all(folder)
    theirs = transformers.LlamaForCausalLM.from_pretrained(
        folder, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    ).state_dict()
    assert set(ours) == set(theirs) == set(dense)
    for name, tensor in dense.items():
        assert torch.equal(ours[name].float(), tensor.float()) and torch.equal(ours[name].float(), theirs[name]), name


def test_partial_blocks_against_the_float64_reference():
    """Shapes that are no multiple of the block: the last blocks of each dimension are partial."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 200, generator=generator)
    for dtype in FP8_MAX:
        codes, scales = quantize_blocks(weight, (128, 128), dtype)
        assert scales.shape == (3, 2)
        ours = scaled_dense(codes.float(), scales, (128, 128))
        assert torch.equal(ours, dequantize_blocks(codes, scales, (128, 128)).float())
        assert (ours - weight).abs().max() <= weight.abs().max() / 8  # the codes' own rounding only


def test_fp8_layout_without_a_quantization_config(tmp_path):
    state, config = tiny_checkpoint("llama", tmp_path / "dense")
    folder, dense = save_fp8(state, config, tmp_path / "fp8")
    (folder / "config.json").write_text(json.dumps(config))
    bare = folder / "model.safetensors"  # a bare file: no config.json at all
    for path in (folder, bare):
        ours = read_all(path)
        assert set(ours) == set(state)
        assert all(torch.equal(ours[name].float(), dense[name].float()) for name in dense)


# --- compressed-tensors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "scale_dtype"),
    [("tensor", torch.float32), ("channel", torch.float32), ("channel", torch.bfloat16), ("block", torch.float32)],
)
def test_compressed_tensors_fp8_reads_as_the_package_decompresses_it(tmp_path, strategy, scale_dtype):
    """The package decompresses in the scale's dtype: with bf16 scales (llm-compressor's usual) its bf16 weights
    are ours rounded to bf16 (our float32 product is exact: 4 and 8 significant bits)."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    state, config = tiny_checkpoint("qwen3", tmp_path / "dense")
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    if strategy == "block":  # blocks of 12: the last ones of a 16 or 32 wide dimension are partial
        weights["block_structure"] = [12, 12]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    stored, expected = {}, {}
    for name, tensor in state.items():
        if not is_linear_weight(name, tensor):
            stored[name] = expected[name] = tensor
            continue
        if strategy == "block":
            scale = quantize_blocks(tensor, (12, 12))[1].to(scale_dtype)
        else:
            amax = tensor.double().abs().amax() if strategy == "tensor" else tensor.double().abs().amax(1, keepdim=True)
            scale = (
                (amax / FP8_MAX[torch.float8_e4m3fn]).to(scale_dtype).reshape(1 if strategy == "tensor" else (-1, 1))
            )
        compressed = FloatQuantizationCompressor.compress({"weight": tensor, "weight_scale": scale}, scheme)
        module = name.removesuffix(".weight")
        stored[name], stored[f"{module}.weight_scale"] = compressed["weight"], compressed["weight_scale"]
        stored[f"{module}.input_scale"] = torch.ones(1)  # a static activation scale: not a weight
        expected[name] = FloatQuantizationCompressor.decompress(compressed, scheme)["weight"]
        assert expected[name].dtype == scale_dtype
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    settings = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }
    folder = save_dense(stored, {**config, "quantization_config": settings}, tmp_path / "fp8")
    ours = read_all(folder)
    assert set(ours) == set(state)
    for name, tensor in expected.items():
        if is_linear_weight(name, state[name]):
            assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name].to(tensor.dtype), tensor), name

    # a module the ignore list names must be stored dense
    stored["lm_head.weight"] = torch.zeros(state["lm_head.weight"].shape, dtype=torch.float8_e4m3fn)
    stored["lm_head.weight_scale"] = torch.ones(1)
    save_dense(stored, {**config, "quantization_config": settings}, tmp_path / "ignored")
    one_error_line(cli("drift", tmp_path / "dense", tmp_path / "ignored"), 2, "lm_head.weight", "ignore list")


# --- MXFP4 ---------------------------------------------------------------------------------------------------


def e2m1_float64(code: int) -> float:
    """OCP MX v1.0 §5.3.3 E2M1: sign bit, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude


def mxfp4_float64(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's packed experts decoded element by element: the low nibble first, times 2**(scale - 127),
    then laid out (experts, in, out) as its dense checkpoints are."""
    experts, rows, groups, width = blocks.shape
    out = torch.empty(experts, rows, groups * 2 * width, dtype=torch.float64)
    for e in range(experts):
        for r in range(rows):
            for g in range(groups):
                scale = 2.0 ** (int(scales[e, r, g]) - 127)
                for b in range(width):
                    byte = int(blocks[e, r, g, b])
                    out[e, r, g * 32 + 2 * b] = e2m1_float64(byte & 0xF) * scale
                    out[e, r, g * 32 + 2 * b + 1] = e2m1_float64(byte >> 4) * scale
    return out.transpose(1, 2)


def test_mxfp4_matches_the_ocp_spec_and_transformers(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    assert [e2m1_float64(code) for code in range(16)] == list(E2M1_VALUES)
    generator = torch.Generator().manual_seed(0)
    experts, hidden, intermediate = 2, 64, 8
    prefix = "model.layers.0.mlp.experts"
    stored = {
        f"{prefix}.gate_up_proj_blocks": torch.randint(
            0, 256, (experts, 2 * intermediate, hidden // 32, 16), generator=generator, dtype=torch.uint8
        ),
        f"{prefix}.gate_up_proj_scales": torch.randint(
            118, 130, (experts, 2 * intermediate, hidden // 32), generator=generator, dtype=torch.uint8
        ),
        f"{prefix}.gate_up_proj_bias": torch.randn(experts, 2 * intermediate, generator=generator).bfloat16(),
        f"{prefix}.down_proj_blocks": torch.randint(
            0, 256, (experts, hidden, intermediate // 8, 4), generator=generator, dtype=torch.uint8
        ),
        f"{prefix}.down_proj_scales": torch.randint(
            118, 130, (experts, hidden, intermediate // 8), generator=generator, dtype=torch.uint8
        ),
        "model.norm.weight": torch.ones(hidden).bfloat16(),
    }
    # down_proj with 4 bytes a block is not gpt-oss's 16: refused; the real layout reads
    folder = save_dense(stored, {"quantization_config": {"quant_method": "mxfp4"}}, tmp_path / "bad")
    with pytest.raises(Exception, match="down_proj_blocks"):
        read_all(folder)
    stored[f"{prefix}.down_proj_blocks"] = torch.randint(
        0, 256, (experts, hidden, intermediate // 32 + 1, 16), generator=generator, dtype=torch.uint8
    )
    stored[f"{prefix}.down_proj_scales"] = torch.randint(
        118, 130, (experts, hidden, intermediate // 32 + 1), generator=generator, dtype=torch.uint8
    )
    folder = save_dense(stored, {"quantization_config": {"quant_method": "mxfp4"}}, tmp_path / "mxfp4")
    ours = read_all(folder)
    assert set(ours) == {
        f"{prefix}.gate_up_proj",
        f"{prefix}.gate_up_proj_bias",
        f"{prefix}.down_proj",
        "model.norm.weight",
    }
    for projection in ("gate_up_proj", "down_proj"):
        blocks, scales = stored[f"{prefix}.{projection}_blocks"], stored[f"{prefix}.{projection}_scales"]
        reference = mxfp4_float64(blocks, scales)
        assert ours[f"{prefix}.{projection}"].shape == reference.shape
        assert torch.equal(ours[f"{prefix}.{projection}"], reference.float())
        assert torch.equal(
            ours[f"{prefix}.{projection}"], convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        )


# --- merges and the other commands ---------------------------------------------------------------------------


def dense_of(state: dict, config: dict, folder: Path, dtype) -> Path:
    """A pre-dequantized checkpoint: the float64 dequantization stored in `dtype`."""
    return save_dense({name: t.to(dtype) for name, t in state.items()}, {**config, "dtype": str(dtype)[6:]}, folder)


def same_bytes(folder, other) -> bool:
    """Two outputs hold the same tensors, byte for byte (their order in the file follows each base's)."""
    ours, theirs = load_file(folder / "model.safetensors"), load_file(other / "model.safetensors")
    return set(ours) == set(theirs) and all(
        ours[name].dtype == theirs[name].dtype
        and torch.equal(ours[name].reshape(-1).view(torch.uint8), theirs[name].reshape(-1).view(torch.uint8))
        for name in ours
    )


@pytest.mark.parametrize("architecture", ["llama", "qwen2_moe"])
def test_linear_merge_of_fp8_pairs_equals_the_merge_of_their_dense_checkpoints(tmp_path, architecture):
    """Power-of-two scales make the dequantized weights exact in bf16, so the bf16 dense checkpoints are the FP8
    models themselves: the merges are byte-identical. With any float32 scales, the float32 dense checkpoints."""
    pre_state, config = tiny_checkpoint(architecture, tmp_path / "pre-dense")
    post_state, _ = tiny_checkpoint(architecture, tmp_path / "post-dense", shift=0.02, seed=1)
    for power_of_two, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        kind = f"{'p2' if power_of_two else 'any'}"
        pre, pre_dense = save_fp8(pre_state, config, tmp_path / f"pre-{kind}", (8, 8), power_of_two)
        post, post_dense = save_fp8(post_state, config, tmp_path / f"post-{kind}", (8, 8), power_of_two)
        dense = [
            dense_of(s, config, tmp_path / f"{n}-{kind}-dense", dtype)
            for n, s in (("pre", pre_dense), ("post", post_dense))
        ]
        if power_of_two:
            assert all(torch.equal(t.to(dtype).double(), t) for t in post_dense.values())
        merged, reference = tmp_path / f"merged-{kind}", tmp_path / f"reference-{kind}"
        flags = ["--method", "linear", "--alpha", "0.5", "--dtype", "bfloat16"]
        assert cli("merge", "--base", pre, "--model", post, *flags, "--out", merged).returncode == 0
        assert cli("merge", "--base", dense[0], "--model", dense[1], *flags, "--out", reference).returncode == 0
        assert same_bytes(merged, reference)
        written = json.loads((merged / "config.json").read_text())
        assert "quantization_config" not in written and written["dtype"] == "bfloat16"
        assert "Dequantized inputs" in (merged / "README.md").read_text()


def test_a_bf16_pre_merges_with_an_fp8_post_and_the_output_loads(tmp_path):
    import transformers

    pre_state, config = tiny_checkpoint("llama", tmp_path / "pre-f32")
    post_state, _ = tiny_checkpoint("llama", tmp_path / "post-f32", shift=0.02, seed=1)
    pre = dense_of(pre_state, config, tmp_path / "pre", torch.bfloat16)
    post, post_dense = save_fp8(post_state, config, tmp_path / "post", (16, 16))
    post_f32 = dense_of(post_dense, config, tmp_path / "post-dense", torch.float32)
    merged, reference = tmp_path / "merged", tmp_path / "reference"
    result = cli("merge", "--base", pre, "--model", post, "--method", "linear", "--alpha", "0.5", "--out", merged)
    assert result.returncode == 0, result.stderr
    assert "dequantized from fp8 (16x16 blocks)" in result.stdout + result.stderr
    cli("merge", "--base", pre, "--model", post_f32, "--method", "linear", "--alpha", "0.5", "--out", reference)
    assert same_bytes(merged, reference)
    assert {t.dtype for t in load_file(merged / "model.safetensors").values()} == {torch.bfloat16}
    written = json.loads((merged / "config.json").read_text())
    assert "quantization_config" not in written
    loaded = transformers.AutoModelForCausalLM.from_pretrained(merged)
    assert not hasattr(loaded.config, "quantization_config")
    # the FP8 model as the base: its dequantized tensors are written in bf16
    swapped = tmp_path / "swapped"
    assert (
        cli(
            "merge", "--base", post, "--model", pre, "--method", "linear", "--alpha", "0.5", "--out", swapped
        ).returncode
        == 0
    )
    assert json.loads((swapped / "config.json").read_text())["dtype"] == "bfloat16"
    assert "quantization_config" not in json.loads((swapped / "config.json").read_text())


def test_drift_reads_a_quantized_post(tmp_path):
    pre_state, config = tiny_checkpoint("qwen2_moe", tmp_path / "pre")
    post_state, _ = tiny_checkpoint("qwen2_moe", tmp_path / "post-f32", shift=0.02, seed=1)
    post, post_dense = save_fp8(post_state, config, tmp_path / "post", (8, 8))
    post_f32 = dense_of(post_dense, config, tmp_path / "post-dense", torch.float32)
    quantized = cli("drift", tmp_path / "pre", post, "--json", "-q")
    dense = cli("drift", tmp_path / "pre", post_f32, "--json", "-q")
    assert quantized.returncode == 0, quantized.stderr
    assert json.loads(quantized.stdout)["tensors"] == json.loads(dense.stdout)["tensors"]


# --- refusals ------------------------------------------------------------------------------------------------


QWEIGHT = {"model.layers.0.mlp.up_proj.qweight": torch.zeros(2, 8, dtype=torch.int32)}
# (quantization_config or None for a layout-only checkpoint, extra tensors, the scheme the refusal names)
REFUSED = {
    "gptq": ({"quant_method": "gptq", "bits": 4}, QWEIGHT, "gptq"),
    "awq": ({"quant_method": "awq", "bits": 4}, QWEIGHT, "awq"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, {}, "bitsandbytes"),
    "hqq": ({"quant_method": "hqq"}, {}, "hqq"),
    "torchao": ({"quant_method": "torchao"}, {}, "torchao"),
    "compressed-int4": (
        {"quant_method": "compressed-tensors", "format": "pack-quantized"},
        {},
        "compressed-tensors pack-quantized",
    ),
    "gptq-layout": (None, QWEIGHT, "gptq or awq"),
    "bitsandbytes-layout": (None, {"model.layers.0.mlp.up_proj.weight.absmax": torch.zeros(4)}, "bitsandbytes"),
}
MERGE = ["merge", "--method", "linear", "--alpha", "0.5"]


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_other_schemes_are_refused_naming_them(tmp_path, case):
    settings, extra, scheme = REFUSED[case]
    state, config = tiny_checkpoint("llama", tmp_path / "pre")
    config = {**config, **({"quantization_config": settings} if settings else {})}
    save_dense({**state, **extra}, config, tmp_path / "quantized")
    merge = [*MERGE, "--base", tmp_path / "pre", "--model", tmp_path / "quantized", "--out", tmp_path / "out"]
    for command in (merge, ["drift", tmp_path / "pre", tmp_path / "quantized"]):
        one_error_line(cli(*command), 2, f"quantized with {re.escape(scheme)}[ ,]")
        assert not (tmp_path / "out").exists()


def test_gguf_is_refused_naming_it(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "model-q4.gguf").write_bytes(b"GGUF")
    tiny_checkpoint("llama", tmp_path / "pre")
    for quantized in (tmp_path / "model.gguf", tmp_path / "folder"):
        result = cli(
            "merge",
            "--base",
            tmp_path / "pre",
            "--model",
            quantized,
            "--method",
            "linear",
            "--alpha",
            "0.5",
            "--out",
            tmp_path / "out",
        )
        one_error_line(result, 2, "quantized with gguf")
        assert not (tmp_path / "out").exists()


# --- re-quantized output -------------------------------------------------------------------------------------


def test_out_quant_fp8_block_writes_the_merge_in_the_inputs_scheme(tmp_path):
    import transformers
    from transformers import FineGrainedFP8Config

    pre_state, config = tiny_checkpoint("qwen3", tmp_path / "pre-dense")
    post_state, _ = tiny_checkpoint("qwen3", tmp_path / "post-dense", shift=0.02, seed=1)
    pre, _ = save_fp8(pre_state, config, tmp_path / "pre", (8, 8))
    post, _ = save_fp8(post_state, config, tmp_path / "post", (8, 8))
    flags = ["--base", pre, "--model", post, "--method", "linear", "--alpha", "0.5"]
    assert cli("merge", *flags, "--out", tmp_path / "dense").returncode == 0
    result = cli("merge", *flags, "--out-quant", "fp8-block", "--out", tmp_path / "fp8")
    assert result.returncode == 0, result.stderr
    written = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert written["quantization_config"] == fp8_config((8, 8)) and written["dtype"] == "bfloat16"
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    merged = load_file(tmp_path / "dense" / "model.safetensors")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    ).state_dict()
    ours = read_all(tmp_path / "fp8")
    assert set(ours) == set(merged) == set(loaded)
    requantized = [name for name in merged if name + "_scale_inv" in stored]
    assert len(requantized) == 14 and all(stored[name].dtype == torch.float8_e4m3fn for name in requantized)
    for name, tensor in merged.items():
        assert torch.equal(ours[name].float(), loaded[name]), name
        if name not in requantized:
            assert torch.equal(ours[name], tensor), name
            continue
        # within e4m3's rounding: half a unit in the last of its 3 mantissa bits, or a subnormal step of the scale
        scale = stored[name + "_scale_inv"].repeat_interleave(8, 0).repeat_interleave(8, 1)
        bound = tensor.float().abs() / 16 + scale * 2.0**-10
        assert ((ours[name] - tensor.float()).abs() <= bound).all(), name
    # an input of another scheme, or a dense pair: nothing to re-quantize to
    refused = cli(
        "merge",
        "--base",
        tmp_path / "pre-dense",
        "--model",
        tmp_path / "post-dense",
        "--method",
        "linear",
        "--alpha",
        "0.5",
        "--out-quant",
        "fp8-block",
        "--out",
        tmp_path / "none",
    )
    one_error_line(refused, 2, "no input is one")
    assert not (tmp_path / "none").exists()


@pytest.mark.slow
def test_a_sweep_over_a_quantized_post_scores_as_over_its_dense_checkpoint(toy_pair, tmp_path):
    """The sweep's merges and its post read the FP8 post dequantized: every point scores as with the float32
    checkpoint of the same weights."""
    import shutil

    from mergekit_lite.sweep import SweepSettings, run_sweep

    post_dir = Path(toy_pair.post_dir)
    state = {name: t for shard in sorted(post_dir.glob("*.safetensors")) for name, t in load_file(shard).items()}
    config = json.loads((post_dir / "config.json").read_text())
    fp8, dense = save_fp8(state, config, tmp_path / "post-fp8", (16, 16))
    dense_dir = dense_of(dense, config, tmp_path / "post-dense", torch.float32)
    for folder in (fp8, dense_dir):
        for item in post_dir.iterdir():
            if not item.name.endswith(".safetensors") and item.name not in ("config.json", "README.md"):
                if item.name != "model.safetensors.index.json" and item.is_file():
                    shutil.copy(item, folder / item.name)
    scores = []
    for post in (fp8, dense_dir):
        settings = SweepSettings(
            str(toy_pair.pre_dir),
            str(post),
            "linear",
            [0.5],
            toy_pair.old_tasks,
            toy_pair.new_tasks,
            str(toy_pair.task_dir),
            str(tmp_path / f"sweep-{post.name}"),
            limit=8,
        )
        result = run_sweep(settings)
        scores.append([(point.old, point.new) for point in (result.pre, result.post, *result.points)])
    assert scores[0] == scores[1]


def test_extract_reads_a_quantized_fine_tune(tmp_path):
    """The adapter extracted from an FP8 fine-tune is the one extracted from its dense bf16 checkpoint (power-of-two
    scales: the same weights exactly)."""
    base_state, config = tiny_checkpoint("llama", tmp_path / "base")
    tuned_state, _ = tiny_checkpoint("llama", tmp_path / "tuned-f32", shift=0.02, seed=1)
    tuned, tuned_dense = save_fp8(tuned_state, config, tmp_path / "tuned", (16, 16), power_of_two=True)
    dense = dense_of(tuned_dense, config, tmp_path / "tuned-dense", torch.bfloat16)
    adapters = []
    for model in (tuned, dense):
        out = tmp_path / f"adapter-{model.name}"
        result = cli("extract", "--base", tmp_path / "base", "--model", model, "--rank", "4", "--out", out, "-q")
        assert result.returncode == 0, result.stderr
        adapters.append(load_file(out / "adapter_model.safetensors"))
    assert set(adapters[0]) == set(adapters[1])
    assert all(torch.equal(adapters[0][name], adapters[1][name]) for name in adapters[0])


def test_the_requantizer_against_the_float64_quantizer():
    """`fp8_blocks` gives the scales of the float64 quantizer above (to float32 rounding) and codes within one
    e4m3 step of its own, partial blocks included; scaled_dense inverts it to e4m3's rounding."""
    from mergekit_lite.io.quantized import fp8_blocks

    weight = torch.randn(300, 200, generator=torch.Generator().manual_seed(1))
    weight[:128, :128] = 0  # an all-zero block: scale 1
    codes, scales = fp8_blocks(weight, (128, 128))
    reference_codes, reference_scales = quantize_blocks(weight, (128, 128))
    assert scales.shape == (3, 2) and scales[0, 0] == 1
    assert torch.allclose(scales, reference_scales, rtol=1e-6, atol=0)
    assert (codes.float() - reference_codes.float()).abs().max() <= 32  # one step at e4m3's top binade
    assert (codes.float() == reference_codes.float()).float().mean() > 0.99
    back = scaled_dense(codes.float(), scales, (128, 128))
    by_entry = scales.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert ((back - weight).abs() <= weight.abs() / 16 + by_entry * 2.0**-10).all()


def test_an_adapter_is_audited_against_a_quantized_base_read_dense(tmp_path):
    """The audit reads an FP8 base dequantized: its tensors are the dense base's, so the adapter's modules are found
    and no check calls the base quantised."""
    from test_audit import make_adapter
    from tiny_models import tiny_llama

    from mergekit_lite.audits.adapter import audit_adapter

    tiny_llama(0).save_pretrained(tmp_path / "base")
    adapter = make_adapter(tmp_path / "base", tmp_path / "adapter", ["q_proj", "v_proj"], steps=3)
    state = load_file(tmp_path / "base" / "model.safetensors")
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    fp8, _ = save_fp8(state, config, tmp_path / "base-fp8", (16, 16))
    report = audit_adapter(adapter, fp8)
    assert not any("quantised" in reason for reason in report.reasons), report.reasons
    statuses = {check.name: check.status for check in report.checks}
    assert statuses["structure"] == "pass"
