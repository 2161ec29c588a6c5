"""Evaluation backends other than the in-memory HF model: lm-eval's vLLM backend.

vLLM loads weights from a folder, so a point evaluated with it is merged into a scratch folder by the
streaming merge first (vLLM has no supported way to replace a loaded model's weights in place). This
module only builds lm-eval's arguments: it is pure, so it is tested here although vLLM needs a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from mergekit_lite.errors import InputError
from mergekit_lite.evaluate.lm_eval_settings import setting_items

BACKENDS = ("hf", "vllm")
VLLM_DTYPES = ("auto", "float16", "bfloat16", "float32")


@dataclass(frozen=True)
class VllmOptions:
    """lm-eval's vLLM model arguments that matter for a sweep (lm_eval/models/vllm_causallms.py)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    dtype: str = "auto"
    batch_size: str = "auto"
    seed: int = 1234

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"vllm {name} must be a whole number >= 1, got {value!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InputError(f"vllm gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InputError(f"vllm max_model_len must be >= 1, got {self.max_model_len!r}")
        if self.dtype not in VLLM_DTYPES:
            raise InputError(f"vllm dtype must be one of {', '.join(VLLM_DTYPES)}, got {self.dtype!r}")

    @property
    def gpus(self) -> int:
        """GPUs one evaluation holds: tensor parallel times data parallel."""
        return self.tensor_parallel_size * self.data_parallel_size


def parse_vllm_options(text: str | None) -> VllmOptions:
    """`tensor_parallel_size=2,gpu_memory_utilization=0.8` (lm-eval's model_args syntax) -> VllmOptions."""
    if not text:
        return VllmOptions()
    types = {field.name: field.type for field in fields(VllmOptions)}
    values: dict[str, object] = {}
    for name, raw in setting_items("--vllm-args", text):
        if name not in types:
            raise InputError(f"--vllm-args: {name!r} is not one of {', '.join(types)}")
        values[name] = _convert(name, raw, types[name])
    return VllmOptions(**values)


def _convert(name: str, raw: str, kind: str):
    try:
        if kind.startswith("int"):
            return None if raw.lower() == "none" and "None" in kind else int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise InputError(f"--vllm-args: {name}={raw!r} is not a number") from None
    return raw


def vllm_model_args(model_folder: str, tokenizer_folder: str, options: VllmOptions) -> dict:
    """The model_args lm-eval's `vllm` model takes for one merged model folder."""
    args = {
        "pretrained": str(model_folder),
        "tokenizer": str(tokenizer_folder),
        "dtype": options.dtype,
        "tensor_parallel_size": options.tensor_parallel_size,
        "data_parallel_size": options.data_parallel_size,
        "gpu_memory_utilization": options.gpu_memory_utilization,
        "batch_size": options.batch_size,
        "seed": options.seed,
    }
    if options.max_model_len is not None:
        args["max_model_len"] = options.max_model_len
    return args
