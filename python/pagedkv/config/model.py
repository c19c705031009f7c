"""What to load and how to run it (:class:`ModelConfig`), and the defaults chosen for the
machine (eager or compiled, which linear kernel)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from pagedkv.config.fields import check_bool, documented, is_int, positive_int, setting, torch_name
from pagedkv.errors import ConfigError

__all__ = [
    "ATTENTION_BACKENDS",
    "DTYPES",
    "ENFORCE_EAGER_ENV_VAR",
    "LINEAR_KERNELS",
    "QUANTIZATIONS",
    "ModelConfig",
    "resolve_enforce_eager",
    "resolve_linear_kernel",
]

# Model dtypes the runner serves ("auto": bf16 on CUDA when supported, float32 on the CPU).
DTYPES = ("auto", "float32", "float", "float16", "half", "bfloat16")
ATTENTION_BACKENDS = (None, "auto", "triton", "cpu", "torch")
LINEAR_KERNELS = ("auto", "torch", "pagedkv", "onednn")
# Earlier names of linear kernels, still accepted: "default" was torch's products' name while
# they were the default.
_LINEAR_KERNEL_ALIASES = {"default": "torch"}
# Weight quantization applied when the model loads (None: the checkpoint's weights as they are;
# "auto": a GGUF model's own blocks on the CPU, else None; "none" is read as None).
QUANTIZATIONS = (None, "int8", "bf16", "gguf", "auto")
_DEVICE = re.compile(r"^(auto|cpu|cuda)(:\d+)?$")

# Pins ``enforce_eager`` where a ModelConfig leaves it None: "1" eager, "0" compiled. For a
# process that starts many short-lived engines (a test suite, a notebook) where compiling each
# would cost more than it saves; an explicit ``enforce_eager`` wins over it.
ENFORCE_EAGER_ENV_VAR = "PAGEDKV_ENFORCE_EAGER"
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


def resolve_enforce_eager(enforce_eager: bool | None, device_type: str) -> bool:
    """Whether the engine runs eager: ``enforce_eager`` when it is set, else
    ``PAGEDKV_ENFORCE_EAGER`` when that is set, else compiled on the CPU (the compiled forward
    is saved, so only a machine's first start pays the compile) and eager on a GPU."""
    if enforce_eager is not None:
        return enforce_eager
    pinned = os.environ.get(ENFORCE_EAGER_ENV_VAR, "").strip().lower()
    if pinned in _TRUE_WORDS:
        return True
    if pinned in _FALSE_WORDS:
        return False
    if pinned:
        raise ConfigError(f"{ENFORCE_EAGER_ENV_VAR} must be 1 or 0 (or unset), got {pinned!r}")
    return device_type != "cpu"


def resolve_linear_kernel(linear_kernel: str, device_type: str, dtype_name: str, quantization: str | None) -> str:
    """The linear kernel ``linear_kernel`` means for a model of ``dtype_name`` (``"float32"``,
    ...) on ``device_type`` with ``quantization`` resolved: itself, or for ``"auto"`` pagedkv's
    kernel where it applies (float32 on the CPU, weights as loaded or GGUF blocks; it hands products of more than 32 rows to torch, the faster
    one there) and torch's products elsewhere."""
    if linear_kernel != "auto":
        return linear_kernel
    if device_type == "cpu" and dtype_name == "float32" and quantization in (None, "gguf"):
        return "pagedkv"  # with "gguf": the linears whose tensors are not in blocks
    return "torch"


@documented
@dataclass(frozen=True)
class ModelConfig:
    """What to load and how to run it."""

    model: str | None = setting(
        None,
        'Hugging Face model id or folder, or ``"gemma-3-270m"`` (the embedded Gemma 3 270M); ``None`` = the '
        "embedded SmolLM2-135M-Instruct.",
    )
    tokenizer: str | None = setting(None, "tokenizer id or folder (default: the model's).")
    dtype: str = setting(
        "auto",
        '``"auto"`` (bf16 on CUDA when supported, float32 on the CPU), ``"float32"``, ``"float16"``, '
        '``"bfloat16"`` (or ``"float"`` / ``"half"``, or a ``torch.dtype``).',
    )
    device: str = setting(
        "auto", '``"auto"`` (CUDA if available), ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (or a ``torch.device``).'
    )
    max_model_len: int | None = setting(
        None,
        "longest sequence (prompt + output); ``None`` = the model's declared context length. Above it the "
        "runner warns (``UserWarning``) and serves it anyway.",
    )
    attention_backend: str | None = setting(
        None,
        '``"triton"``, ``"cpu"``, ``"torch"``, ``"auto"`` or ``None`` (``PAGEDKV_ATTENTION_BACKEND`` if set, '
        "else Triton on CUDA and the Rust decode kernel + torch on the CPU); resolved once, when the runner "
        "is built.",
    )
    seed: int = setting(0, "seed of the global generator used by unseeded random sampling.")
    trust_remote_code: bool = setting(
        False,
        "run the Python code a model repository ships (transformers' option of the same name); only for "
        "repositories you trust.",
    )
    max_logprobs: int = setting(
        20,
        "the most log-probabilities a request may ask for per token (``SamplingParams.logprobs``; vLLM's "
        "value): more is refused when the request is added, before any work (the answer's size grows "
        "with it).",
    )
    linear_kernel: str = setting(
        "auto",
        "``\"auto\"`` (pagedkv's kernel for a float32 model on the CPU without ``quantization``, torch's "
        'products otherwise; :func:`resolve_linear_kernel`), ``"torch"`` (torch\'s matrix products: MKL on the '
        'CPU), ``"pagedkv"`` (CPU, float32: products of up to 32 rows, i.e. decode steps, through pagedkv\'s '
        "own kernel, which streams the weights faster than MKL; :mod:`pagedkv.worker.cpu_linear`) or "
        '``"onednn"`` (CPU, float32: the linears through oneDNN with prepacked weights, which take twice the '
        "memory; :mod:`pagedkv.worker.onednn_linear`). Logits differ from torch's in the last bits with any "
        'but ``"torch"``.',
    )
    quantization: str | None = setting(
        None,
        '``None`` (the weights as loaded; a GGUF model runs dequantized to float32), ``"int8"`` (CPU: every '
        "linear's weight stored as int8 with a float32 scale per output channel, multiplied by pagedkv's CPU "
        "kernel on float32 inputs; a quarter of the linears' memory; :mod:`pagedkv.worker.int8_linear`), "
        '``"bf16"`` (CPU: every linear\'s weight stored as bfloat16, the rest of the model float32; half the '
        "linears' memory; with AVX512-BF16 the inputs are rounded to bfloat16 too; "
        ':mod:`pagedkv.worker.bf16_linear`), ``"gguf"`` (CPU, a GGUF model: the linears whose tensors are '
        "Q4_0, Q4_1, Q8_0 or Q4_K multiplied straight from those blocks; :mod:`pagedkv.worker.gguf_linear`) "
        'or ``"auto"`` (``"gguf"`` for a GGUF model, a ``.gguf`` file or an embedded model, on the CPU '
        'without tensor parallelism, else ``None``); ``"none"`` is ``None``.',
    )
    enforce_eager: bool | None = setting(
        None,
        "``True`` runs the model op by op (``--enforce-eager``); ``False`` (``--no-enforce-eager``) runs each "
        "step's forward under ``torch.compile``: one graph for every step size, compiled as the engine starts "
        "and saved whole beside inductor's cache, so a later process loads it in a second or two, except "
        'with ``linear_kernel="torch"``, whose frozen graph compiles at every start; on a GPU (Triton '
        "attention, no tensor parallelism), decode steps of up to ``min(max_num_seqs, 256)`` sequences replay "
        "CUDA graphs captured at start (:mod:`pagedkv.worker.decode_graphs`); logits not bit-identical to "
        "eager. ``None``: ``PAGEDKV_ENFORCE_EAGER`` if set (``1`` / ``0``), else compiled on the CPU and eager "
        "on a GPU (:func:`resolve_enforce_eager`).",
    )

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
            elif value is not None and not isinstance(value, str):
                raise ConfigError(f"{name} must be a model id or folder (str), got {value!r}")
        dtype = torch_name(self.dtype)
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES} or a torch.dtype of them, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        device = torch_name(self.device)
        if not isinstance(device, str) or not _DEVICE.match(device) or device.startswith("auto:"):
            raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        object.__setattr__(self, "device", device)
        positive_int("max_model_len", self.max_model_len, optional=True)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend must be None, 'auto', 'triton', 'cpu' or 'torch', got {self.attention_backend!r}"
            )
        if self.attention_backend == "cpu" and device.startswith("cuda"):
            raise ConfigError(f"attention_backend 'cpu' runs on the CPU, but device is {device!r}")
        if not is_int(self.seed):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        check_bool("trust_remote_code", self.trust_remote_code)
        if not is_int(self.max_logprobs) or self.max_logprobs < 0:
            raise ConfigError(f"max_logprobs must be an int >= 0, got {self.max_logprobs!r}")
        if self.enforce_eager is not None:
            check_bool("enforce_eager", self.enforce_eager)
        object.__setattr__(self, "linear_kernel", _LINEAR_KERNEL_ALIASES.get(self.linear_kernel, self.linear_kernel))
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ConfigError(f"linear_kernel must be one of {LINEAR_KERNELS}, got {self.linear_kernel!r}")
        explicit_kernel = self.linear_kernel not in ("auto", "torch")
        if explicit_kernel and (device.startswith("cuda") or dtype not in ("auto", "float32", "float")):
            raise ConfigError(
                f"linear_kernel {self.linear_kernel!r} runs float32 linears on the CPU, but device is {device!r} "
                f"and dtype {dtype!r}"
            )
        if self.quantization == "none":
            object.__setattr__(self, "quantization", None)
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization == "gguf" and device.startswith("cuda"):
            raise ConfigError(f"quantization 'gguf' runs pagedkv's CPU GGUF kernel, but device is {device!r}")
        if self.quantization in ("int8", "bf16"):
            if device.startswith("cuda"):
                raise ConfigError(
                    f"quantization {self.quantization!r} runs pagedkv's CPU linear kernel, but device is {device!r}"
                )
            if explicit_kernel:
                raise ConfigError(
                    f"quantization {self.quantization!r} has its own linears; it cannot be combined with linear_kernel "
                    f"{self.linear_kernel!r}"
                )
