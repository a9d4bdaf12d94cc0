"""Plan a batch job: pick the schedule, resident expert share, micro-batch and attention placement that a roofline
model (MoE-Lightning's HRM, FlexGen's policy search) predicts fastest within a memory budget.

For every candidate the time of one pass is predicted layer by layer:
- bytes that must move = the experts the pass touches (uniform routing: `expected_experts`) that are not in the
  resident share (a streamed pass gives its window's slots up), over the slowest link on their way (disk,
  host-to-device); or the measured bytes per token (stats' `bytes_to_device`, a benchmark row), which carry the
  real router's locality that uniform routing misses at batch 1;
- CPU compute = the profile's measured curve of the engine's whole expert forward per row count (weights cold:
  gathers, SiLU and scatter included) for experts, dense projections and the LM head; norms, RoPE, residual adds
  and the top-k sum at the measured elementwise rate; attention as max(FLOPs / large-batch rate, KV bytes / memcpy)
  plus the KV cache's growth by concatenation in decode. Without the curve (older profiles) and on the GPU, a
  matmul is max(2W / F_batch1, 2nW / F_large);
- `on_demand` passes learn their experts at the layer's router: the misses are read while the resident experts
  compute, the missing ones compute when they land. `stream` passes compute each expert as it lands, and while a
  layer computes after its own reads are done the next layer's experts are read ahead, at most `stream_window` of
  them (`pipeline_seconds`); `stream` is a candidate only for passes expected to touch half a layer's experts or
  more, as the engine's `schedule="auto"` decides;
- plus the profile's framework overhead per layer and pass and per `generate` step, when measured.

Throughput = generated tokens / (prefill + decode time), as MoE-Lightning reports it.

Example:
    >>> from hf_moe_offload.planning.profile import load_profile
    >>> shape = ModelShape(layers=32, experts=8, top_k=2, expert_bytes=352321536, dtype_bytes=2,
    ...                    dense_params_per_layer=46_000_000, head_params=131_072_000, heads=32, head_dim=128,
    ...                    kv_bytes_per_token=131072, activation_bytes_per_token=400_000, resident_bytes=3_200_000_000)
    >>> plan = make_plan(shape, load_profile("t4"), batch=64, prompt_len=256, gen_len=64)
    >>> plan.candidate.attention, plan.device_memory_bytes <= 16 << 30
    ('cpu', True)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..arch import get_arch
from ..policy.offload_policy import DEFAULT_STREAM_WINDOW, PolicyError, format_bytes
from ..runtime.pass_scheduler import expected_experts, is_wide_pass
from ..storage.checkpoint import CheckpointIndex
from .footprint import CUDA_HEADROOM_FLOOR, HOST_HEADROOM, Footprint, auto_store, footprint
from .profile import MachineProfile

logger = logging.getLogger(__name__)

RESIDENT_SHARES = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)   # besides "all that fits"
STREAM_WINDOWS = (1, 2, 4)                             # stream_window values weighed for streamed passes


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model (bytes at the dtype it runs in).

    Example:
        >>> from transformers import MixtralConfig
        >>> s = ModelShape.from_config(MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        ...                            num_attention_heads=4, num_key_value_heads=2, vocab_size=100), torch.bfloat16)
        >>> s.expert_bytes, s.layers, s.experts
        (36864, 2, 8)
    """

    layers: int                   # MoE layers
    experts: int                  # per MoE layer
    top_k: int
    expert_bytes: int             # one expert
    dtype_bytes: int
    dense_params_per_layer: int   # matmul weights outside the experts, per layer (attention projections, router)
    head_params: int              # the LM head (applied to one position per sequence in generate)
    heads: int
    head_dim: int
    kv_bytes_per_token: int       # all layers
    activation_bytes_per_token: int
    resident_bytes: int           # everything that is not an expert
    hidden: int = 0               # hidden size (0: heads x head_dim)

    @property
    def all_expert_bytes(self) -> int:
        return self.layers * self.experts * self.expert_bytes

    @classmethod
    def from_footprint(cls, fp: Footprint, config: Any, dtype: torch.dtype) -> "ModelShape":
        """From `footprint()`'s sizes plus the config's attention shape."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden = int(getattr(text, "hidden_size"))
        heads = int(getattr(text, "num_attention_heads"))
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        vocab = int(getattr(text, "vocab_size"))
        layers = len(fp.layer_experts)
        embeddings = vocab * hidden * (1 if getattr(text, "tie_word_embeddings", False) else 2)
        resident_params = (fp.resident_bytes + fp.mapped_bytes) // dtype.itemsize   # mapped ones compute too
        return cls(layers=layers, experts=max(fp.layer_experts), top_k=fp.top_k, expert_bytes=fp.slab_bytes,
                   dtype_bytes=dtype.itemsize,
                   dense_params_per_layer=max(0, resident_params - embeddings) // max(1, layers),
                   head_params=vocab * hidden, heads=heads, head_dim=head_dim,
                   kv_bytes_per_token=fp.kv_bytes_per_token,
                   activation_bytes_per_token=fp.activation_bytes_per_token, resident_bytes=fp.resident_bytes,
                   hidden=hidden)

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype) -> "ModelShape":
        """From a transformers config alone: a meta-device skeleton (no memory) measured by `footprint()`."""
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        layers = get_arch(config).find_layers(skeleton)
        return cls.from_footprint(footprint(skeleton, layers, dtype), config, dtype)

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelShape":
        """From a checkpoint's config (local folder or Hub id), at the dtype it is stored in: the config's, else
        that of the local folder's safetensors weights (most of their bytes), else float32."""
        config = AutoConfig.from_pretrained(path)
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or _stored_dtype(path)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return cls.from_config(config, dtype or torch.float32)


def _stored_dtype(path: str) -> torch.dtype | None:
    """The dtype holding most bytes of a local folder's safetensors files; None without such files."""
    if not os.path.isdir(path):
        return None
    try:
        entries = CheckpointIndex.open(path).entries.values()
    except (OSError, ValueError):
        return None
    by_dtype: dict[torch.dtype, int] = {}
    for entry in entries:
        by_dtype[entry.dtype] = by_dtype.get(entry.dtype, 0) + entry.nbytes
    return max(by_dtype, key=by_dtype.get) if by_dtype else None


@dataclass(frozen=True)
class Candidate:
    """One policy to evaluate: per-phase schedule, resident share, tokens per pass, attention placement."""
    prefill_schedule: str        # "on_demand" | "stream"
    decode_schedule: str
    resident_share: float        # share of all expert bytes held in the device cache (the rest moves)
    micro_batch: int             # tokens per prefill pass (the token budget); decode runs every sequence at once
    attention: str               # "device" | "cpu"
    stream_window: int = DEFAULT_STREAM_WINDOW   # slots a streamed layer may have loading or landed unused


@dataclass(frozen=True)
class Plan:
    """The chosen policy and its prediction.

    Example:
        >>> Plan(Candidate("stream", "on_demand", 0.25, 64, "device"), "cpu", "disk", 1 << 30, 100.0, 10.0, 9.5,
        ...      "disk read", 1, 64, 16).explain()[:60]
        'plan: prefill stream, decode on_demand, 25% of experts resid'
    """

    candidate: Candidate
    device: str                  # "cpu" or "cuda"
    store: str                   # "cpu" | "disk": where the experts that are not resident come from
    device_memory_bytes: int     # what the plan uses on the device (never more than the budget)
    prefill_tok_s: float
    decode_tok_s: float
    throughput_tok_s: float      # generated tokens / (prefill + decode)
    binding: str                 # the resource that limits the phase taking most time
    batch: int
    prompt_len: int
    gen_len: int
    cache_bytes: int | None = None   # the expert cache budgeted: a share, or at least a pass's working set

    @property
    def schedule(self) -> str:
        return f"prefill {self.candidate.prefill_schedule}, decode {self.candidate.decode_schedule}"

    def explain(self) -> str:
        """One line: what was picked, its predicted tokens/s, and what binds."""
        c = self.candidate
        return (f"plan: {self.schedule}, {c.resident_share:.0%} of experts resident ({self.store} store), "
                f"{c.micro_batch} tokens per prefill pass, stream window {c.stream_window}, attention on {c.attention}; "
                f"device memory "
                f"{format_bytes(self.device_memory_bytes)}; predicted prefill {self.prefill_tok_s:.1f} tok/s, decode "
                f"{self.decode_tok_s:.1f} tok/s, {self.throughput_tok_s:.1f} generated tok/s overall; bound by "
                f"{self.binding}")

    def policy(self) -> dict[str, Any]:
        """The offload policy fields this plan corresponds to."""
        schedule = (self.candidate.decode_schedule if self.candidate.decode_schedule == self.candidate.prefill_schedule
                    else "auto")
        share = f"{self.candidate.resident_share * 100:g}%"
        # "0%" is no cache the engine takes (a pass needs its working set): the bytes budgeted, then
        expert_cache = share if self.cache_bytes is None or share != "0%" else self.cache_bytes
        return {"device": "cuda:0" if self.device == "cuda" else "cpu", "store": self.store,
                "expert_cache": expert_cache, "schedule": schedule,
                "attention": self.candidate.attention, "stream_window": self.candidate.stream_window,
                "max_batch_size": self.batch,
                "max_seq_len": self.prompt_len + self.gen_len}


@dataclass(frozen=True)
class PhaseTime:
    seconds: float
    binding: str


# Element operations per token and layer outside the experts, in units of the hidden size: two RMSNorms (upcast,
# square, mean, rsqrt x, downcast, weight: 6 each), two residual adds, RoPE on q and k (about 6 over q's width
# plus k's), the sum over the top-k outputs and its cast (3). Counted from transformers' Mixtral/Qwen-MoE layers.
ELEMENTWISE_PER_HIDDEN = 24


def matmul_seconds(rows: int, params: float, flops: tuple[float, float]) -> float:
    """A [rows, in] x [in, out] matmul with `params` weights: max(weight-read bound, arithmetic bound)."""
    batch1, large = flops
    return max(2.0 * params / batch1, 2.0 * rows * params / large)


def cpu_matmul_seconds(profile: MachineProfile, rows: int, params: float, dtype_bytes: int,
                       packed: bool = False) -> float:
    """CPU seconds of `rows` rows through `params` weights: the profile's measured expert-forward curve at that row
    count (weights cold, gathers and activation included) when it has one, else the two-point roofline. `packed`:
    weights with a prepacked oneDNN copy (the profile's packed curve, where it has one)."""
    rate = profile.expert_flops(rows, dtype_bytes, packed)
    if rate is None:
        return matmul_seconds(rows, params, profile.cpu_flops(dtype_bytes))
    return 2.0 * max(1, rows) * params / rate


@dataclass(frozen=True)
class LayerCost:
    """One MoE layer of one pass: compute seconds (experts and the rest) and what its experts read."""
    compute_s: float        # everything the layer computes, on the processor that binds it
    expert_s: float         # the experts' share of compute_s
    touched: float          # distinct experts the pass uses in this layer
    reads: float            # experts read from the store (not resident)
    read_s: float           # seconds of one expert read over the slowest link
    attn_io_s: float = 0.0  # CPU attention's query/output crossing (CUDA only)
    cpu_attn_s: float = 0.0  # CPU attention beside the device (CUDA only)


def layer_cost(shape: ModelShape, profile: MachineProfile, cand: Candidate, device: str, store: str, tokens: int,
               sequences: int, context: int, schedule: str, decode: bool,
               read_bytes: float | None = None) -> LayerCost:
    """Predicted compute and reads of one MoE layer in a pass of `tokens` tokens over `sequences` sequences.

    `read_bytes`: measured bytes this layer reads per pass (from stats or a benchmark row) instead of the uniform
    routing estimate (touched experts outside the resident share; a streamed pass gives the window's slots up)."""
    on_gpu = device == "cuda"
    dtype_bytes = shape.dtype_bytes
    expert_params = shape.expert_bytes / dtype_bytes
    touched = expected_experts(tokens, shape.experts, shape.top_k)
    rows = max(1, round(tokens * shape.top_k / touched))
    hidden = shape.hidden or shape.heads * shape.head_dim
    kv_layer = shape.kv_bytes_per_token / shape.layers
    attn_flops = 4.0 * tokens * context * shape.heads * shape.head_dim * (0.5 if not decode else 1.0)
    kv_bytes = kv_layer * context * sequences
    cpu_flops = profile.cpu_flops(dtype_bytes)
    if on_gpu:
        dev_flops = (profile.device_flops / 8, profile.device_flops)
        t_experts = touched * matmul_seconds(rows, expert_params, dev_flops)
        t_rest = matmul_seconds(tokens, shape.dense_params_per_layer, dev_flops)
        if cand.attention == "cpu":
            t_attn = max(attn_flops / cpu_flops[1], kv_bytes / profile.host_memcpy_bytes_per_s)
            attn_io = 2 * tokens * shape.heads * shape.head_dim * dtype_bytes / profile.h2d_bytes_per_s
            cpu_attn, t_dev_attn = t_attn, 0.0
        else:
            t_dev_attn = max(attn_flops / profile.device_flops, kv_bytes / profile.device_memory_bytes_per_s)
            attn_io, cpu_attn = 0.0, 0.0
        compute = t_experts + t_rest + t_dev_attn
    else:
        # Prepacked on the CPU (memory.cpu_kernels): a CPU store's experts, served in place, and the model's own
        # layers; a disk store's cache slots are rewritten, so their experts keep F.linear.
        t_experts = touched * cpu_matmul_seconds(profile, rows, expert_params, dtype_bytes, packed=store == "cpu")
        t_dense = cpu_matmul_seconds(profile, tokens, shape.dense_params_per_layer, dtype_bytes, packed=True)
        t_attn = max(attn_flops / cpu_flops[1], kv_bytes / profile.host_memcpy_bytes_per_s)
        if decode:   # the dynamic KV cache grows by concatenation: every step copies the layer's cache once
            t_attn += 2 * kv_bytes / profile.host_memcpy_bytes_per_s
        elementwise = profile.elementwise_per_s(dtype_bytes)
        t_elem = ELEMENTWISE_PER_HIDDEN * hidden * tokens / elementwise if elementwise else 0.0
        compute = t_experts + t_dense + t_attn + t_elem
        attn_io, cpu_attn = 0.0, 0.0
    compute += profile.layer_overhead_s or 0.0
    link, _name = _link(profile, device, store)
    if read_bytes is not None:
        reads = read_bytes / shape.expert_bytes
    else:
        share = cand.resident_share
        if schedule == "stream" and share < 1.0:   # the window's slots are not resident while streaming
            share = max(0.0, share - cand.stream_window * shape.expert_bytes / shape.all_expert_bytes)
        reads = touched * (1.0 - share)
    read_s = shape.expert_bytes / link if link else 0.0
    return LayerCost(compute, t_experts, touched, reads if link else 0.0, read_s, attn_io, cpu_attn)


def pipeline_seconds(cost: LayerCost, layers: int, schedule: str, window: int) -> tuple[float, float, float]:
    """(seconds, exposed read seconds, compute seconds) of `layers` identical layers, as the engine runs them.

    - on_demand: the router names the experts, then the misses are read while the resident experts compute (the
      cache's `fetch` yields resident experts first); the missing ones compute once they land.
    - stream: a layer's experts compute as they land, its reads run beside; while a layer computes after its own
      reads are done, the next layer's likely experts are read ahead, at most `window` of them (the slots a streamed
      layer may have loading or landed unused). The first layer has nothing before it to hide its reads. Each read
      also costs 1/`window` of an expert's compute: the window couples reads to compute (a read is admitted only
      when the expert `window` places before it is handed to compute), and the disk is busy read / (read + compute
      / window) of a layer, which is what the engine's read timeline shows (docs/benchmarks.md, planner accuracy).
    """
    per_expert = cost.expert_s / max(cost.touched, 1e-9)
    compute = max(cost.compute_s, cost.cpu_attn_s)
    if schedule != "stream":
        reads_s = cost.reads * cost.read_s + cost.attn_io_s
        hits_s = per_expert * max(0.0, cost.touched - cost.reads)
        # CPU attention runs beside the device's work: the layer takes the longer of the two
        device_s = cost.compute_s - cost.expert_s + max(hits_s, reads_s) + per_expert * min(cost.reads, cost.touched)
        layer = max(cost.cpu_attn_s, device_s)
        return layers * layer, layers * max(0.0, reads_s - hits_s), layers * compute
    reads_s = cost.reads * (cost.read_s + per_expert / max(window, 1)) + cost.attn_io_s   # the window's coupling
    total, exposed, slack = 0.0, 0.0, 0.0
    for _ in range(layers):
        ahead = min(window * cost.read_s, reads_s, slack)   # read during the previous layer's tail
        remaining = reads_s - ahead
        tail = per_expert if remaining > 0 else 0.0         # the last expert to land still computes after it
        layer = max(compute, remaining + tail)
        exposed += max(0.0, layer - compute)
        slack = max(0.0, layer - remaining)
        total += layer
    return total, exposed, layers * compute


def pass_time(shape: ModelShape, profile: MachineProfile, cand: Candidate, device: str, store: str, tokens: int,
              sequences: int, context: int, schedule: str, decode: bool,
              read_bytes_per_pass: float | None = None) -> PhaseTime:
    """Predicted seconds of one forward pass of `tokens` tokens over `sequences` sequences at `context`, and the
    resource that binds it. `read_bytes_per_pass`: measured store reads of such a pass (all layers), if known."""
    per_layer_bytes = None if read_bytes_per_pass is None else read_bytes_per_pass / shape.layers
    cost = layer_cost(shape, profile, cand, device, store, tokens, sequences, context, schedule, decode,
                      per_layer_bytes)
    total, exposed, compute = pipeline_seconds(cost, shape.layers, schedule, cand.stream_window)
    if device == "cuda":
        total += matmul_seconds(sequences, shape.head_params, (profile.device_flops / 8, profile.device_flops))
    else:
        total += cpu_matmul_seconds(profile, sequences, shape.head_params, shape.dtype_bytes, packed=True)
    total += profile.step_overhead_s or 0.0
    _bw, link_name = _link(profile, device, store)
    overhead = shape.layers * (profile.layer_overhead_s or 0.0)
    terms = {link_name: exposed, _proc(device): compute - overhead,
             "CPU attention": shape.layers * cost.cpu_attn_s, "framework overhead per layer": overhead}
    return PhaseTime(total, max(terms, key=terms.get))


def _proc(device: str) -> str:
    return "GPU compute" if device == "cuda" else "CPU compute"


def _link(profile: MachineProfile, device: str, store: str) -> tuple[float, str]:
    """Bandwidth and name of the slowest link an expert crosses (0: nothing moves)."""
    if device == "cuda":
        if store == "disk":
            return min(profile.disk_read_bytes_per_s, profile.h2d_bytes_per_s), (
                "disk read" if profile.disk_read_bytes_per_s < profile.h2d_bytes_per_s else "host-to-device link")
        return profile.h2d_bytes_per_s, "host-to-device link"
    if store == "disk":
        return profile.disk_read_bytes_per_s, "disk read"
    return 0.0, "nothing moves"


def predict(shape: ModelShape, profile: MachineProfile, cand: Candidate, device: str, store: str, batch: int,
            prompt_len: int, gen_len: int, read_bytes: tuple[float | None, float | None] = (None, None)
            ) -> tuple[float, float, float, str]:
    """(prefill tok/s, decode tok/s, generated tok/s overall, binding resource) of one candidate.

    `read_bytes`: measured store bytes per prefill token and per decode token (stats' `bytes_to_device` over the
    tokens, or a benchmark row's), replacing the uniform-routing estimate of that phase; None: estimate."""
    prompt_tokens = batch * prompt_len
    passes = math.ceil(prompt_tokens / cand.micro_batch)
    pass_tokens = min(cand.micro_batch, prompt_tokens)
    seqs_per_pass = max(1, min(batch, math.ceil(cand.micro_batch / prompt_len)))
    pre_bytes, dec_bytes = read_bytes
    pre = pass_time(shape, profile, cand, device, store, pass_tokens, seqs_per_pass, prompt_len,
                    cand.prefill_schedule, decode=False,
                    read_bytes_per_pass=None if pre_bytes is None else pre_bytes * pass_tokens)
    prefill_s = passes * pre.seconds
    # Decode: every sequence in one pass; the context grows, take the middle step.
    dec = pass_time(shape, profile, cand, device, store, batch, batch, prompt_len + gen_len // 2,
                    cand.decode_schedule, decode=True,
                    read_bytes_per_pass=None if dec_bytes is None else dec_bytes * batch)
    decode_steps = max(0, gen_len - 1)   # the first new token comes out of the prefill
    total = prefill_s + decode_steps * dec.seconds
    binding = dec.binding if decode_steps * dec.seconds >= prefill_s else pre.binding + " (prefill)"
    return prompt_tokens / prefill_s, batch / dec.seconds, batch * gen_len / total, binding


def memory_needed(shape: ModelShape, cand: Candidate, device: str, batch: int, prompt_len: int, gen_len: int
                  ) -> tuple[int, int]:
    """(device bytes, host bytes beyond the experts) a candidate needs."""
    kv = batch * (prompt_len + gen_len) * shape.kv_bytes_per_token
    activations = max(cand.micro_batch, batch) * shape.activation_bytes_per_token
    cache = max(_working_set(shape, cand), round(cand.resident_share * shape.all_expert_bytes))
    floor = CUDA_HEADROOM_FLOOR if device == "cuda" else 0
    on_device = shape.resident_bytes + cache + activations + floor + (kv if cand.attention == "device" else 0)
    return on_device, (kv if cand.attention == "cpu" else 0)


def _working_set(shape: ModelShape, cand: Candidate) -> int:
    """The smallest cache a pass runs with: one layer's top-k; a streamed pass also its window."""
    slots = shape.top_k
    if "stream" in (cand.prefill_schedule, cand.decode_schedule):
        slots = max(slots, cand.stream_window + shape.top_k)
    return slots * shape.expert_bytes


def runnable_schedules(shape: ModelShape, prefill: str, decode: str, prefill_tokens: int, batch: int) -> bool:
    """Whether a policy can ask the engine for this pair: one schedule forced for every pass, or, where the two
    differ, `schedule="auto"`, whose per-pass rule must give each phase its own."""
    if prefill == decode:
        return True
    rule = ["stream" if is_wide_pass(n, shape.top_k, shape.experts) else "on_demand" for n in (prefill_tokens, batch)]
    return [prefill, decode] == rule


def candidates(shape: ModelShape, device: str, batch: int, prompt_len: int, gen_len: int, budget: int
               ) -> list[Candidate]:
    """Every policy the planner weighs for this job."""
    prompt_tokens = batch * prompt_len
    micro = sorted({min(prompt_tokens, m) for m in (prompt_len, 256, 1024, 4096, prompt_tokens)})
    attentions = ("device", "cpu") if device == "cuda" else ("device",)

    def schedules(tokens: int) -> tuple[str, ...]:
        return ("on_demand", "stream") if is_wide_pass(tokens, shape.top_k, shape.experts) else ("on_demand",)

    def shares(micro_batch: int, attention: str) -> list[float]:
        # "All that fits" beside what this micro-batch and attention placement need (KV cache, activations).
        bare = Candidate("on_demand", "on_demand", 0.0, micro_batch, attention, DEFAULT_STREAM_WINDOW)
        rest = memory_needed(shape, bare, device, batch, prompt_len, gen_len)[0] - _working_set(shape, bare)
        fits = max(0.0, min(1.0, (budget - rest) / shape.all_expert_bytes))
        return sorted({s for s in RESIDENT_SHARES if s <= fits} | {math.floor(fits * 1000) / 1000})

    out = []
    for m in micro:
        for attn in attentions:
            fitting = shares(m, attn)
            for pre in schedules(m):
                for dec in schedules(batch):
                    if not runnable_schedules(shape, pre, dec, m, batch):
                        continue
                    windows = STREAM_WINDOWS if "stream" in (pre, dec) else (DEFAULT_STREAM_WINDOW,)
                    for share in fitting:
                        for window in windows:
                            out.append(Candidate(pre, dec, share, m, attn, window))
    return out


def make_plan(shape: ModelShape, profile: MachineProfile, batch: int, prompt_len: int, gen_len: int,
              device_memory: int | None = None, store: str | None = None) -> Plan:
    """The fastest candidate that fits `device_memory` (default: the profile's device memory, or 85% of host
    memory on a CPU-only profile); raises PolicyError naming the smallest workable budget when none fits.

    Example: see the module docstring.
    """
    for name, value in (("batch", batch), ("prompt_len", prompt_len), ("gen_len", gen_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PolicyError(f"{name} must be an int >= 1, got {value!r}")
    device = "cuda" if profile.has_device else "cpu"
    host_budget = int(profile.host_memory_bytes * (1 - HOST_HEADROOM))
    if device_memory is None:
        device_memory = profile.device_memory_bytes if device == "cuda" else host_budget
    if isinstance(device_memory, bool) or not isinstance(device_memory, int) or device_memory < 1:
        raise PolicyError(f"device_memory must be a number of bytes >= 1, got {device_memory!r}")
    chose_store = store is None
    if store is None:   # as "auto" decides: experts in host memory when they fit beside the rest
        # On the CPU device host-memory experts are used in place: they count against the budget too.
        limit = min(host_budget, device_memory) if device == "cpu" else host_budget
        store = auto_store(shape.all_expert_bytes, shape.resident_bytes, device == "cpu", limit)
    if store not in ("cpu", "disk"):
        raise PolicyError(f"store must be 'cpu' or 'disk', got {store!r}")
    best: tuple[float, Plan] | None = None
    smallest = None
    for cand in candidates(shape, device, batch, prompt_len, gen_len, device_memory):
        if device == "cpu" and store == "cpu":   # host-memory experts are used in place: all resident
            cand = dataclasses.replace(cand, resident_share=1.0)
        on_device, on_host = memory_needed(shape, cand, device, batch, prompt_len, gen_len)
        host_used = on_host + (shape.all_expert_bytes if store == "cpu" and device == "cuda" else 0)
        if host_used > host_budget:
            continue
        smallest = on_device if smallest is None else min(smallest, on_device)
        if on_device > device_memory:
            continue
        pre, dec, overall, binding = predict(shape, profile, cand, device, store, batch, prompt_len, gen_len)
        cache = max(_working_set(shape, cand), round(cand.resident_share * shape.all_expert_bytes))
        plan = Plan(cand, device, store, on_device, pre, dec, overall, binding, batch, prompt_len, gen_len, cache)
        if best is None or overall > best[0]:
            best = (overall, plan)
    if best is None and chose_store and store == "cpu":   # the weights fit, not the KV cache and activations too
        return make_plan(shape, profile, batch, prompt_len, gen_len, device_memory, store="disk")
    if best is None:
        minimum = smallest          # the least device memory of a candidate host memory can take (None: none)
        where = "device" if device == "cuda" else "host"
        raise PolicyError(f"no plan fits device_memory={format_bytes(device_memory)} for batch={batch} x "
                          f"{prompt_len + gen_len} tokens: the resident part is {format_bytes(shape.resident_bytes)}"
                          f", one layer's top-k experts {format_bytes(shape.top_k * shape.expert_bytes)}; the "
                          f"smallest workable {where} memory is {format_bytes(minimum)} (device_memory={minimum})"
                          if minimum is not None else
                          f"no plan fits: the KV cache of batch={batch} x {prompt_len + gen_len} tokens does not "
                          f"fit host memory ({format_bytes(host_budget)} usable); lower the batch")
    logger.debug("hf_moe_offload %s", best[1].explain())
    return best[1]

