"""Router look-ahead: guess the next layer's experts from this layer's input, and decide whether to read them ahead.

`RouterLookahead` applies the next MoE layer's router to this layer's hidden states (`likely_experts`). The guesses
feed three users: the streamed schedule's read-ahead, on-demand read-ahead (by `prefetch`), and `eviction="lookahead"`
(the next `EVICTION_LOOKAHEAD_LAYERS` layers' guesses tell the eviction policy which experts this pass still uses).
Exact either way: each layer's own router still decides; a wrong guess costs bytes, never tokens.

On-demand read-ahead by `prefetch`: "lookahead" always reads the next layer's top-k guesses; "auto" (the default)
reads them only while they pay, as `LookaheadGate` (precision) and `PayoffTrial` (stall per pass) measure; "none"
and "hash" never (the hash prefetcher has its own table). `PassScheduler` owns a `RouterLookahead` and calls it at
each pass start and MoE layer.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..arch.routing import RouterKind
from ..layout import MoELayer
from ..memory.eviction import LookAhead
from ..policy.offload_policy import AUTO

EVICTION_LOOKAHEAD_LAYERS = 2   # eviction="lookahead": the routers of this many next layers guess this pass's uses
MIN_HIT_SAVES = 0.05            # the measured exposure never drops the gate's hit_saves below this
EXPOSURE_EWMA = 0.2             # weight of a new exposure measurement
EXPOSURE_MIN_MISSES = 8         # demand misses between two exposure measurements


@dataclass
class LayerRecord:
    """One offloaded MoE layer as the schedule and the look-ahead see it (built once, by `layer_records`)."""

    layer: MoELayer
    stack: str                                # the top module: Switch has "encoder" and "decoder" stacks
    next: int | None                          # the next MoE layer of the same stack, if any
    last_of_stack: bool                       # a pass of this stack ends with this layer
    router_kind: RouterKind | None            # how its router picks; None: a top-k of `router_weight`'s logits
    router_weight: torch.Tensor | None = None  # only where `router_kind` is None (adapters without kinds: Switch)


def layer_records(engine: Any) -> dict[int, LayerRecord]:
    """The engine's MoE layers by index, in forward order, each with its stack, successor and router."""
    layers = engine.layers
    stacks = [layer.name.split(".", 1)[0] for layer in layers]
    nexts = {a.index: b.index for a, b, sa, sb in zip(layers, layers[1:], stacks, stacks[1:]) if sa == sb}
    last = {stack: max(layer.index for layer, st in zip(layers, stacks) if st == stack) for stack in set(stacks)}
    # How each router picks (sigmoid + bias + group top-k differ from a top-k of the logits).
    kinds = {layer.index: engine.arch.router_kind(engine.model, layer) for layer in layers}
    weights = {layer.index: engine.arch.router_weight(engine.model, layer) for layer in layers
               if kinds[layer.index] is None}
    return {layer.index: LayerRecord(layer, stack, nexts.get(layer.index), layer.index == last[stack],
                                     kinds[layer.index], weights.get(layer.index))
            for layer, stack in zip(layers, stacks)}


class LookaheadGate:
    """`prefetch="auto"`'s rule: read the next layer's guessed experts ahead only while that pays.

    Every on-demand pass guesses, whether or not it reads: the next layer's router on this layer's input names its
    top-k, and the guesses that are not resident (what a read-ahead would read) are scored against what the router
    then chose. So the precision is measured all the time, also while reading is off, and reading comes back as
    soon as the guesses get good, without a probe that costs bytes.

    Break-even, per read-ahead of one expert taking `t` on the link:
    - a used guess was going to be read anyway, as a demand miss of the next layer; reading it early hides at most
      the part of that read the demand path leaves exposed: it saves `hit_saves * t` (`hit_saves` <= 1; 1 assumes
      the whole read would have stalled, the most favourable case for look-ahead);
    - a wasted guess costs its own read, `t`, on the same link as the demand reads after it, and takes a slot
      whose resident expert is then read again with about the cache's hit rate `h`: `(1 + h) * t`. Where the cache
      stages guesses (`memory/staging.py`) the slot is one of a room kept out of the demand loads' reach, which
      costs those loads about as many hits while reading ahead is on, so the price stays.
    It pays when precision `p > (1 + h) / (1 + h + hit_saves)`. `hit_saves` starts at 1 and then follows the
    measured exposure (`measured_exposure`, fed by the look-ahead every few misses). The precision and `h` are
    measured over the last `window` guesses (h over the routed experts that were not guessed, so the look-ahead's
    own loads do not inflate it); reading starts once `min_guesses` are scored and precision is above the
    break-even, and stops when it falls `hysteresis` below it.

    Example:
        >>> gate = LookaheadGate(window=8, min_guesses=4)
        >>> for _ in range(4): gate.record(guessed=2, used=2, routed_resident=0, routed_other=0)
        >>> gate.on, gate.precision
        (True, 1.0)
        >>> for _ in range(4): gate.record(guessed=2, used=0, routed_resident=1, routed_other=1)
        >>> gate.on, gate.precision, round(gate.break_even, 3)
        (False, 0.0, 0.6)
    """

    def __init__(self, window: int = 64, min_guesses: int = 16, hit_saves: float = 1.0, hysteresis: float = 0.05):
        if not 0 < hit_saves <= 1:
            raise ValueError(f"hit_saves={hit_saves!r} is not allowed; allowed: a share of one read in (0, 1]")
        self.window, self.min_guesses, self.hit_saves, self.hysteresis = window, min_guesses, hit_saves, hysteresis
        self.exposure_measured = False     # whether `hit_saves` comes from a measurement yet
        self.require_exposure = False      # stay off until it does (set where the exposure can be measured)
        self.guesses: deque[bool] = deque(maxlen=window)      # per non-resident guess: did the router choose it
        self.routed: deque[bool] = deque(maxlen=window)       # per routed, unguessed expert: was it resident
        self.on = False

    @property
    def precision(self) -> float | None:
        return sum(self.guesses) / len(self.guesses) if self.guesses else None

    @property
    def hit_rate(self) -> float:
        return sum(self.routed) / len(self.routed) if self.routed else 0.0

    @property
    def break_even(self) -> float:
        h = self.hit_rate
        return (1.0 + h) / (1.0 + h + self.hit_saves)

    def measured_exposure(self, stall_per_miss_s: float, read_s: float) -> None:
        """Set `hit_saves` from the share of a demand read that compute waited for (stall per demand miss / time of
        one read): an EWMA within [MIN_HIT_SAVES, 1], so that reads can always come back."""
        if read_s <= 0:
            return
        exposed = min(1.0, max(MIN_HIT_SAVES, stall_per_miss_s / read_s))
        if self.exposure_measured:
            self.hit_saves = (1 - EXPOSURE_EWMA) * self.hit_saves + EXPOSURE_EWMA * exposed
        else:                              # the first measurement replaces the optimistic starting value
            self.hit_saves, self.exposure_measured = exposed, True

    def record(self, guessed: int, used: int, routed_resident: int, routed_other: int) -> None:
        """One layer's turn: `used` of `guessed` non-resident guesses were chosen by its router; of the routed
        experts that were not guessed, `routed_resident` were resident and `routed_other` were not."""
        self.guesses.extend([True] * used + [False] * (guessed - used))
        self.routed.extend([True] * routed_resident + [False] * routed_other)
        if len(self.guesses) < self.min_guesses:
            return
        precision, break_even = self.precision, self.break_even
        if self.require_exposure and not self.exposure_measured:
            return                         # the optimistic starting hit_saves alone must not turn reading on
        if precision >= break_even:
            self.on = True
        elif precision < break_even - self.hysteresis:
            self.on = False


class PayoffTrial:
    """The second half of `prefetch="auto"`: once `LookaheadGate` says reading ahead could pay, check that it does,
    by the quantity it exists to lower: the stall per on-demand pass.

    The break-even prices a wasted guess at one read plus one re-read, but an eviction can cascade (in a cyclic
    access pattern each extra LRU eviction costs a chain of misses), so good guesses can still lower the hit rate.
    Passes run in alternating blocks with reads off and on (`block` passes each, `rounds` of each); reading is kept
    for the next `hold` passes only if the blocks with reads stalled less than those without, by `margin`; then the
    trial runs again (the routing, the cache's contents and the disk change). Alternating blocks keep slow drifts of
    a shared disk out of the verdict.

    Example:
        >>> trial = PayoffTrial(block=1, rounds=1, hold=2)
        >>> [trial.next_pass(stall_s=s) for s in (None, 0.2, 0.1)]    # off, on, then the verdict: on pays
        [False, True, True]
        >>> trial.verdict
        'on'
    """

    def __init__(self, block: int = 4, rounds: int = 2, hold: int = 256, margin: float = 0.05):
        self.block, self.rounds, self.hold, self.margin = block, rounds, hold, margin
        self.verdict: str = "trial"                 # "trial", "on" or "off"
        self.stall = {False: 0.0, True: 0.0}        # trial stall seconds with reads off / on
        self.passes = {False: 0, True: 0}
        self._step = 0                              # passes into the current trial or hold
        self._reading = False                       # what the pass now running does

    def reset(self) -> None:
        """Start over (the precision rule turned reading off, so what was measured is stale)."""
        self.__init__(self.block, self.rounds, self.hold, self.margin)

    def next_pass(self, stall_s: float | None) -> bool:
        """The previous pass (if any) stalled `stall_s`; whether the next pass reads ahead."""
        if self.verdict == "trial":
            if stall_s is not None and self._step > 0:
                self.stall[self._reading] += stall_s
                self.passes[self._reading] += 1
            if self._step >= 2 * self.block * self.rounds:
                off = self.stall[False] / max(self.passes[False], 1)
                on = self.stall[True] / max(self.passes[True], 1)
                self.verdict, self._step = ("on" if on < off * (1 - self.margin) else "off"), 0
            else:
                self._reading = (self._step // self.block) % 2 == 1      # off block, on block, off, on...
                self._step += 1
                return self._reading
        self._step += 1
        if self._step > self.hold:
            self.reset()
            return self.next_pass(None)
        self._reading = self.verdict == "on"
        return self._reading


class LookaheadState(threading.local):
    """One generating thread's guesses within its own pass (each thread starts with none)."""

    def __init__(self) -> None:
        # next layer -> its scored non-resident top-k guesses (on CUDA, score-only: counts still being copied)
        self.guesses: dict[int, "set[int] | _PendingGuess"] = {}
        self.slice_guesses: dict[int, list[int]] = {}    # next layer -> the guesses of this layer's slices so far


class RouterLookahead:
    """Guesses the next layers' experts by their routers, reads them ahead, scores them for `prefetch="auto"` and
    feeds them to `eviction="lookahead"`. Driven by `PassScheduler` (`begin_pass`, `before_experts`, `on_route`)."""

    def __init__(self, engine: Any, layers: dict[int, LayerRecord], gate: LookaheadGate | None = None):
        self.cache, self.counters, self.layers = engine.cache, engine.stats, layers
        self.prefetch = engine.policy.prefetch   # "lookahead": always read ahead on demand; "auto": while it pays
        self.gate = (gate or LookaheadGate()) if self.prefetch == AUTO else None
        eviction = engine.cache.eviction
        self.eviction = eviction if isinstance(eviction, LookAhead) else None   # fed this pass's guesses
        if self.prefetch == "lookahead" or self.eviction is not None:
            feature = "prefetch='lookahead'" if self.prefetch == "lookahead" else "eviction='lookahead'"
            for record in layers.values():
                if record.router_kind is not None:
                    record.router_kind.check(feature)
        self._local = LookaheadState()
        self._exposure_base = (0.0, 0)       # (stall_s, misses) at the last exposure measurement
        self.trial = PayoffTrial()             # prefetch="auto": does reading ahead lower the stall per pass
        self._trial_base: float | None = None  # stall_s when the last on-demand pass began
        if self.gate is not None and gate is None and getattr(self.cache.copy, "meter", None) is not None:
            self.gate.require_exposure = True   # read ahead only once a read's exposed share is measured
        self._publish()

    @property
    def reading_ahead(self) -> bool:
        """Whether on-demand passes read the next layer's guesses now (with "auto": the precision rule allows it and
        the payoff trial has not found that reading fails to lower the stall)."""
        return self.prefetch == "lookahead" or (self.gate is not None and self.gate.on and self.trial.verdict != "off")

    def begin_pass(self, layer: int, streaming: bool) -> bool:
        """A pass starts at MoE layer `layer`; whether it reads the next layers' guesses ahead on demand."""
        if self.gate is not None and not streaming:
            self._measure_exposure(layer)
        reading = self._reads_this_pass(streaming)
        self._local.guesses = {}
        return reading

    def before_experts(self, layer: int, hidden_states: torch.Tensor, streaming: bool, reading: bool,
                       micro_batch: Any) -> None:
        """MoE layer `layer` is about to run: guess the next layer's experts, then read, score and predict them."""
        nxt = self.layers[layer].next
        if nxt is None:
            return
        read = streaming or reading
        # Guesses are scored against the next layer's routing of the same rows: not across micro-batches.
        score = self.gate is not None and not streaming and micro_batch is None
        if not (read or score or self.eviction is not None):
            return
        if self.eviction is None and self._all_resident(nxt):
            # Nothing to read, so no guess (the router's product, and on CUDA a sync to rank it); a guess is scored
            # by its non-resident experts, none here, and the routing still counts at `on_route`.
            if score:
                self._local.guesses[nxt] = set()
            return
        if score and not read and self.eviction is None and hidden_states.is_cuda:
            self._score_later(nxt, hidden_states)
            return
        likely = self.likely_experts(nxt, hidden_states)
        if micro_batch is not None:     # the layer's slices so far name the next layer's experts together
            earlier = self._local.slice_guesses.get(nxt, []) if micro_batch.index > 0 else []
            likely = earlier + [e for e in likely if e not in earlier]
            self._local.slice_guesses = {nxt: likely}
        if score:   # what a read-ahead would read: the first top-k guesses that are not resident
            top_k = self.layers[nxt].layer.top_k
            self._local.guesses[nxt] = {e for e in likely[:top_k] if (nxt, e) not in self.cache.resident}
        if read:
            self.cache.read_ahead(nxt, likely)
        if self.eviction is not None:
            self._predict_uses(nxt, likely, hidden_states)

    def _all_resident(self, layer: int) -> bool:
        """Whether every expert of `layer` is in the cache now."""
        return all((layer, e) in self.cache.resident for e in range(self.layers[layer].layer.num_experts))

    def _score_later(self, nxt: int, hidden_states: torch.Tensor) -> None:
        """Score-only guesses on CUDA: the counts come to the host without a sync of their own (a copy into pinned
        memory, done by the time the next layer's routing has synchronized), and are ranked at its `on_route`."""
        indices = self._routed_indices(nxt, hidden_states)
        if indices is None:
            return                              # every expert would be guessed: nothing to learn
        counts = count_experts(indices, self.layers[nxt].layer.num_experts)
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(counts.device))
        self._local.guesses[nxt] = _PendingGuess(host, copied)

    def _predict_uses(self, nxt: int, likely: list[int], hidden_states: torch.Tensor) -> None:
        """Tell the eviction policy the experts the next layers of this pass will likely use."""
        self.eviction.predict(nxt, likely)
        after = nxt
        for _ in range(EVICTION_LOOKAHEAD_LAYERS - 1):
            after = self.layers[after].next
            if after is None:
                break
            self.eviction.predict(after, self.likely_experts(after, hidden_states))

    def on_route(self, layer: int, experts: Sequence[int]) -> None:
        """The router chose `experts`: score this layer's guesses and tell the eviction policy."""
        if self.eviction is not None:
            self.eviction.observe(layer, experts)
        guesses = self._local.guesses.pop(layer, None)
        if guesses is None:
            return
        if isinstance(guesses, _PendingGuess):
            ranked = guesses.ranked()
            if ranked is None:
                return                              # its counts have not landed: skip one sample, never wait
            top_k = self.layers[layer].layer.top_k
            guesses = {e for e in ranked[:top_k] if (layer, e) not in self.cache.resident}
        routed = {int(e) for e in experts}
        others = routed - guesses
        resident = sum(1 for e in others if (layer, e) in self.cache.resident)
        used = len(guesses & routed)
        self.gate.record(len(guesses), used, resident, len(others) - resident)
        self.counters.record_lookahead(layer, len(guesses), used)
        self._publish()

    def _publish(self) -> None:
        if self.gate is None:
            self.counters.set_lookahead(self.prefetch == "lookahead", None, None)
        else:
            self.counters.set_lookahead(self.reading_ahead, self.gate.precision, self.gate.break_even,
                                        self.gate.hit_saves)

    def _reads_this_pass(self, streaming: bool) -> bool:
        """Whether this on-demand pass reads the next layers' guesses ahead: always with prefetch="lookahead"; with
        "auto" while the precision rule says it could pay and the payoff trial says it does."""
        if streaming:
            self._trial_base = None                 # a streamed pass's stall is not an on-demand pass's
            return False
        if self.prefetch == "lookahead":
            return True
        if self.gate is None:
            return False
        if not self.gate.on:
            stale = self.trial.verdict != "trial" or any(self.trial.passes.values())
            self.trial.reset()                      # what it measured is stale once the precision rule says no
            if stale:                               # so the counters show no verdict of a trial set aside
                self.counters.set_lookahead_trial(self.trial.verdict, self.trial.stall, self.trial.passes)
            self._trial_base = None
            return False
        stall = self.counters.stall_and_misses()[0]
        base, self._trial_base = self._trial_base, stall
        reading = self.trial.next_pass(None if base is None or stall < base else stall - base)
        self.counters.set_lookahead_trial(self.trial.verdict, self.trial.stall, self.trial.passes)
        self._publish()                             # lookahead_on follows the verdict
        return reading

    def _measure_exposure(self, layer: int) -> None:
        """Feed the gate the share of a demand read exposed as a stall: the counters' stall and misses since the
        last measurement over the copy engine's measured read bandwidth (on CUDA its timed copies cover the
        host-to-device part only, which overstates the exposure: the gate errs toward reading)."""
        meter = getattr(self.cache.copy, "meter", None)
        if meter is None:
            return
        if hasattr(meter, "settle"):
            meter.settle()
        stall, misses = self.counters.stall_and_misses()
        last_stall, last_misses = self._exposure_base
        if misses < last_misses or stall < last_stall:      # the counters were reset
            self._exposure_base = (stall, misses)
            return
        if misses - last_misses < EXPOSURE_MIN_MISSES or not meter.bytes_per_s:
            return
        read_s = self.cache.store.slab_bytes(layer) / meter.bytes_per_s
        self.gate.measured_exposure((stall - last_stall) / (misses - last_misses), read_s)
        self._exposure_base = (stall, misses)

    def likely_experts(self, layer: int, hidden_states: torch.Tensor) -> list[int]:
        """Layer `layer`'s router applied to these hidden states, selecting as that router does (its
        `RouterKind`): experts any token would pick, most-routed first; every expert if it cannot be rebuilt."""
        indices = self._routed_indices(layer, hidden_states)
        num_experts = self.layers[layer].layer.num_experts
        return list(range(num_experts)) if indices is None else rank_experts(indices, num_experts)

    def _routed_indices(self, layer: int, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The experts [T, k] layer `layer`'s router would pick for these hidden states, on their device; None
        when the router cannot be rebuilt (every expert is then a guess)."""
        record = self.layers[layer]
        kind = record.router_kind
        if kind is not None:
            return None if kind.refused else kind.experts_for(hidden_states)
        weight = record.router_weight
        if weight is None:
            return None
        logits = F.linear(hidden_states.to(weight.dtype), weight)                     # [T, E]
        return logits.topk(record.layer.top_k, dim=-1).indices


class _PendingGuess:
    """Expert counts [E] on their way to pinned host memory (`_score_later`), ranked once the copy has landed."""

    def __init__(self, host: torch.Tensor, copied: torch.cuda.Event):
        self.host, self.copied = host, copied

    def ranked(self) -> list[int] | None:
        """The guessed experts, most-routed first; None while the copy is still on its way. It has landed by now
        (this layer's routing synchronized the stream behind it), so the check is a query, not a wait: waiting on
        an event is a host sync of its own."""
        if not self.copied.query():
            return None
        return _ranked(self.host)


def count_experts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many times each expert appears in `indices` (ids in [0, num_experts)), as [E] int64 on their device.
    Not `torch.bincount`: on CUDA it reads the indices' max and min on the host, two syncs per call.

    Example:
        >>> count_experts(torch.tensor([[3, 1], [3, 0]]), 4).tolist()
        [1, 1, 0, 2]
    """
    flat = indices.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


def rank_experts(indices: torch.Tensor, num_experts: int) -> list[int]:
    """The experts named in `indices` [T, k], most-routed first (ties by expert id).

    Example:
        >>> rank_experts(torch.tensor([[3, 1], [3, 0]]), 4)
        [3, 0, 1]
    """
    return _ranked(count_experts(indices, num_experts).cpu())                   # one host sync


def _ranked(counts: torch.Tensor) -> list[int]:
    """The experts of host `counts` [E] that are above zero, most first (ties by expert id). As Python lists: an
    element of a tensor costs microseconds to index, which at hundreds of experts per layer call adds up."""
    order = torch.argsort(counts, descending=True, stable=True).tolist()
    count = counts.tolist()
    return [e for e in order if count[e] > 0]
