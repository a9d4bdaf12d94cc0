"""Checkpoints whose weights are already quantized: which ones are read per expert (fine-grained FP8; MXFP4 on
GPT-OSS; GPTQ, AWQ and compressed-tensors packed integers) and how their non-expert part is loaded dequantized;
every other `quantization_config` is refused before anything is allocated, naming its method.

Fine-grained FP8 (`quant_method` "fp8" with a `weight_block_size`): transformers loads the non-expert part
dequantized to the model dtype (its `dequantize=True` load, forced so a GPU machine does the same); each expert's FP8
matrices and block scales are located per expert and dequantized by the store as they are read. MXFP4 GPT-OSS
checkpoints go the same way with `Mxfp4Config(dequantize=True)`. GPTQ, AWQ and compressed-tensors checkpoints
(`checkpoint_packed_format`, rules in `packed_formats`) are loaded by `packed_load`: experts kept packed, the rest
dequantized by hf_moe_offload itself (transformers needs gptqmodel/autoawq, and a GPU, for the first two).
"""

from __future__ import annotations

import copy

from torch import nn
from transformers import FineGrainedFP8Config, Mxfp4Config
from transformers.integrations.mxfp4 import Mxfp4Dequantize

from ..policy.offload_policy import PolicyError
from ..storage.packed_int import PackedFormat
from .packed_formats import PACKED_METHODS, SUPPORTED_PACKED, UnreadPackedFormat, packed_format

SUPPORTED_CHECKPOINT_QUANTIZATION = ("fine-grained FP8 (quant_method='fp8' with weight_block_size [rows, cols], "
                                     "fmt 'e4m3', float block scales weight_scale_inv: DeepSeek-V3, Qwen3-*-FP8), "
                                     "MXFP4 for GPT-OSS only (quant_method='mxfp4': openai/gpt-oss-20b, -120b), "
                                     f"{SUPPORTED_PACKED}")
# Model types whose MXFP4 checkpoints are read per expert (arch/gpt_oss.py; transformers quantizes no other).
MXFP4_MODEL_TYPES = ("gpt_oss",)


def _quantization_configs(config) -> list:
    """The `quantization_config`s of `config` and of its text config (a dict, or transformers' config object)."""
    cfgs = {id(c): c for c in (config, getattr(config, "get_text_config", lambda: config)())}.values()
    return [qc for qc in (getattr(c, "quantization_config", None) for c in cfgs) if qc is not None]

def _qc_get(qc, name: str):
    value = qc.get(name) if isinstance(qc, dict) else getattr(qc, name, None)
    return getattr(value, "value", value)       # enums (QuantizationMethod) as their string

def _fp8_problem(qc) -> str | None:
    """Why an fp8 `quantization_config` is not the fine-grained layout hf_moe_offload reads, or None if it is."""
    block = _qc_get(qc, "weight_block_size")
    if block is None:
        return "without weight_block_size (per-tensor scales)"
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        return f"with weight_block_size={block!r} (expected two positive ints)"
    for name, allowed in (("fmt", "e4m3"), ("scale_fmt", "float"), ("expert_dtype", "fp8")):
        value = _qc_get(qc, name)
        if value not in (None, allowed):
            return f"with {name}={value!r} (only {allowed!r} is read)"
    return None

def checkpoint_block_size(config) -> tuple[int, int] | None:
    """The FP8 `weight_block_size` of a fine-grained FP8 checkpoint, None for a float checkpoint; any other
    `quantization_config` that is not read (mxfp4 beyond GPT-OSS, bitsandbytes, hqq, fp8 without block scales, GPTQ
    of 3 bits, ...) is refused with a `PolicyError` naming its method and listing what is read; GPTQ, AWQ and
    compressed-tensors configs that are read give None (`checkpoint_packed_format`). Raised before anything is
    allocated.

    Example:
        >>> from types import SimpleNamespace
        >>> checkpoint_block_size(SimpleNamespace(quantization_config={"quant_method": "fp8",
        ...                                                            "weight_block_size": [128, 128]}))
        (128, 128)
    """
    for qc in _quantization_configs(config):
        method = _qc_get(qc, "quant_method") or "unknown"
        problem = _fp8_problem(qc) if method == "fp8" else None
        if method == "fp8" and problem is None:
            return tuple(_qc_get(qc, "weight_block_size"))
        if method in PACKED_METHODS:
            problem = _packed_problem(qc)
            if problem is None:
                continue                              # read per expert: `checkpoint_packed_format`
        if method == "mxfp4":
            if _model_type(config) in MXFP4_MODEL_TYPES:
                continue                              # read per expert: `checkpoint_is_mxfp4`
            problem = f"on model type {_model_type(config)!r} (MXFP4 is read for {list(MXFP4_MODEL_TYPES)} only)"
        raise PolicyError(f"this checkpoint's weights are already quantized (quantization_config with quant_method="
                          f"{method!r}{' ' + problem if problem else ''}), which hf_moe_offload cannot read per "
                          f"expert; it reads experts stored as float tensors (float32, float16, bfloat16) or "
                          f"{SUPPORTED_CHECKPOINT_QUANTIZATION}. Use the checkpoint's unquantized weights, and "
                          f"offload_policy {{'quantize': 'int8'}} or {{'quantize': 'int4'}} to store the experts "
                          f"quantized")
    return None

def checkpoint_is_mxfp4(config) -> bool:
    """Whether `config` is an MXFP4 checkpoint whose experts hf_moe_offload reads per expert (GPT-OSS: quant_method
    "mxfp4"); MXFP4 on another model type is refused by `checkpoint_block_size`.

    Example:
        >>> from types import SimpleNamespace
        >>> checkpoint_is_mxfp4(SimpleNamespace(model_type="gpt_oss", quantization_config={"quant_method": "mxfp4"}))
        True
    """
    return _model_type(config) in MXFP4_MODEL_TYPES and any(
        _qc_get(qc, "quant_method") == "mxfp4" for qc in _quantization_configs(config))

def _packed_problem(qc) -> str | None:
    """Why a GPTQ/AWQ/compressed-tensors `quantization_config` is not read, or None if it is."""
    try:
        packed_format(qc)
    except UnreadPackedFormat as err:
        return f"with {err.problem}"
    return None

def checkpoint_packed_format(config) -> PackedFormat | None:
    """The `PackedFormat` of a GPTQ, AWQ or compressed-tensors checkpoint whose packed weights are read, None for
    any other checkpoint (`checkpoint_block_size`, called first, refuses the variants that are not read).

    Example:
        >>> from types import SimpleNamespace
        >>> checkpoint_packed_format(SimpleNamespace(quantization_config={"quant_method": "awq", "bits": 4,
        ...                                                                "group_size": 64})).method
        'awq'
    """
    formats = [packed_format(qc) for qc in _quantization_configs(config) if _packed_problem(qc) is None]
    return next((f for f in formats if f is not None), None)

def _model_type(config) -> str | None:
    return getattr(config, "model_type", None)

def refuse_quantized_checkpoint(config) -> None:
    """For a model already built (`enable`): refuse one whose weights are quantized in memory. A fine-grained FP8
    or MXFP4 model that transformers loaded with `dequantize=True` (its CPU default) holds float weights and is
    accepted, as is a model loaded from GGUF (transformers dequantizes every tensor as it loads)."""
    if any(_qc_get(qc, "quant_method") == "gguf" for qc in _quantization_configs(config)):
        return
    if checkpoint_is_mxfp4(config):
        if not all(_qc_get(qc, "dequantize") for qc in _quantization_configs(config)):
            raise PolicyError("this model holds MXFP4 experts (loaded without dequantize); load it with "
                              "from_pretrained(..., offload_policy=...), which reads the MXFP4 experts per expert, "
                              "or with quantization_config=Mxfp4Config(dequantize=True) before enable()")
        return
    if checkpoint_packed_format(config) is not None:
        raise PolicyError("this model's config has a GPTQ/AWQ/compressed-tensors quantization_config: its layers are "
                          "packed integers, which enable() cannot offload; load it with from_pretrained(path, "
                          "offload_policy=...), which keeps the experts packed and dequantizes the rest")
    if checkpoint_block_size(config) is None:
        return
    if not all(_qc_get(qc, "dequantize") for qc in _quantization_configs(config)):
        raise PolicyError("this model holds FP8 weights (loaded without dequantize); load it with "
                          "from_pretrained(..., offload_policy=...), which reads the FP8 experts per expert, or with "
                          "quantization_config=FineGrainedFP8Config(dequantize=True) before enable()")

def dequantizing_fp8_config(config, given):
    """The `quantization_config=` that makes transformers load a fine-grained FP8 checkpoint dequantized to the model
    dtype, as it does by itself without a GPU: the resident part is then dense, like the experts the store
    dequantizes."""

    return _dequantizing_config(config, given, FineGrainedFP8Config,
                                lambda qc: {"weight_block_size": list(_qc_get(qc, "weight_block_size"))})

def dequantizing_mxfp4_config(config, given):
    """The `quantization_config=` that makes transformers load an MXFP4 GPT-OSS checkpoint's non-expert part as it
    does by itself without a GPU kernel (`Mxfp4Config(dequantize=True)`): dense, like the experts the store
    dequantizes."""

    return _dequantizing_config(config, given, Mxfp4Config, lambda qc: {})

def _dequantizing_config(config, given, config_class: type, from_checkpoint):
    """A user's `config_class` instance with `dequantize` set (its other attributes kept), any other given config
    as is (transformers names the mismatch with the checkpoint's method), else one built from the checkpoint's
    quantization config: `from_checkpoint(qc)`'s fields and its `modules_to_not_convert`."""
    if isinstance(given, config_class):
        given = copy.copy(given)
        given.dequantize = True
        return given
    if given is not None:
        return given
    qc = _quantization_configs(config)[0]
    return config_class(**from_checkpoint(qc), modules_to_not_convert=_qc_get(qc, "modules_to_not_convert"),
                        dequantize=True)

def forget_mxfp4_conversions(model: nn.Module) -> None:
    """Drop the MXFP4 converters (`*_blocks` + `*_scales` -> dense weight) transformers attached to `model` for its
    load: `save_pretrained` reverses them, and would write the dense experts under the `*_blocks` names (transformers'
    own dequantized MXFP4 model saves such an unloadable checkpoint). Without them it saves a dense checkpoint, the
    `quantization_config` being gone from the config after a dequantized load."""

    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [c for c in conversions
                                     if not any(isinstance(op, Mxfp4Dequantize) for op in getattr(c, "operations", ()))]
