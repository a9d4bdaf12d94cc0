"""Which GPTQ, AWQ and compressed-tensors checkpoints are read, from their `quantization_config`: the
`PackedFormat` to read them with, or an `UnreadPackedFormat` naming what is not read (which
`quantized_checkpoints` turns into the `PolicyError` listing what is), before anything is allocated.

- GPTQ (`quant_method: "gptq"`): 4 or 8 bits, any `group_size` (-1: per channel), symmetric or not, `desc_act`
  (act-order: the group of each input is read from `g_idx`), `checkpoint_format` "gptq" (zeros stored minus 1) or
  "gptq_v2".
- AWQ (`quant_method: "awq"`): 4 bits, GEMM packing (`version` "gemm"; "exllama" and "ipex" name load kernels over
  the same files), with zero points.
- compressed-tensors (`quant_method: "compressed-tensors"`, llm-compressor): `format` "pack-quantized", integer
  weights of 4 or 8 bits, strategy "group" or "channel", symmetric or not, weight-only (W4A16, W8A16: no input
  activation or KV cache quantization), no act-order `g_idx`, no sparsity or transforms.

Example:
    >>> packed_format({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True})
    PackedFormat(method='gptq', bits=4, group_size=128, zero_offset=1, symmetric=False, act_order=False)
"""

from __future__ import annotations

from typing import Any

from ..storage.packed_int import PackedFormat

PACKED_METHODS = ("gptq", "awq", "compressed-tensors")
SUPPORTED_PACKED = ("GPTQ 4/8-bit (quant_method='gptq', checkpoint_format 'gptq' or 'gptq_v2', act-order included), "
                    "AWQ 4-bit GEMM (quant_method='awq'), compressed-tensors pack-quantized int4/int8 weight-only "
                    "(quant_method='compressed-tensors', format 'pack-quantized', W4A16/W8A16, group or channel)")
_AWQ_VERSIONS = ("gemm", "exllama", "ipex")      # one packing on disk; the others name load-time kernels


def _get(qc: Any, name: str, default: Any = None) -> Any:
    value = qc.get(name, default) if isinstance(qc, dict) else getattr(qc, name, default)
    return getattr(value, "value", value)        # enums as their string


class UnreadPackedFormat(ValueError):
    """A GPTQ/AWQ/compressed-tensors variant that is not read; `problem` says which setting, and what is read."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem


def packed_format(qc: Any) -> PackedFormat | None:
    """The `PackedFormat` of a GPTQ/AWQ/compressed-tensors `quantization_config` (a dict or transformers' config
    object), None for another method; a variant that is not read raises `UnreadPackedFormat` naming it."""
    method = _get(qc, "quant_method")
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    if method == "compressed-tensors":
        return _compressed(qc)
    return None


def _group_size(value: Any) -> int:
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or value > 0):
        raise UnreadPackedFormat(f"group_size={value!r} (expected a positive int, or -1 for one group per channel)")
    return value


def _gptq(qc: Any) -> PackedFormat:
    bits = _get(qc, "bits")
    if bits not in (4, 8):
        raise UnreadPackedFormat(f"bits={bits!r} (4 and 8 are read)")
    fmt = _get(qc, "checkpoint_format") or _get(qc, "format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise UnreadPackedFormat(f"checkpoint_format={fmt!r} (the 'gptq' and 'gptq_v2' packings are read)")
    if _get(qc, "dynamic"):      # GPTQModel's per-module overrides (bits, group size) or exclusions
        raise UnreadPackedFormat(f"dynamic={_get(qc, 'dynamic')!r} (one bits and group_size for every layer is "
                                 f"read)")
    return PackedFormat("gptq", bits, _group_size(_get(qc, "group_size", 128)),
                        zero_offset=1 if fmt == "gptq" else 0, act_order=bool(_get(qc, "desc_act", False)))


def _awq(qc: Any) -> PackedFormat:
    bits = _get(qc, "bits", _get(qc, "w_bit"))
    if bits != 4:
        raise UnreadPackedFormat(f"bits={bits!r} (4 is read)")
    version = str(_get(qc, "version", "gemm") or "gemm").lower()
    if version not in _AWQ_VERSIONS:
        raise UnreadPackedFormat(f"version={version!r} (the GEMM packing is read: version {list(_AWQ_VERSIONS)})")
    if _get(qc, "zero_point", True) is False:
        raise UnreadPackedFormat("zero_point=False (AWQ GEMM checkpoints with zero points are read)")
    group = _group_size(_get(qc, "group_size", _get(qc, "q_group_size", 128)))
    return PackedFormat("awq", 4, group)


def _compressed(qc: Any) -> PackedFormat:
    """compressed-tensors: every config group must quantize weights alike (one format for all packed layers)."""
    for name in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        value = _get(qc, name)
        if value and not (name == "sparsity_config" and _get(value, "format") == "dense"):
            raise UnreadPackedFormat(f"{name} set (only weight quantization is read)")
    status = _get(qc, "quantization_status", "compressed")
    if status != "compressed":
        raise UnreadPackedFormat(f"quantization_status={status!r} (checkpoints saved 'compressed' are read)")
    groups = _get(qc, "config_groups") or {}
    if not groups:
        raise UnreadPackedFormat("no config_groups")
    formats = {_compressed_group(qc, name, group) for name, group in groups.items()}
    if len(formats) > 1:
        raise UnreadPackedFormat(f"config groups that quantize weights differently ({sorted(groups)})")
    return formats.pop()


def _compressed_group(qc: Any, name: str, group: Any) -> PackedFormat:
    fmt = _get(group, "format") or _get(qc, "format")
    if fmt != "pack-quantized":
        raise UnreadPackedFormat(f"format={fmt!r} in config group {name!r} ('pack-quantized' is read)")
    if _get(group, "input_activations") or _get(group, "output_activations"):
        raise UnreadPackedFormat(f"activation quantization in config group {name!r} (weight-only "
                                            f"schemes such as W4A16 and W8A16 are read)")
    weights = _get(group, "weights") or {}
    kind, bits, strategy = _get(weights, "type", "int"), _get(weights, "num_bits"), _get(weights, "strategy")
    if kind != "int" or bits not in (4, 8):
        raise UnreadPackedFormat(f"{kind} weights of {bits} bits in config group {name!r} (int4 and "
                                            f"int8 are read)")
    if strategy not in ("group", "channel"):
        raise UnreadPackedFormat(f"strategy={strategy!r} in config group {name!r} ('group' and "
                                            f"'channel' are read)")
    if _get(weights, "actorder") not in (None, "weight"):
        raise UnreadPackedFormat(f"actorder={_get(weights, 'actorder')!r} in config group {name!r} (a "
                                            f"g_idx per layer; actorder None or 'weight' is read)")
    if _get(weights, "dynamic", False):
        raise UnreadPackedFormat(f"dynamic weight quantization in config group {name!r}")
    group_size = _group_size(_get(weights, "group_size")) if strategy == "group" else -1
    return PackedFormat("compressed-tensors", bits, group_size, symmetric=bool(_get(weights, "symmetric", True)))
