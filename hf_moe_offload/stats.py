"""Counters of what moved and what hit, overall and per MoE layer.

- `bytes_to_device`: demand misses plus prefetches, each one expert slab;
- `stall_s`: how long compute waited for experts to arrive: host time on the CPU; on a GPU, the compute stream's
  own waits, timed by CUDA events (the host does not block there);
- `cpu_computed` / `cpu_compute_s` / `cpu_bytes_read` (`expert_compute`): experts computed on the CPU instead of
  copied, their CPU time, and the disk bytes read into host buffers for them (`hits + misses + cpu_computed ==
  experts_used`; `hit_rate` is hits over all three); with "auto" also the decision's measured inputs
  (`h2d_bytes_per_s`, `host_bytes_per_s`, `cpu_flops`, `cpu_expert_s` per token bucket);
- `prefetch_issued` / `_hits` / `_wasted`: speculative loads (a prefetcher's or the streaming read-ahead's), those
  the router then used, those evicted unused; `readahead_issued`: the read-ahead's share of `prefetch_issued`;
- `repeat_reads`: experts read more than once within one forward pass;
- `lookahead_guesses` / `lookahead_used`: router look-ahead guesses of a later layer's experts that were not resident
  (what a read-ahead would read) and those its router then chose, counted in on-demand passes whether or not they
  were read; `lookahead_on`, `lookahead_precision` (recent used / guessed) and `lookahead_break_even`: the state of
  `prefetch="auto"`'s rule (`runtime.lookahead_gate`), which reads ahead only while the precision is above the
  break-even;
  `lookahead_exposure`: the measured share of a demand read that compute waited for (what a right guess can hide);
  `lookahead_trial`: whether reading ahead, once the precision allows it, measurably lowered the stall per pass
  (alternating blocks of passes with reads off and on: verdict "trial", "on" or "off", and both mean stalls);
- `per_layer[i]["expert_calls"]`: per expert of layer i, the layer calls that routed at least one token to it (which
  experts are hot; differences between two snapshots give the experts a step touched);
- `micro_batches`: decoder-layer calls run as micro-batches (`split`) or, with `micro_batches` > 1 in the policy,
  as one whole batch (`whole`: a single sequence, training, recorded outputs, a cache that cannot be split);
- `passes` / `last_schedule`: forward passes per schedule ("on_demand" or "stream", chosen per pass by its shape);
  `measured`: per schedule, the passes timed (first MoE layer's start to the last one's end), seconds per pass and
  tokens per second: what `hf-moe-offload plan` predicts, measured;
- `devices` (a device_map spanning several devices, `devices.py`): per cache device, its MoE layers, the counters
  summed over them, and its cache's own `resident_bytes`, `peak_cache_bytes` and `cache_capacity_bytes` (the
  top-level figures are the sums; the top-level peak is the peak of the sum).

Example:
    >>> s = OffloadStats(num_layers=2, capacity_bytes=1024)
    >>> s.record_miss(0, nbytes=256); s.record_hit(1)
    >>> snap = s.snapshot(); (snap["hits"], snap["misses"], snap["bytes_to_device"])
    (1, 1, 256)
    >>> snap.reset(); s.snapshot()["misses"]
    0
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

PER_LAYER = ("hits", "misses", "evictions", "bytes_to_device", "stall_s", "experts_used",
             "cpu_computed", "cpu_compute_s", "cpu_bytes_read",
             "prefetch_issued", "prefetch_hits", "prefetch_wasted", "readahead_issued", "repeat_reads",
             "lookahead_guesses", "lookahead_used")


class StatsSnapshot(dict):
    """A plain mapping of the counters at one moment, with `reset()` to zero the live counters."""

    def __init__(self, data: dict, reset: Callable[[], None]):
        super().__init__(data)
        self._reset = reset

    def reset(self) -> None:
        self._reset()


class OffloadStats:
    """Live counters, updated by the cache and the copy engine (thread-safe)."""

    def __init__(self, num_layers: int, capacity_bytes: int = 0):
        self.num_layers = num_layers
        self.capacity_bytes = capacity_bytes   # set by the cache from its slots
        self._lock = threading.Lock()
        self.placement: Callable[[], dict] | None = None   # expert_compute="auto": its measured inputs
        self.resident_bytes = 0
        self.devices: dict[str, list[int]] = {}     # cache device -> its MoE layers (several caches only)
        self._device_bytes: dict[str, list[int]] = {}   # cache device -> [resident, peak, capacity]
        # The look-ahead rule's state is the engine's, not a counter: reset() leaves it.
        self.lookahead_on = False
        self.lookahead_precision: float | None = None
        self.lookahead_break_even: float | None = None
        self.lookahead_exposure: float | None = None   # measured share of a demand read exposed as a stall
        self.lookahead_trial: dict | None = None       # the payoff trial's verdict and stalls (`PayoffTrial`)
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.layer = {name: [0] * self.num_layers for name in PER_LAYER}
            self.expert_calls: list[list[int]] = [[] for _ in range(self.num_layers)]   # grown on first use
            self.forward_calls = 0
            self.passes: dict[str, int] = {}     # forward passes per schedule ("on_demand", "stream")
            self.pass_time: dict[str, list] = {}  # schedule -> [passes timed, tokens, seconds] (first to last MoE layer)
            self.last_schedule: str | None = None
            self.micro_batches = {"split": 0, "whole": 0}   # micro-batched decoder-layer calls, and whole ones
            self.peak_cache_bytes = self.resident_bytes   # the peak from now on starts at what is resident
            for entry in self._device_bytes.values():
                entry[1] = entry[0]

    def record_hit(self, layer: int) -> None:
        with self._lock:
            self.layer["hits"][layer] += 1

    def record_miss(self, layer: int, nbytes: int) -> None:
        with self._lock:
            self.layer["misses"][layer] += 1
            self.layer["bytes_to_device"][layer] += nbytes

    def record_prefetch(self, layer: int, nbytes: int, readahead: bool = False) -> None:
        """A speculative load: a prefetcher's, or (`readahead`) the streaming schedule's look-ahead."""
        with self._lock:
            self.layer["prefetch_issued"][layer] += 1
            self.layer["readahead_issued"][layer] += readahead
            self.layer["bytes_to_device"][layer] += nbytes

    def record_prefetch_hit(self, layer: int) -> None:
        with self._lock:
            self.layer["prefetch_hits"][layer] += 1

    def record_prefetch_wasted(self, layer: int) -> None:
        with self._lock:
            self.layer["prefetch_wasted"][layer] += 1

    def record_repeat_read(self, layer: int) -> None:
        """An expert read a second time within one forward pass (streaming aims at zero)."""
        with self._lock:
            self.layer["repeat_reads"][layer] += 1

    def record_lookahead(self, layer: int, guessed: int, used: int) -> None:
        """`guessed` non-resident look-ahead guesses for `layer`, of which its router chose `used`."""
        with self._lock:
            self.layer["lookahead_guesses"][layer] += guessed
            self.layer["lookahead_used"][layer] += used

    def set_lookahead(self, on: bool, precision: float | None, break_even: float | None,
                      exposure: float | None = None) -> None:
        with self._lock:
            self.lookahead_on, self.lookahead_precision, self.lookahead_break_even = on, precision, break_even
            self.lookahead_exposure = exposure

    def record_pass_time(self, schedule: str, tokens: int, seconds: float) -> None:
        """A pass of `tokens` tokens took `seconds` from its first MoE layer's start to its last one's end (host
        clock): the measured side of a plan's predicted tokens/s (`hf-moe-offload plan`)."""
        with self._lock:
            timed = self.pass_time.setdefault(schedule, [0, 0, 0.0])
            timed[0] += 1
            timed[1] += tokens
            timed[2] += seconds

    def record_micro_batching(self, split: bool) -> None:
        with self._lock:
            self.micro_batches["split" if split else "whole"] += 1

    def record_pass(self, schedule: str) -> None:
        with self._lock:
            self.passes[schedule] = self.passes.get(schedule, 0) + 1
            self.last_schedule = schedule

    def record_eviction(self, layer: int) -> None:
        with self._lock:
            self.layer["evictions"][layer] += 1

    def record_stall(self, layer: int, seconds: float) -> None:
        with self._lock:
            self.layer["stall_s"][layer] += seconds

    def record_cpu_compute(self, layer: int, bytes_read: int) -> None:
        """An expert of `layer` computes on the CPU (`bytes_read`: read from disk into a host buffer for it)."""
        with self._lock:
            self.layer["cpu_computed"][layer] += 1
            self.layer["cpu_bytes_read"][layer] += bytes_read

    def record_cpu_time(self, layer: int, seconds: float) -> None:
        with self._lock:
            self.layer["cpu_compute_s"][layer] += seconds

    def record_forward(self, layer: int, experts: Sequence[int]) -> None:
        """A call of `layer` routed tokens to `experts` (distinct ids)."""
        with self._lock:
            self.layer["experts_used"][layer] += len(experts)
            calls = self.expert_calls[layer]
            if experts and max(experts) >= len(calls):
                calls.extend([0] * (max(experts) + 1 - len(calls)))
            for expert in experts:
                calls[expert] += 1
            if layer == 0:
                self.forward_calls += 1

    def set_resident(self, nbytes: int) -> None:
        with self._lock:
            self.resident_bytes = nbytes
            self.peak_cache_bytes = max(self.peak_cache_bytes, nbytes)

    def set_device_resident(self, device: str, nbytes: int) -> None:
        """One device's cache holds `nbytes` now; the totals are the sums over devices."""
        with self._lock:
            entry = self._device_bytes.setdefault(device, [0, 0, 0])
            entry[0], entry[1] = nbytes, max(entry[1], nbytes)
            self.resident_bytes = sum(e[0] for e in self._device_bytes.values())
            self.peak_cache_bytes = max(self.peak_cache_bytes, self.resident_bytes)

    def set_device_capacity(self, device: str, nbytes: int) -> None:
        with self._lock:
            self._device_bytes.setdefault(device, [0, 0, 0])[2] = nbytes
            self.capacity_bytes = sum(e[2] for e in self._device_bytes.values())

    def set_lookahead_trial(self, verdict: str, stall: dict, passes: dict) -> None:
        """The payoff trial of `prefetch="auto"`: its verdict and mean stall per pass with reads off / on."""
        with self._lock:
            self.lookahead_trial = {"verdict": verdict,
                                    "stall_per_pass_off": stall[False] / passes[False] if passes[False] else None,
                                    "stall_per_pass_on": stall[True] / passes[True] if passes[True] else None}

    def stall_and_misses(self) -> tuple[float, int]:
        """Total stall seconds and demand misses so far (what the look-ahead gate measures exposure from)."""
        with self._lock:
            return sum(self.layer["stall_s"]), sum(self.layer["misses"])

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            totals = {name: sum(values) for name, values in self.layer.items()}
            # An expert computed on the CPU was not on the device either: it counts against the hit rate.
            lookups = totals["hits"] + totals["misses"] + totals.get("cpu_computed", 0)
            data = {
                **totals,
                "hit_rate": totals["hits"] / lookups if lookups else 0.0,
                "forward_calls": self.forward_calls,
                "passes": dict(self.passes),
                "measured": {schedule: {"passes_timed": n, "seconds_per_pass": secs / n,
                                        "tokens_per_s": tokens / secs if secs > 0 else 0.0}
                             for schedule, (n, tokens, secs) in self.pass_time.items()},
                "last_schedule": self.last_schedule,
                "micro_batches": dict(self.micro_batches),
                "resident_bytes": self.resident_bytes,
                "peak_cache_bytes": self.peak_cache_bytes,
                "cache_capacity_bytes": self.capacity_bytes,
                "lookahead_on": self.lookahead_on,
                "lookahead_precision": self.lookahead_precision,
                "lookahead_break_even": self.lookahead_break_even,
                "lookahead_exposure": self.lookahead_exposure,
                "lookahead_trial": dict(self.lookahead_trial) if self.lookahead_trial else None,
                "per_layer": [{**{name: self.layer[name][i] for name in PER_LAYER},
                               "expert_calls": list(self.expert_calls[i])} for i in range(self.num_layers)],
            }
            if self.devices:
                data["devices"] = {device: self._device_snapshot(device, layers)
                                   for device, layers in self.devices.items()}
        if self.placement is not None:
            data.update(self.placement())
        return StatsSnapshot(data, self.reset)

    def _device_snapshot(self, device: str, layers: list[int]) -> dict:
        """One device's share of the counters (its layers' sums) and its own cache's bytes (under the lock)."""
        totals = {name: sum(self.layer[name][i] for i in layers) for name in PER_LAYER}
        lookups = totals["hits"] + totals["misses"] + totals["cpu_computed"]
        resident, peak, capacity = self._device_bytes.get(device, (0, 0, 0))
        return {"layers": list(layers), **totals, "hit_rate": totals["hits"] / lookups if lookups else 0.0,
                "resident_bytes": resident, "peak_cache_bytes": peak, "cache_capacity_bytes": capacity}


class DeviceStats:
    """What one device's cache writes into the shared `OffloadStats`: every counter goes there unchanged (they are
    per layer, and each layer has one cache); its resident bytes, peak and capacity are also kept per device.

    Example:
        >>> shared = OffloadStats(num_layers=2)
        >>> a, b = DeviceStats(shared, "dev0"), DeviceStats(shared, "dev1")
        >>> a.set_resident(100); b.set_resident(50); a.record_hit(0)
        >>> snap = shared.snapshot(); (snap["resident_bytes"], snap["hits"])
        (150, 1)
    """

    def __init__(self, shared: OffloadStats, device: str):
        self.__dict__["_shared"], self.__dict__["_device"] = shared, device

    def __getattr__(self, name: str):
        return getattr(self._shared, name)

    def set_resident(self, nbytes: int) -> None:
        self._shared.set_device_resident(self._device, nbytes)

    @property
    def capacity_bytes(self) -> int:
        return self._shared._device_bytes.get(self._device, (0, 0, 0))[2]

    @capacity_bytes.setter
    def capacity_bytes(self, nbytes: int) -> None:
        self._shared.set_device_capacity(self._device, nbytes)

    @property
    def placement(self):
        return self._shared.placement

    @placement.setter
    def placement(self, measurements) -> None:
        # expert_compute="auto": each device calibrates; the first one's measurements are shown.
        if self._shared.placement is None:
            self._shared.placement = measurements
