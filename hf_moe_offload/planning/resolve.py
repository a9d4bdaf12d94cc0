"""Resolve the "auto" fields of a policy against this machine and the model's footprint (a plain rule for now;
a cost-model planner replaces it later).

Rule: device = the first CUDA GPU, else the CPU; store = "cpu" when host RAM holds the experts with headroom,
else "disk" (and "disk" whenever an expert_cache is given for the CPU device: host-memory experts are used in
place there, so only the disk store makes a budget bound memory); expert cache = memory free on the device after
offloading (experts the model holds there now count as free, a resident part already there is not counted
twice), minus headroom = KV cache + activations for max_batch_size x max_seq_len tokens + a fixed floor on CUDA.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, TypedDict

import psutil
import torch

from ..policy.offload_policy import (AUTO, DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_SEQ_LEN, DEFAULT_STREAM_WINDOW, OffloadPolicy,
                     PolicyError, format_bytes, normalize_device, parse_size)

from ..memory.placement import check_placement

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

    @property
    def min_cache_bytes(self) -> int:
        """One layer's top-k working set: the smallest cache that can run a token."""
        return self.top_k * self.slab_bytes


class SequenceCosts(TypedDict):
    """`Footprint` fields read from a config (`sequence_costs`), passed on as `Footprint(..., **costs)`."""

    kv_bytes_per_token: int
    activation_bytes_per_token: int
    max_positions: int


@dataclass(frozen=True)
class ResolvedPolicy:
    policy: OffloadPolicy     # every field concrete (no "auto")
    cache_bytes: int


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


def resolve(policy: OffloadPolicy, fp: Footprint) -> ResolvedPolicy:
    """Fill the "auto" fields and check the cache budget; raise before anything is allocated.

    Example:
        >>> fp = Footprint(expert_bytes=1 << 20, slab_bytes=1 << 10, resident_bytes=1 << 10, top_k=2)
        >>> resolve(OffloadPolicy(device="cpu", store="disk", expert_cache="50%"), fp).cache_bytes
        524288
    """
    auto_fields = [f for f in ("device", "store", "expert_cache") if getattr(policy, f) == AUTO]
    device = _auto_device() if policy.device == AUTO else normalize_device(policy.device)
    store, why_store = _store(policy, device, fp)
    batch, seq_len = _workload(policy, fp)
    zero_copy = device.type == "cpu" and store == "cpu"
    given = None if policy.expert_cache == AUTO else _given_cache(policy.expert_cache, fp, zero_copy)
    attention = _attention(policy, device, fp, batch, seq_len, given)
    if given is None:
        cache = fp.expert_bytes if zero_copy else _auto_cache(device, fp, batch, seq_len,
                                                              kv_on_device=attention != "cpu")
    else:
        cache = given
    cache = min(cache, fp.expert_bytes)
    # expert_compute and resident_layers (placement.py): the resident layers' budget; "cpu" needs no working set.
    cache = check_placement(policy, fp.layer_experts, fp.slab_bytes, fp.top_k, cache, zero_copy)
    if not zero_copy and policy.expert_compute != "cpu" and cache < fp.min_cache_bytes:
        raise PolicyError(f"expert_cache={format_bytes(cache)} is smaller than one layer's top-k working set: "
                          f"top_k={fp.top_k} x {format_bytes(fp.slab_bytes)} per expert = "
                          f"{format_bytes(fp.min_cache_bytes)}; use at least expert_cache={fp.min_cache_bytes}")
    window = DEFAULT_STREAM_WINDOW if policy.stream_window == AUTO else policy.stream_window
    micro_batches = resolve_micro_batches(policy, fp, store, cache, zero_copy)
    resolved = dataclasses.replace(policy, device=str(device), store=store, expert_cache=cache,
                                   max_batch_size=batch, max_seq_len=seq_len, stream_window=window,
                                   attention=attention, micro_batches=micro_batches)
    from .planner import plan_for_policy   # the cost model picks the "auto" performance fields (issue 9)
    resolved = plan_for_policy(policy, resolved, fp)
    if auto_fields:
        logger.info("hf_moe_offload auto policy: device=%s store=%s%s expert_cache=%s (experts %s, resident part "
                    "%s, RAM available %s)", device, store, why_store, format_bytes(cache),
                    format_bytes(fp.expert_bytes), format_bytes(fp.resident_bytes),
                    format_bytes(psutil.virtual_memory().available))
    return ResolvedPolicy(resolved, cache)


def resolve_micro_batches(policy: OffloadPolicy, fp: Footprint, store: str, cache_bytes: int, zero_copy: bool,
                          where: str = "") -> int:
    """`micro_batches` as a number. "auto" is 1 (off): the slices pay only where one slice's host attention
    overlaps the previous slice's device experts (a GPU with CPU attention), they cost bytes (a layer's experts
    stay in the cache until its last slice, so the resident set is smaller; +12% bytes per step at batch 32 on the
    CPU benchmark), and the overlap has not been measured on a GPU yet. A number above 1 is checked: the cache
    must hold a whole layer's experts beside the resident layers' (`where`: the device whose share `cache_bytes`
    is, for the message).

    Example:
        >>> fp = Footprint(expert_bytes=64 << 10, slab_bytes=1 << 10, resident_bytes=0, top_k=2, layer_experts=(8,) * 8)
        >>> resolve_micro_batches(OffloadPolicy(micro_batches=2), fp, "disk", 16 << 10, False)
        2
    """
    if policy.micro_batches == AUTO:
        return 1
    count = int(policy.micro_batches)
    if count == 1 or zero_copy:
        return count
    if policy.expert_compute == "cpu" and store == "disk":
        raise PolicyError(f"micro_batches={count} with expert_compute='cpu' and store='disk' would read every expert "
                          f"once per micro-batch (experts computed on the CPU are read into reused host buffers); "
                          f"use store='cpu', expert_compute='auto' or 'device', or micro_batches=1")
    if policy.expert_compute == "cpu" and store == "cpu":     # nothing but the resident layers is copied
        return count
    slots, need = cache_bytes // max(fp.slab_bytes, 1), _layer_hold_slots(policy, fp)
    if slots < need:
        raise PolicyError(f"micro_batches={count} keeps each layer's experts on the device until its last "
                          f"micro-batch: expert_cache={format_bytes(cache_bytes)}{where} holds {slots} experts, a "
                          f"layer has up to {max(fp.layer_experts, default=0)}"
                          f"{' beside the resident layers' if int(policy.resident_layers) else ''}; use at least "
                          f"expert_cache={need * fp.slab_bytes}, or micro_batches=1")
    return count


def _layer_hold_slots(policy: OffloadPolicy, fp: Footprint) -> int:
    """Slots a micro-batched layer may pin at once: all its experts, plus the resident layers' for good."""
    layers = int(policy.resident_layers)
    return max(fp.layer_experts, default=fp.top_k) + sum(fp.layer_experts[:layers])


def _auto_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _store(policy: OffloadPolicy, device: torch.device, fp: Footprint) -> tuple[str, str]:
    """The store, and why when "auto" chose it against the RAM rule (for the log line)."""
    if policy.store != AUTO:
        return policy.store, ""
    if device.type == "cpu" and policy.expert_cache != AUTO:
        return "disk", (f" (expert_cache={_short(policy.expert_cache)} given for the CPU device: experts in host "
                        f"memory would be used in place and the budget ignored; the disk store keeps it)")
    needed = fp.expert_bytes + (fp.resident_bytes if device.type == "cpu" else 0)
    available = psutil.virtual_memory().available * (1 - HOST_HEADROOM)
    return ("cpu" if needed <= available else "disk"), ""


def _workload(policy: OffloadPolicy, fp: Footprint) -> tuple[int, int]:
    """(batch, sequence length) that the headroom is sized for; "auto" gives a conservative single sequence."""
    batch = DEFAULT_MAX_BATCH_SIZE if policy.max_batch_size == AUTO else int(policy.max_batch_size)
    if policy.max_seq_len != AUTO:
        return batch, int(policy.max_seq_len)
    return batch, min(fp.max_positions or DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_SEQ_LEN)


def _given_cache(expert_cache: int | str, fp: Footprint, zero_copy: bool) -> int:
    """An explicit budget in bytes; one the CPU-on-CPU case would silently ignore is refused, one above all
    expert bytes is capped (harmless: the cache never holds more than every expert)."""
    cache = parse_size(expert_cache, total=fp.expert_bytes)
    if zero_copy and cache < fp.expert_bytes:
        raise PolicyError(f"expert_cache={expert_cache!r} has no effect with store='cpu' on the CPU device: experts in "
                          f"host memory are used in place there, all of them stay in memory whatever the budget; "
                          f"use store='disk' to bound memory with expert_cache, or drop expert_cache")
    if cache > fp.expert_bytes:
        logger.info("hf_moe_offload: expert_cache=%s is more than all expert bytes (%s); the cache holds every "
                    "expert, capped to %s", _short(expert_cache), format_bytes(fp.expert_bytes), fp.expert_bytes)
    return cache


def _short(value: Any, limit: int = 40) -> str:
    """A value for a log line: a 400-digit size shown by its length, not its digits."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:12]}... ({len(text)} characters)"


def _auto_cache(device: torch.device, fp: Footprint, batch: int, seq_len: int, kv_on_device: bool = True) -> int:
    """Memory on `device` after offloading, less the resident part still to place there and the headroom."""
    return max(0, _room(device, fp) - _headroom(device, fp, batch, seq_len, kv_on_device))


def _room(device: torch.device, fp: Footprint) -> int:
    """Memory on `device` once the experts are offloaded and the resident part is placed."""
    reclaimed = fp.expert_bytes if _is(fp.experts_device, device) else 0
    to_place = 0 if _is(fp.resident_device, device) else fp.resident_bytes
    return _free_bytes(device) + reclaimed - to_place


def _attention(policy: OffloadPolicy, device: torch.device, fp: Footprint, batch: int, seq_len: int,
               given_cache: int | None) -> str:
    """attention="auto": "cpu" on a GPU whose memory cannot hold the KV cache of `batch` x `seq_len` beside the
    resident part, the activations and the expert cache (the given budget, else one layer's top-k: the least that
    runs); "device" otherwise, and always on the CPU device (attention runs there already)."""
    if policy.attention != AUTO:
        return policy.attention
    if device.type != "cuda":
        return "device"
    kv = batch * seq_len * fp.kv_bytes_per_token
    left = _room(device, fp) - batch * seq_len * fp.activation_bytes_per_token - CUDA_HEADROOM_FLOOR \
        - (fp.min_cache_bytes if given_cache is None else given_cache)
    if kv <= left:
        return "device"
    if fp.cpu_attention_refusal is not None:
        logger.info("hf_moe_offload auto policy: the KV cache (%s for max_batch_size=%d x max_seq_len=%d) does not "
                    "fit %s (%s left), and CPU attention cannot serve this model (%s): attention stays on the "
                    "device", format_bytes(kv), batch, seq_len, device, format_bytes(max(left, 0)),
                    fp.cpu_attention_refusal)
        return "device"
    logger.info("hf_moe_offload auto policy: attention=cpu: the KV cache (%s for max_batch_size=%d x max_seq_len=%d) "
                "does not fit %s (%s left beside the resident part and the expert cache); keys and values live in "
                "host memory and decode attention runs on the CPU (MoE-Lightning). Set attention='device' and a "
                "smaller max_batch_size to keep it on the GPU", format_bytes(kv), batch, seq_len, device,
                format_bytes(max(left, 0)))
    return "cpu"


def _is(where: str | None, device: torch.device) -> bool:
    return where is not None and torch.device(where) == device


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return int(psutil.virtual_memory().available * (1 - HOST_HEADROOM))


def _headroom(device: torch.device, fp: Footprint, batch: int, seq_len: int, kv_on_device: bool = True) -> int:
    """Bytes left free for `batch` x `seq_len` tokens (KV cache unless it lives in host memory, and activations),
    plus the CUDA floor; logged."""
    tokens = batch * seq_len
    kv = tokens * fp.kv_bytes_per_token if kv_on_device else 0
    activations = tokens * fp.activation_bytes_per_token
    floor = CUDA_HEADROOM_FLOOR if device.type == "cuda" else 0   # on the CPU, HOST_HEADROOM's share covers it
    logger.info("hf_moe_offload: headroom on %s %s = KV cache %s (max_batch_size=%d x max_seq_len=%d x %s per "
                "token) + activations %s + floor %s", device, format_bytes(kv + activations + floor),
                format_bytes(kv), batch, seq_len, format_bytes(fp.kv_bytes_per_token), format_bytes(activations),
                format_bytes(floor))
    return kv + activations + floor
