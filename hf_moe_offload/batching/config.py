"""Continuous batching (transformers' `generate_batch`) on an offloaded model: the token budget per pass.

An offloaded forward pass costs about one read of the experts its tokens route to, whatever the number of tokens, so
every pass should carry as many tokens as memory allows. transformers sizes a continuous-batching run on its own
when `max_batch_tokens` and `num_blocks` are unset: 8192 tokens per pass and a paged KV cache filling 60% (CPU) or
80-90% (CUDA) of the memory free at that moment — memory the offload policy did not plan for (on the CPU it is the
page cache a disk store reads through). `offload_batching_config` sizes both from the policy instead:

- KV cache: `max_batch_size x max_seq_len` tokens (the policy's workload hints, which the "auto" expert cache
  left room for), i.e. `num_blocks = ceil(that / page_size)`; for a `generate_batch` call, room for all its
  requests at once (a whole block each: transformers' blocks are per request), beyond the plan if a share of the
  memory free now (`KV_FREE_SHARE`) holds it.
- tokens per pass: the fewer of
  - the most tokens whose activations, and their attention mask of `tokens x (KV + tokens)` entries (only with
    eager attention: flash needs none, and sdpa runs packed, request by request, `packed_attention.py`), fit in the
    activation memory the policy left for those same tokens (`hf_moe_offload.planning.footprint.sequence_costs`), and
  - where the attention builds that dense mask (eager), the tokens that amortize a pass best: a pass costs
    each of its T tokens about R/T + α·(KV + T) (R: the seconds its expert bytes take to move, α: attention
    seconds per mask entry, both measured: `pass_costs.py`), lowest at T = √(R/α);
  but never fewer than the tokens at which a pass touches `COVERAGE` of a layer's experts (a pass of T tokens with
  top-k of E experts touches about E x (1 - (1 - k/E)^T) of them): below that, experts are read for too few tokens.

An offloaded decoder-only model sizes itself this way when `generate_batch` (or `init_continuous_batching`) gets
no `ContinuousBatchingConfig` (`install_batching_defaults`, attached at load and removed by `disable()`), with the
KV cache no larger than the call's own requests need (transformers' `WorkloadHints`). The same wrapper switches an
sdpa model to packed attention for the run, config given or not.

transformers' default scheduler, "fifo", is decode-maximal (SARATHI): every pass carries every running decode first
and fills the rest of the token budget with prompt chunks (see docs/continuous_batching.md); "prefill_first" is not
(it lets decodes wait while prompts are split across passes).

Example:
    >>> import hf_moe_offload
    >>> from hf_moe_offload.batching.config import offload_batching_config
    >>> model = AutoModelForCausalLM.from_pretrained(path, offload_policy={"store": "disk"})   # doctest: +SKIP
    >>> cb_config = offload_batching_config(model)                                            # doctest: +SKIP
    >>> out = model.generate_batch(prompt_ids, generation_config=GenerationConfig(max_new_tokens=64),
    ...                            continuous_batching_config=cb_config)                      # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Callable

import psutil
import torch
from torch import nn
from transformers import ContinuousBatchingConfig
from transformers.utils.generic import is_flash_attention_requested

from ..attention.packed import one_packed_run_at_a_time, runs_packed, use_packed_attention
from ..planning.footprint import CUDA_HEADROOM_FLOOR, sequence_costs
from ..policy.offload_policy import PolicyError, format_bytes
from ..runtime.engine import get_engine
from .pass_costs import PassCosts, measure_pass_costs

logger = logging.getLogger(__name__)

COVERAGE = 0.99   # share of a layer's experts a pass must touch for its reads to count as amortized
# Most of the free memory a generate_batch call's KV cache may take beyond the policy's plan: (host, GPU). The host
# share is smaller: the page cache a disk store reads through and the user's other work live there.
KV_FREE_SHARE = (0.25, 0.5)


@dataclass(frozen=True)
class TokenBudget:
    """The continuous-batching sizes chosen for an offloaded model, and what they came from.

    Example:
        >>> TokenBudget(max_batch_tokens=1000, num_blocks=16, kv_tokens=4096, coverage_tokens=17,
        ...             memory_tokens=3976, amortizing_tokens=1000).num_blocks
        16
    """

    max_batch_tokens: int   # query tokens per forward pass
    num_blocks: int         # paged KV cache blocks of `page_size` tokens
    kv_tokens: int          # max_batch_size x max_seq_len from the policy (fewer if a call's requests need fewer)
    coverage_tokens: int    # the floor: tokens at which a pass touches COVERAGE of a layer's experts
    memory_tokens: int      # the most tokens whose activations and mask fit the memory left for them
    amortizing_tokens: int | None = None   # √(R/α) where the attention builds a dense mask (eager), else None
    costs: PassCosts | None = None         # the measured R and α behind `amortizing_tokens`
    holds_every_request: bool = False      # a call's requests all fit at their longest: no free-block margin needed


def coverage_tokens(num_experts: int, top_k: int, coverage: float = COVERAGE) -> int:
    """The fewest tokens at which a pass touches `coverage` of a layer's experts (the inverse of
    `runtime.pass_scheduler.expected_experts`).

    Example:
        >>> coverage_tokens(8, 2), coverage_tokens(128, 8), coverage_tokens(4, 4)
        (17, 72, 1)
    """
    if top_k >= num_experts:
        return 1
    return max(1, math.ceil(math.log(1 - coverage) / math.log(1 - top_k / num_experts)))


def tokens_within_activation_memory(kv_tokens: int, activation_bytes_per_token: int, mask_bytes_per_entry: int
                                    ) -> int:
    """The most tokens M (at most `kv_tokens`) with M x activation + M x (kv_tokens + M) x mask entry bytes
    <= kv_tokens x activation, i.e. whose activations and attention mask fit the activation memory the policy left
    for `kv_tokens` tokens. `mask_bytes_per_entry` is 0 where no mask is built (flash attention).

    Example:
        >>> tokens_within_activation_memory(4096, 537088, 0)    # Mixtral-8x7B bf16, flash attention
        4096
        >>> tokens_within_activation_memory(4096, 537088, 2)    # eager: the bf16 mask takes a share
        3976
    """
    budget = kv_tokens * activation_bytes_per_token
    if mask_bytes_per_entry == 0:
        return kv_tokens
    # a M^2 + b M - budget <= 0, with a = mask bytes, b = activation + mask bytes x KV tokens
    a, b = mask_bytes_per_entry, activation_bytes_per_token + mask_bytes_per_entry * kv_tokens
    tokens = (math.isqrt(b * b + 4 * a * budget) - b) // (2 * a)
    while a * (tokens + 1) ** 2 + b * (tokens + 1) <= budget:   # isqrt floors: step up to the exact root
        tokens += 1
    return min(tokens, kv_tokens)


def token_budget(model: nn.Module, page_size: int, pass_costs: PassCosts | None = None, amortize: bool = True,
                 workload=None) -> TokenBudget:
    """The token budget of an offloaded model's continuous batching (the rule in this module's docstring).
    `pass_costs`: R and α to use instead of measuring them (only used where the attention builds a dense mask);
    `amortize=False`: the memory rule and the coverage floor alone; `workload`: transformers' `WorkloadHints` of a
    `generate_batch` call, whose requests all at once bound the KV cache from above.

    Example:
        >>> token_budget(mixtral_8x7b_bf16_sdpa_offloaded, page_size=256)      # doctest: +SKIP
        TokenBudget(max_batch_tokens=4096, num_blocks=16, kv_tokens=4096, coverage_tokens=17, memory_tokens=4096, ...)
        >>> token_budget(mixtral_8x7b_bf16_eager_offloaded, page_size=256)     # doctest: +SKIP
        TokenBudget(max_batch_tokens=1093, num_blocks=16, kv_tokens=4096, coverage_tokens=17, memory_tokens=3976, ...)
    """
    engine = _causal_engine(model)
    policy = engine.policy
    kv_tokens = int(policy.max_batch_size) * int(policy.max_seq_len)
    blocks = math.ceil(kv_tokens / page_size)
    holds_every_request = False
    if _usable(workload):
        # A generate_batch call: room for all its requests at once (a block each at least: blocks are per request),
        # which may exceed the policy's plan (its max_batch_size is often 1) up to a share of the memory free now;
        # never more than the requests need.
        length = workload.max_prompt_length + max(workload.max_generated_length, 0)
        per_request = math.ceil(length / page_size)
        room = _blocks_in_free_memory(model, engine, page_size)
        need = workload.num_requests * per_request
        blocks = max(min(need, max(blocks, room)), per_request)
        kv_tokens = min(kv_tokens, workload.num_requests * length)
        holds_every_request = blocks >= need
    activation = sequence_costs(model.config, model.dtype)["activation_bytes_per_token"]
    dense_mask = not is_flash_attention_requested(model.config) and not runs_packed(model)
    mask_entry = model.dtype.itemsize if dense_mask else 0
    floor = max(coverage_tokens(layer.num_experts, layer.top_k) for layer in engine.layers)
    memory = tokens_within_activation_memory(kv_tokens, activation, mask_entry)
    costs = amortizing = None
    if dense_mask and amortize:
        costs = pass_costs or measure_pass_costs(model, engine)
        amortizing = costs.amortizing_tokens
    max_batch_tokens = max(floor, min(memory, amortizing or memory))
    num_blocks = max(blocks, math.ceil(max_batch_tokens / page_size))
    return TokenBudget(max_batch_tokens, num_blocks, kv_tokens, floor, memory, amortizing, costs,
                       holds_every_request)


def _blocks_in_free_memory(model: nn.Module, engine, page_size: int) -> int:
    """KV blocks that fit in `KV_FREE_SHARE` of the compute device's memory free now (after the expert cache).

    On CUDA, the activations of the plan's max_batch_size x max_seq_len tokens and the headroom floor are not
    free for KV: an "auto" cache left exactly that (with the plan's KV), and `max_batch_tokens` still uses all
    those activations."""
    device = torch.device(engine.policy.device) if engine.devices is None else \
        next(iter(engine.cache.caches.values())).device
    if device.type == "cuda":
        planned_tokens = int(engine.policy.max_batch_size) * int(engine.policy.max_seq_len)
        activations = planned_tokens * sequence_costs(model.config, model.dtype)["activation_bytes_per_token"]
        free = max(0, torch.cuda.mem_get_info(device)[0] - activations - CUDA_HEADROOM_FLOOR)
    else:
        free = psutil.virtual_memory().available
    block_bytes = page_size * sequence_costs(model.config, model.dtype)["kv_bytes_per_token"]
    return int(free * KV_FREE_SHARE[device.type == "cuda"] // max(block_bytes, 1))


def without_cuda_graphs(config: ContinuousBatchingConfig) -> ContinuousBatchingConfig:
    """A user's `ContinuousBatchingConfig` for an offloaded model: `use_cuda_graph` unset becomes False (a copy,
    logged; transformers would turn graphs on where no mask is needed, and capture cannot run the offloaded
    experts); asking for graphs is refused."""
    graphs = config.use_cuda_graph
    if graphs is None:
        logger.info("hf_moe_offload continuous batching: use_cuda_graph=False on the given ContinuousBatchingConfig "
                    "(which experts run is decided on the host every pass, so it cannot be captured)")
        return dataclasses.replace(config, use_cuda_graph=False)
    if graphs is True or (isinstance(graphs, (tuple, list)) and any(graphs)):
        raise PolicyError(f"use_cuda_graph={graphs!r} is not allowed on a model offloaded by hf_moe_offload: "
                          f"which experts run is decided on the host every pass, so a pass cannot be captured; "
                          f"allowed: use_cuda_graph=False or None")
    return config


def _usable(workload) -> bool:
    """Whether transformers' `WorkloadHints` describe real requests (generate_batch's do; defaults are zeros)."""
    return workload is not None and workload.num_requests > 0 and workload.max_prompt_length > 0


def offload_batching_config(model: nn.Module, base: ContinuousBatchingConfig | None = None,
                            pass_costs: PassCosts | None = None, workload=None, **overrides
                            ) -> ContinuousBatchingConfig:
    """A `ContinuousBatchingConfig` for `model.generate_batch` / `init_continuous_batching` on an offloaded model:
    `base` (or the defaults) with `overrides` applied, then `max_batch_tokens` and `num_blocks` filled by
    `token_budget` and `use_cuda_graph` set to False (offloaded experts cannot be captured in a CUDA graph) where
    still unset. Values set in `base` or `overrides` win; a `max_memory_percent` given leaves `num_blocks` to
    transformers, which sizes the KV cache from that share of the memory free. The choice is logged.
    `pass_costs`: R and α to use instead of measuring them (`pass_costs.measure_pass_costs`, a fraction of a second
    plus a few expert reads when the model has not read enough yet); nothing is measured when `max_batch_tokens`
    is given. `workload`: transformers' `WorkloadHints` (what `generate_batch` passes), bounding the KV cache.

    Example:
        >>> cb = offload_batching_config(model, scheduler_type="fifo")                # doctest: +SKIP
        >>> model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb)   # doctest: +SKIP
    """
    config = dataclasses.replace(base or ContinuousBatchingConfig(), **overrides)
    # A given max_batch_tokens leaves nothing for the amortizing rule to decide: measure nothing then.
    budget = token_budget(model, config.page_size, pass_costs, amortize=config.max_batch_tokens is None,
                          workload=workload)
    chosen = {}
    if config.max_batch_tokens is None:
        chosen["max_batch_tokens"] = budget.max_batch_tokens
    if config.num_blocks is None and config.max_memory_percent is None:
        # (a share of memory given: transformers sizes the KV cache from it, as it would without offloading)
        chosen["num_blocks"] = budget.num_blocks
    if config.safety_margin is None and budget.holds_every_request and "num_blocks" in chosen:
        # transformers stops admitting prompts while fewer than 15% of the blocks are free, so that running
        # requests can grow; a cache sized for every request at its longest never runs out, and the margin would
        # only hold the last prompts back for a second wave of decode passes (each a full read of the experts).
        chosen["safety_margin"] = 0.0
    if config.use_cuda_graph is None:
        # Which experts run is decided on the host every pass, so the forward cannot be captured; transformers
        # turns graphs on by itself where no attention mask is needed (flash attention on a GPU).
        chosen["use_cuda_graph"] = False
    _log_budget(model, config, budget, chosen)
    return dataclasses.replace(config, **chosen)


def install_batching_defaults(model: nn.Module) -> Callable[[], None] | None:
    """Make `model.init_continuous_batching` (what `generate_batch` and `continuous_batching_context_manager` call)
    use `offload_batching_config` when it gets no `ContinuousBatchingConfig`, sized for the call's `WorkloadHints`,
    with the engine's `batching_overrides` (fields a caller fixed, e.g. a server's `--cb-*` flags) applied.
    An instance attribute, as accelerate's hooks are; returns the function that removes it (None: nothing to do,
    the model has no continuous batching or is an encoder-decoder).

    Example:
        >>> undo = install_batching_defaults(model)                      # doctest: +SKIP
        >>> model.generate_batch(prompts, generation_config=gc)          # sized by offload_batching_config  # doctest: +SKIP
        >>> undo()                                                       # doctest: +SKIP
    """
    if not hasattr(model, "init_continuous_batching") or getattr(model.config, "is_encoder_decoder", False):
        return None
    own = vars(model).get("init_continuous_batching")     # the user's own override, put back on removal
    original = model.init_continuous_batching

    @functools.wraps(original)
    def init_continuous_batching(generation_config=None, continuous_batching_config=None, workload_hints=None,
                                 **kwargs):
        generation = generation_config if generation_config is not None else model.generation_config
        given = continuous_batching_config is not None or isinstance(
            getattr(generation, "continuous_batching_config", None), ContinuousBatchingConfig)
        reused = getattr(model, "_cached_continuous_batching_manager", None) is not None   # its config stays
        if not given and not reused:
            engine = get_engine(model)
            overrides = engine.batching_overrides if engine is not None else {}
            # Fixed fields are the caller's: CUDA graphs asked for there are refused, as in a given config.
            continuous_batching_config = without_cuda_graphs(
                offload_batching_config(model, workload=workload_hints, **overrides))
        elif given and not reused:
            continuous_batching_config = without_cuda_graphs(
                continuous_batching_config or generation.continuous_batching_config)
        manager = original(generation_config=generation_config, continuous_batching_config=continuous_batching_config,
                           workload_hints=workload_hints, **kwargs)
        use_packed_attention(model, manager)     # before its first pass: no dense mask of every request's keys
        return manager

    # One run at a time where runs switch the model's attention (sdpa -> packed): see attention.packed.
    installed = one_packed_run_at_a_time(model, init_continuous_batching)
    model.init_continuous_batching = installed

    def remove() -> None:
        if vars(model).get("init_continuous_batching") is installed:
            if own is not None:
                model.init_continuous_batching = own
            else:
                del model.init_continuous_batching

    return remove


def _causal_engine(model: nn.Module):
    """The model's offload engine; continuous batching needs an offloaded decoder-only model."""
    engine = get_engine(model)
    if engine is None:
        raise PolicyError("this model is not offloaded by hf_moe_offload: load it with offload_policy=... or call "
                          "hf_moe_offload.enable(model, policy) before sizing its continuous batching")
    if getattr(model.config, "is_encoder_decoder", False):
        raise PolicyError(f"continuous batching (generate_batch) is for decoder-only models; "
                          f"{type(model).__name__} is an encoder-decoder: use model.generate")
    return engine


def _log_budget(model: nn.Module, config: ContinuousBatchingConfig, budget: TokenBudget, chosen: dict) -> None:
    kept = [name for name in ("max_batch_tokens", "num_blocks") if name not in chosen]
    costs = sequence_costs(model.config, model.dtype)
    if budget.amortizing_tokens is None:
        amortizing = ""
    else:
        pc = budget.costs
        amortizing = (f", at most {budget.amortizing_tokens} = sqrt(R/alpha) to amortize a pass (R = {pc.fixed_s:.3f} s "
                      f"to move {format_bytes(pc.moved_bytes)} at {pc.bytes_per_s / 1e9:.2f} GB/s, {pc.rate_source}; "
                      f"alpha = {pc.attention_s_per_entry:.3g} s per attention mask entry)")
    logger.info("hf_moe_offload continuous batching: max_batch_tokens=%d num_blocks=%d (page_size=%d, KV cache %s "
                "for max_batch_size x max_seq_len = %d tokens at %s per token; tokens per pass: %d within the "
                "activation memory left for them%s, at least %d to touch %.0f%% of a layer's experts; "
                "scheduler=%s)%s",
                config.max_batch_tokens or budget.max_batch_tokens, config.num_blocks or budget.num_blocks,
                config.page_size, format_bytes(budget.kv_tokens * costs["kv_bytes_per_token"]), budget.kv_tokens,
                format_bytes(costs["kv_bytes_per_token"]), budget.memory_tokens, amortizing, budget.coverage_tokens,
                COVERAGE * 100, config.scheduler_type, f"; kept as given: {', '.join(kept)}" if kept else "")
