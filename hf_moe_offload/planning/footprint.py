"""The sizes that decide a policy: a model's `Footprint` (expert, resident, KV and activation bytes, measured on a
meta skeleton or a built model), and the memory the machine has for it (free bytes, headroom per workload)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import psutil
import torch
from torch import nn

from ..attention.cpu import check_cpu_attention
from ..layout import MoELayer
from ..policy.offload_policy import (
    AUTO,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_SEQ_LEN,
    OffloadPolicy,
    PolicyError,
    format_bytes,
)
from ..storage.quantize import QuantizedSlabLayout

logger = logging.getLogger(__name__)

HOST_HEADROOM = 0.15        # share of available RAM kept free when deciding the store or a CPU cache
# CUDA memory no formula predicts: allocator fragmentation, cuBLAS and attention workspaces.
CUDA_HEADROOM_FLOOR = 512 << 20
# Hidden-sized buffers alive at once per token in a full forward: residual, normed input, q/k/v/o, router,
# the experts' [T*k, H] output with k up to 8.
ACTIVATION_HIDDEN_COPIES = 16
ACTIVATION_INTERMEDIATE_COPIES = 3   # one expert's gate/up output [rows, 2I] and its activation [rows, I]
LOGIT_BYTES = 4 + 4         # per vocab entry and token beyond the model dtype: the float32 copy and log-softmax
                            # that perplexity and lm-eval take of full-sequence logits


@dataclass(frozen=True)
class Footprint:
    """Sizes that decide a policy: all in bytes, at the dtype the model will run in.

    Example:
        >>> fp = Footprint(expert_bytes=8 << 30, slab_bytes=64 << 20, resident_bytes=1 << 30, top_k=2,
        ...                kv_bytes_per_token=128 << 10)
        >>> fp.min_cache_bytes == 128 << 20
        True
    """

    expert_bytes: int        # every expert of every MoE layer
    slab_bytes: int          # the largest single expert
    resident_bytes: int      # everything that is not an expert
    top_k: int
    # Per token of a sequence (see `sequence_costs`); 0 when the model's config was not given.
    kv_bytes_per_token: int = 0
    activation_bytes_per_token: int = 0
    max_positions: int = 0   # the model's max_position_embeddings; 0 when it has none (relative positions)
    # Where the model's tensors are allocated now (`enable()` on a built model; None when loading from files):
    # experts there are freed when offloading releases them, a resident part there is already out of free memory.
    experts_device: str | None = None
    resident_device: str | None = None
    layer_experts: tuple[int, ...] = ()   # experts per MoE layer, forward order (resident_layers' budget)
    # Why CPU attention (hf_moe_offload.attention.cpu) cannot serve this model, or None if it can: attention="auto"
    # then never picks it.
    cpu_attention_refusal: str | None = None
    # Quantized experts on CUDA: the largest temporaries one expert's matmul makes (`dequant_workspace_bytes`).
    dequant_workspace_bytes: int = 0
    # A store smaller than the cache's slabs (a checkpoint's quantized experts, dequantized into dense slots): its
    # bytes of all experts (what store="auto" weighs); 0 when the store holds the slabs as the cache does.
    store_bytes: int = 0
    # False when a host store on the CPU device is still copied into the cache's slots (they hold the experts
    # dequantized), so expert_cache bounds them; True: such a store is served in place.
    host_store_in_place: bool = True
    # Bytes of the non-expert part read in place from the checkpoint's files (a mapped input embedding table): out
    # of `resident_bytes`, which is what memory holds, but still weights a step computes with.
    mapped_bytes: int = 0
    dtype_bytes: int = 2                  # bytes of one weight in the dtype the model computes in

    @property
    def min_cache_bytes(self) -> int:
        """One layer's top-k working set: the smallest cache that can run a token."""
        return self.top_k * self.slab_bytes


class SequenceCosts(TypedDict):
    """`Footprint` fields read from a config (`sequence_costs`), passed on as `Footprint(..., **costs)`."""

    kv_bytes_per_token: int
    activation_bytes_per_token: int
    max_positions: int


def sequence_costs(config: Any, dtype: torch.dtype) -> SequenceCosts:
    """The `Footprint` fields that grow with batch x length, read from a transformers config.

    Example:
        >>> from transformers import MixtralConfig
        >>> sequence_costs(MixtralConfig(), torch.bfloat16)["kv_bytes_per_token"]   # 2 x 32 layers x 8 x 128 x 2
        131072
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return SequenceCosts(kv_bytes_per_token=kv_bytes_per_token(text, dtype),
                         activation_bytes_per_token=activation_bytes_per_token(text, dtype),
                         max_positions=_config_int(text, "max_position_embeddings", "n_positions"))


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes one token adds to the KV cache: 2 (K and V) x layers x KV heads x head dim x dtype bytes.

    Without `num_key_value_heads` every attention head has its own KV (multi-head attention); without `head_dim`
    it is hidden_size / heads. An encoder-decoder caches self- and cross-attention in every decoder layer (the
    cross part counted at the same length: conservative for prompts shorter than the output).

    Example:
        >>> from transformers import SwitchTransformersConfig
        >>> kv_bytes_per_token(SwitchTransformersConfig(num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=8),
        ...                    torch.float32)   # 2 x (2 x 2 layers) x 4 heads x 8 x 4
        1024
    """
    heads = _config_int(config, "num_attention_heads", "num_heads", default=1)
    kv_heads = _config_int(config, "num_key_value_heads", default=heads)
    head_dim = _config_int(config, "head_dim", "d_kv") or _config_int(config, "hidden_size") // heads
    layers = _config_int(config, "num_decoder_layers", "num_hidden_layers", "num_layers")
    attentions = 2 if getattr(config, "is_encoder_decoder", False) else 1
    return 2 * attentions * layers * kv_heads * head_dim * dtype.itemsize


def activation_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Transient bytes per token of a full forward: hidden-sized buffers, one expert's intermediate, and logits
    for every position (scoring takes all of them, in the dtype and in float32).

    Example:
        >>> from transformers import MixtralConfig
        >>> config = MixtralConfig(hidden_size=8, intermediate_size=16, vocab_size=10)
        >>> activation_bytes_per_token(config, torch.float32)      # (16 x 8 + 3 x 16 + 10) x 4 + 10 x (4 + 4)
        824
    """
    hidden = _config_int(config, "hidden_size", "d_model")
    intermediate = _config_int(config, "moe_intermediate_size", "intermediate_size", "d_ff", default=4 * hidden)
    vocab = _config_int(config, "vocab_size")
    per_dtype = ACTIVATION_HIDDEN_COPIES * hidden + ACTIVATION_INTERMEDIATE_COPIES * intermediate + vocab
    return per_dtype * dtype.itemsize + vocab * LOGIT_BYTES


def _config_int(config: Any, *names: str, default: int = 0) -> int:
    """The first of `names` that `config` sets to a positive int (configs name the same size differently, and
    leave some unset as None or 0)."""
    for name in names:
        try:
            value = getattr(config, name, None)
        except Exception:   # e.g. Gemma-4 refuses a global head_dim: it differs per layer (an estimate will do)
            value = None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


def auto_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def workload(policy: OffloadPolicy, fp: Footprint) -> tuple[int, int]:
    """(batch, sequence length) that the headroom is sized for; "auto" gives a conservative single sequence."""
    batch = DEFAULT_MAX_BATCH_SIZE if policy.max_batch_size == AUTO else int(policy.max_batch_size)
    if policy.max_seq_len != AUTO:
        return batch, int(policy.max_seq_len)
    return batch, min(fp.max_positions or DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_SEQ_LEN)


def auto_store(expert_bytes: int, resident_bytes: int, on_cpu: bool, host_bytes: float) -> str:
    """The store "auto" picks: "cpu" (experts in host memory) when they fit in `host_bytes`, beside the resident
    part when that computes on the CPU too; "disk" otherwise."""
    return "cpu" if expert_bytes + (resident_bytes if on_cpu else 0) <= host_bytes else "disk"


CGROUP_ROOT = Path("/sys/fs/cgroup")     # where the kernel mounts the control groups (a test points it elsewhere)
PROC_CGROUP = Path("/proc/self/cgroup")  # this process's control group per hierarchy
_UNLIMITED = 1 << 60                     # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True)
class ContainerMemory:
    """The memory limit of this process's control group (a container's memory, as `docker run -m` or Kubernetes
    set it) and what its processes use of it, leaving out inactive page cache (the kernel reclaims that first)."""

    limit: int
    used: int

    @property
    def available(self) -> int:
        return max(0, self.limit - self.used)


def container_memory() -> ContainerMemory | None:
    """The memory limit that binds this process, with its group's use (cgroup v2 or v1), or None when it has no
    limit. A limit set on a parent group binds too (a systemd slice, a pod, a container whose process sits in a
    child group): of the groups from this process's up to the root, the one with the least memory left binds."""
    groups = {}
    try:
        for line in PROC_CGROUP.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            groups[controllers] = path.strip("/")
    except (OSError, ValueError):
        return None
    found = []
    if "" in groups:
        found += [_v2_group(folder) for folder in _up_to_root(CGROUP_ROOT, groups[""])]
    # A "hybrid" system (systemd's default on many hosts) lists both; its memory controller is the v1 one.
    v1_path = next((path for names, path in groups.items() if "memory" in names.split(",")), None)
    if v1_path is not None:
        found += [_v1_group(folder) for folder in _up_to_root(CGROUP_ROOT / "memory", v1_path)]
    limited = [group for group in found if group is not None]
    return min(limited, key=lambda group: group.available) if limited else None


def _up_to_root(root: Path, path: str) -> list[Path]:
    """The control-group folders from `root / path` up to `root`."""
    parts = [part for part in path.split("/") if part]
    return [root.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def _v2_group(folder: Path) -> ContainerMemory | None:
    limit = _read_number(folder / "memory.max")
    if limit is None:
        return None
    used = _read_number(folder / "memory.current") or 0
    return ContainerMemory(limit, used - _stat(folder / "memory.stat", "inactive_file"))


def _v1_group(folder: Path) -> ContainerMemory | None:
    # v1 writes the limit in force, a parent's included, as memory.stat's hierarchical_memory_limit
    limit = min(_read_number(folder / "memory.limit_in_bytes") or _UNLIMITED,
                _stat(folder / "memory.stat", "hierarchical_memory_limit") or _UNLIMITED)
    if limit >= _UNLIMITED:
        return None
    used = _read_number(folder / "memory.usage_in_bytes") or 0
    return ContainerMemory(limit, used - _stat(folder / "memory.stat", "total_inactive_file"))


def _read_number(path: Path) -> int | None:
    """An integer control-group file; None when it is missing, unreadable or says "max" (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def available_host_bytes() -> int:
    """Host memory this process can still use: the machine's available memory, within its container's limit."""
    available = psutil.virtual_memory().available
    container = container_memory()
    return available if container is None else min(available, container.available)


def host_memory_bytes() -> int:
    """The host memory this process may ever use: the machine's RAM, within its container's limit."""
    total = psutil.virtual_memory().total
    container = container_memory()
    return total if container is None else min(total, container.limit)


def free_bytes(device: torch.device) -> int:
    """Bytes an allocation on `device` can have now: on CUDA the driver's free memory plus what torch holds cached
    but unused (the cache is emptied before the expert cache is allocated), within the per-process memory fraction
    (`torch.cuda.set_per_process_memory_fraction`, which the driver does not see)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        fraction = torch.cuda.get_per_process_memory_fraction(device)
        return max(0, min(free + reserved - allocated, int(fraction * total) - allocated))
    return int(available_host_bytes() * (1 - HOST_HEADROOM))


def headroom_bytes(device: torch.device, fp: Footprint, batch: int, seq_len: int, kv_on_device: bool = True) -> int:
    """Bytes left free for `batch` x `seq_len` tokens (KV cache unless it lives in host memory, and activations),
    plus the CUDA floor; logged."""
    tokens = batch * seq_len
    kv = tokens * fp.kv_bytes_per_token if kv_on_device else 0
    activations = tokens * fp.activation_bytes_per_token
    floor = CUDA_HEADROOM_FLOOR if device.type == "cuda" else 0   # on the CPU, HOST_HEADROOM's share covers it
    # CUDA dequantizes a quantized expert's weights for its matmul (the CPU has kernels that read them packed).
    workspace = fp.dequant_workspace_bytes if device.type == "cuda" else 0
    logger.info("hf_moe_offload: headroom on %s %s = KV cache %s (max_batch_size=%d x max_seq_len=%d x %s per "
                "token) + activations %s + floor %s%s", device, format_bytes(kv + activations + floor + workspace),
                format_bytes(kv), batch, seq_len, format_bytes(fp.kv_bytes_per_token), format_bytes(activations),
                format_bytes(floor), f" + dequantization workspace {format_bytes(workspace)}" if workspace else "")
    return kv + activations + floor + workspace


def footprint(model: nn.Module, layers: list[MoELayer], dtype: torch.dtype,
              quantized: list[QuantizedSlabLayout] | None = None, dense_slots: bool = False) -> Footprint:
    """Byte sizes of the model at `dtype` (works on a meta skeleton: only shapes are read); with `quantized`
    layouts, experts count as stored quantized (so expert_cache="25%" is a quarter of the quantized bytes). With
    `dense_slots` too, only the store is quantized: the cache holds dense slabs, so the cache's sizes (the slot,
    "25%", "auto") are the dense ones and `store_bytes` the quantized ones."""
    expert_ids = {id(p) for lay in layers for p in lay.module.parameters()}
    resident = sum(p.numel() for p in model.parameters() if id(p) not in expert_ids) * dtype.itemsize
    stored = sum(q.numel * lay.num_experts for q, lay in zip(quantized, layers)) if quantized else 0
    if quantized is not None and not dense_slots:
        slab, experts = max(lay.numel for lay in quantized), stored
    else:
        slab = max(lay.layout.numel for lay in layers) * dtype.itemsize
        experts = sum(lay.layout.numel * lay.num_experts for lay in layers) * dtype.itemsize
    workspace = max(q.dequant_workspace_bytes for q in quantized) if quantized and not dense_slots else 0
    return Footprint(expert_bytes=experts, slab_bytes=slab, resident_bytes=resident, top_k=layers[0].top_k,
                     layer_experts=tuple(lay.num_experts for lay in layers), **sequence_costs(model.config, dtype),
                     cpu_attention_refusal=_cpu_attention_refusal(model), dequant_workspace_bytes=workspace,
                     store_bytes=stored if dense_slots else 0, host_store_in_place=not (quantized and dense_slots),
                     dtype_bytes=dtype.itemsize)


def _cpu_attention_refusal(model: nn.Module) -> str | None:
    """Why CPU attention cannot serve `model` (attention="auto" then keeps it on the device), or None."""
    try:
        check_cpu_attention(model)
    except PolicyError as err:
        return str(err)
    return None
