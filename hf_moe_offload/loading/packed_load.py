"""Loading a GPTQ, AWQ or compressed-tensors checkpoint offloaded: experts kept packed, everything else dense.

transformers cannot load GPTQ or AWQ without gptqmodel/autoawq and a GPU kernel, so hf_moe_offload does not ask it
to: transformers loads a float model (the config without its `quantization_config`), and for that one call the
checkpoint it reads is rewritten on the fly (`packed_layers_dense`): each packed non-expert layer (attention
projections, shared experts, ...) becomes its dense `<module>.weight`, dequantized by the format's reference
arithmetic (`storage.packed_int`) in the scales' dtype and cast by transformers to the model dtype; each packed
expert layer becomes a meta placeholder of its dense shape, which the experts' "meta" placement leaves unread. The
experts are then read per expert, packed, by a `PackedSlabLayout` store, and dequantized as they enter a CPU cache's
dense slots, or where they compute on CUDA.

Example:
    >>> with packed_layers_dense(index, expert_modules(pieces)):          # doctest: +SKIP
    ...     model = AutoModelForCausalLM.from_pretrained(path, config=float_config(config))
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from typing import Any

import torch
import transformers.modeling_utils as modeling_utils

from ..layout import ExpertPiece, MoELayer
from ..policy.offload_policy import OffloadPolicy, PolicyError
from ..storage.dequantizing_store import dense_store_for
from ..storage.packed_checkpoint import PackedCheckpointIndex, PackedSource, read_packed
from ..storage.packed_int import dequantize
from ..storage.packed_layout import PackedSlabLayout
from ..storage.store import CpuStore, DiskStore, ExpertStore

logger = logging.getLogger(__name__)

_active = threading.local()         # this thread's offloaded load: (index, expert modules)
_lock = threading.Lock()
_users = 0
_original: dict[str, Any] = {}


def float_config(config):
    """A copy of `config` without its `quantization_config` (nor its text config's): transformers then builds and
    loads a float model, which `packed_layers_dense` feeds dense weights."""
    config = copy.deepcopy(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for c in {id(c): c for c in (config, text)}.values():
        if getattr(c, "quantization_config", None) is not None:
            delattr(c, "quantization_config")
    return config


def refuse_policy_quantize(policy: OffloadPolicy) -> None:
    """quantize='int8'/'int4' would requantize weights that are already integers: refused."""
    if policy.quantize != "none":
        raise PolicyError(f"quantize={policy.quantize!r} cannot be combined with a GPTQ/AWQ/compressed-tensors "
                          f"checkpoint: its experts are already stored as packed integers and are kept so (read, "
                          f"cached and moved at their packed size); allowed: quantize='none'")


def expert_modules(pieces: list[list[list[ExpertPiece]]]) -> set[str]:
    """The packed layers that hold experts (left unread by transformers)."""
    return {p.source.module for layer in pieces for expert in layer for p in expert
            if isinstance(p.source, PackedSource)}


def packed_layouts(layers: list[MoELayer], pieces: list[list[list[ExpertPiece]]], index: PackedCheckpointIndex,
                   dtype: torch.dtype) -> list[PackedSlabLayout]:
    """One `PackedSlabLayout` per MoE layer (from its first expert), computing in `dtype`; every expert is checked
    against it when the store is built."""
    return [PackedSlabLayout.build(lay.layout, index.format, dtype, pieces[lay.index][0]) for lay in layers]


def packed_store(policy: OffloadPolicy, layers: list[MoELayer], pieces: list[list[list[ExpertPiece]]],
                 layouts: list[PackedSlabLayout]) -> ExpertStore:
    """The experts' store, packed: read per expert from the checkpoint (disk), or copied into host memory; seen
    dense by a CPU cache (dequantized as each expert enters a slot, `dense_store_for`)."""
    dtype, device = layouts[0].compute_dtype, torch.device(policy.device)
    reads = [[layouts[lay.index].store_pieces(expert) for expert in pieces[lay.index]] for lay in layers]
    reader = DiskStore(layers, reads, dtype, layouts=layouts)
    reader.read_directly(policy.disk_reads == "direct")
    return dense_store_for(CpuStore.from_reader(reader, device=device) if policy.store == "cpu" else reader, device)


@contextlib.contextmanager
def packed_layers_dense(index: PackedCheckpointIndex, experts: set[str]):
    """For this thread's `from_pretrained` call, transformers reads `index`'s packed layers as dense weights (see the
    module docstring). Installed by the first such load in progress and removed by the last."""
    global _users
    with _lock:
        if _users == 0:
            _original["convert"] = original = modeling_utils.convert_and_load_state_dict_in_model

            def convert(*args, **kwargs):
                active = getattr(_active, "load", None)
                if active is not None and "state_dict" in kwargs:
                    kwargs["state_dict"] = _dense_state_dict(kwargs["state_dict"], *active)
                return original(*args, **kwargs)

            modeling_utils.convert_and_load_state_dict_in_model = convert
        _users += 1
    _active.load = (index, experts)
    try:
        yield
    finally:
        _active.load = None
        with _lock:
            _users -= 1
            if _users == 0:
                modeling_utils.convert_and_load_state_dict_in_model = _original.pop("convert")


def _dense_state_dict(state_dict: dict, index: PackedCheckpointIndex, experts: set[str]) -> dict:
    """`state_dict` (checkpoint key -> lazy tensor) with every packed layer's tensors replaced by its dense
    `<module>.weight`: dequantized now (non-expert layers), or a meta placeholder (experts)."""
    fmt, dense, packed_keys = index.format, {}, set()
    extra = ("weight_shape",) if fmt.method == "compressed-tensors" else ("g_idx",)
    for module, source in index.packed.items():
        packed_keys.update(f"{module}.{name}" for name in (*fmt.tensor_names(), *extra))
        if module in experts:
            dense[f"{module}.weight"] = torch.empty(source.shape, dtype=source.dtype, device="meta")
        else:
            dense[f"{module}.weight"] = dequantize(fmt, read_packed(source), source.shape)
    logger.info("hf_moe_offload: %d packed %s layers outside the experts dequantized for loading",
                len(index.packed) - len(experts & index.packed.keys()), fmt.method)
    return {**{k: v for k, v in state_dict.items() if k not in packed_keys}, **dense}
