"""Choose each forward pass's schedule from its shape (MoE-Lightning's paged weights, Klotski's expert-aware
pipeline, FlexGen's block schedule, brought to the per-expert cache).

- **on_demand** (a few tokens: batch-1 decode): each layer fetches the experts its router picked; the cache's
  eviction policy decides what stays. Nothing is read speculatively unless `prefetch` says so
  (`lookahead_gate.RouterLookahead`).
- **stream** (a wide pass, `is_wide_pass`: prefill, large batches): every expert is needed about once per pass, in
  forward order. The layer's loads are bounded by a small window of slots, so the rest of the cache holds a stable
  resident set of the hottest experts (`eviction.HotFirst`) instead of churning, and while layer l computes, layer
  l+1's likely experts (router look-ahead) are read into the window in forward order, most-routed first.

The choice is per pass and visible in `hf_moe_offload.stats(model)["passes"]` and `["last_schedule"]`;
`repeat_reads` counts experts read twice in one pass.

Example:
    >>> round(expected_experts(tokens=1, num_experts=8, top_k=2), 2), round(expected_experts(8, 8, 2), 2)
    (2.0, 7.2)
    >>> is_wide_pass(tokens=1, top_k=2, experts=8), is_wide_pass(tokens=8, top_k=2, experts=8)
    (False, True)
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import torch

from . import microbatch
from .lookahead_gate import LookaheadGate, RouterLookahead, layer_records
from ..hooks import LayerHook
from ..policy.offload_policy import AUTO, WIDE_STREAM_WINDOW, WIDE_WINDOW_ROWS

STREAM_SHARE = 0.5    # stream a pass expected to touch at least this share of a layer's experts


def expected_experts(tokens: int, num_experts: int, top_k: int) -> float:
    """Distinct experts a pass of `tokens` tokens touches in one layer if routing were uniform."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def is_wide_pass(tokens: int, top_k: int, experts: int, share: float = STREAM_SHARE) -> bool:
    """Whether a pass of `tokens` tokens is expected to touch at least `share` of a layer's `experts`: the
    `schedule="auto"` rule for streaming it in forward order (the engine's and the planner's)."""
    return expected_experts(tokens, experts, top_k) >= share * experts


class PassState(threading.local):
    """One generating thread's place in its own pass (each thread starts before its first pass)."""

    def __init__(self) -> None:
        self.last_layer: int | None = None    # a layer at or below it (or in another stack) starts a new pass
        self.streaming = False
        self.reading = False                  # on demand: read the next layer's guesses ahead
        self.timing: tuple[str, int, float] | None = None   # (schedule, tokens, start) until the pass ends
        self.first_layer: int | None = None   # the pass's first MoE layer, and the experts its router chose there
        self.first_route: list[int] = []
        self.window = 0                       # the stream window of this pass (and of the next pass's read-ahead)


class PassScheduler(LayerHook):
    """Picks the schedule at each pass's first MoE layer (feeding `cache.begin_pass`), times passes, and drives the
    router look-ahead (`self.lookahead`) at every MoE layer. Added by the engine where the cache is not zero-copy."""

    def __init__(self, engine: Any, share: float = STREAM_SHARE, gate: LookaheadGate | None = None):
        policy = engine.policy
        self.cache, self.counters, self.share = engine.cache, engine.stats, share
        self.schedule = policy.schedule           # "auto", or forced "on_demand" / "stream"
        self.window = policy.stream_window       # concrete once the policy is resolved
        self.widen = False                       # `widen_stream_window`: passes with many rows per expert get more
        self.layers = layer_records(engine)
        self.last_layer = max(self.layers)      # of the last stack: the one every step runs again
        self.lookahead = RouterLookahead(engine, self.layers, gate)
        self._local = PassState()
        # CUDA stalls are timed by events and counted once settled: the look-ahead gate reads them at every pass.
        self._settle = torch.device(policy.device).type == "cuda" or getattr(engine, "devices", None) is not None

    def before_experts(self, layer: int, hidden_states: torch.Tensor) -> None:
        state = self._local
        last = state.last_layer
        micro_batch = microbatch.current()
        later_slice = micro_batch is not None and micro_batch.index > 0     # same layer, same pass
        if not later_slice and (last is None or layer <= last or self.layers[layer].stack != self.layers[last].stack):
            tokens = micro_batch.total_tokens if micro_batch is not None else hidden_states.shape[0]
            self._begin_pass(layer, tokens=tokens)
        state.last_layer = layer
        self.lookahead.before_experts(layer, hidden_states, state.streaming, state.reading, micro_batch)

    def on_route(self, layer: int, experts: Sequence[int]) -> None:
        self.lookahead.on_route(layer, experts)
        state = self._local
        if layer == state.first_layer and state.streaming:
            micro_batch = microbatch.current()
            earlier = state.first_route if micro_batch is not None and micro_batch.index > 0 else []
            state.first_route = earlier + [e for e in experts if e not in earlier]

    def _begin_pass(self, layer: int, tokens: int) -> None:
        moe = self.layers[layer].layer
        if self.schedule == AUTO:
            streaming = is_wide_pass(tokens, moe.top_k, moe.num_experts, self.share)
        else:
            streaming = self.schedule == "stream"
        state = self._local
        state.streaming = streaming
        state.first_layer, state.first_route = layer, []
        if self._settle:
            self.cache.settle_stalls(block=False)
        state.reading = self.lookahead.begin_pass(moe.index, streaming)   # once per pass: room and reads agree
        state.window = self._window(tokens, moe.top_k, moe.num_experts)
        if streaming:
            self.cache.begin_pass(state.window)
        else:   # on demand; while reading ahead, room for the next layer's top-k guesses
            self.cache.begin_pass(None, ahead_room=moe.top_k if state.reading else 0)
        schedule = "stream" if streaming else "on_demand"
        self.counters.record_pass(schedule, state.window if streaming else None)
        state.timing = (schedule, tokens, time.perf_counter())

    def on_layer_done(self, layer: int) -> None:
        timing = self._local.timing
        micro_batch = microbatch.current()
        if micro_batch is not None and not micro_batch.last:
            return
        if timing is not None and self.layers[layer].last_of_stack:
            schedule, tokens, start = timing
            self.counters.record_pass_time(schedule, tokens, time.perf_counter() - start)
            self._local.timing = None
            if layer == self.last_layer:       # after an encoder's pass comes the decoder's, not its own
                self._read_next_pass_ahead()

    def widen_stream_window(self) -> None:
        """`stream_window="auto"` (the default window) on the CPU with no planned window: a streamed pass with at
        least `WIDE_WINDOW_ROWS` rows per expert gets `WIDE_STREAM_WINDOW` slots."""
        self.widen = True

    def _window(self, tokens: int, top_k: int, experts: int) -> int:
        if self.widen and tokens * top_k >= WIDE_WINDOW_ROWS * experts:
            return WIDE_STREAM_WINDOW
        return self.window

    def _read_next_pass_ahead(self) -> None:
        """A streamed pass of the last stack (the one every step runs; Switch's decoder, not its encoder) is done
        with its experts: read the first layer's experts of its next pass now, while the head, sampling and the
        first attention run and the disk would idle. The experts this pass routed there are the guess (a wide pass
        touches most of a layer's experts, and the next step's batch is mostly the same sequences); the stream
        window bounds it, and a wrong guess costs only that idle disk time."""
        state = self._local
        if state.streaming and state.first_layer is not None and state.first_route:
            self.cache.begin_pass(state.window)   # these reads are the next pass's (not this one's repeat reads)
            self.cache.read_ahead(state.first_layer, state.first_route)
            self.cache.issue_read_ahead()
