"""Counters of what moved and what hit, overall and per MoE layer.

- `bytes_to_device`: demand misses plus prefetches, each one expert slab;
- `stall_s`: how long compute waited for experts to arrive: host time on the CPU; on a GPU, the compute stream's
  own waits, timed by CUDA events (the host does not block there);
- `cpu_computed` / `cpu_compute_s` / `cpu_bytes_read` (`expert_compute`): experts computed on the CPU instead of
  copied, their CPU time, and the disk bytes read into host buffers for them (`hits + misses + cpu_computed ==
  experts_used`, except after a call that raised mid-layer: all its layer's experts counted as used, not all looked
  up; `hit_rate` is hits over all three); with "auto" also the decision's measured inputs
  (`h2d_bytes_per_s`, `host_bytes_per_s`, `cpu_flops`, `cpu_expert_s` per token bucket);
- `disk_reads` (experts read from files at every miss): "direct" when the reads bypass the page cache (policy
  `disk_reads`), else "buffered";
- `embedding`: "mapped" when the input embedding table is read in place from the checkpoint's file (policy
  `embedding`), else "memory";
- `prepacked_bytes`: host memory held by prepacked oneDNN copies of bfloat16 weights computed on the CPU (experts
  and the model's own linear layers, `memory.cpu_kernels`); a CPU store served in place on the CPU holds its experts
  only as these copies;
- `dense_in_file_bytes`: the model's own linear weights left in the checkpoint's file, their packed copies (in
  `prepacked_bytes`) their only memory (`loading.mapped_dense`);
- `prefetch_issued` / `_hits` / `_wasted`: speculative loads (a prefetcher's or the streaming read-ahead's), those
  the router then used, those evicted unused; `readahead_issued`: the read-ahead's share of `prefetch_issued`;
  `prefetch_promoted`: used ones still being read when their layer asked, whose rest was read as a demand read;
- `repeat_reads`: experts read more than once within one forward pass;
- `lookahead_guesses` / `lookahead_used`: router look-ahead guesses of a later layer's experts that were not resident
  (what a read-ahead would read) and those its router then chose, counted in on-demand passes whether or not they
  were read; `lookahead_on`: whether on-demand passes read the guesses ahead now (with `prefetch="auto"`: while
  `lookahead_precision` (recent used / guessed) is above `lookahead_break_even` and the payoff trial's verdict is not
  "off"; `runtime.lookahead_gate`);
  `lookahead_exposure`: the measured share of a demand read that compute waited for (what a right guess can hide);
  `lookahead_trial`: whether reading ahead, once the precision allows it, measurably lowered the stall per pass
  (alternating blocks of passes with reads off and on: verdict "trial", "on" or "off", and both mean stalls);
- `per_layer[i]["expert_calls"]`: per expert of layer i, the layer calls that routed at least one token to it (which
  experts are hot; differences between two snapshots give the experts a step touched);
- `micro_batches`: decoder-layer calls run as micro-batches (`split`) or, with `micro_batches` > 1 in the policy,
  as one whole batch (`whole`: a single sequence, training, recorded outputs, a cache that cannot be split);
- `forward_calls`: calls of the model's forward (one per generate step, also when split into micro-batches; an
  encoder-decoder's encoder, run apart by generate, is not one);
- `passes` / `last_schedule`: forward passes per schedule ("on_demand" or "stream", chosen per pass by its shape);
  `last_stream_window`: the stream window of the last streamed pass (policy `stream_window`);
  `measured`: per schedule, the passes timed (first MoE layer's start to the last one's end), seconds per pass and
  tokens per second: what `hf-moe-offload plan` predicts, measured;
- `devices` (a device_map spanning several devices, `devices.py`): per cache device, its MoE layers, the counters
  summed over them, and its cache's own `resident_bytes`, `peak_cache_bytes` and `cache_capacity_bytes` (the
  top-level figures are the sums; the top-level peak is the peak of the sum).

`print(snapshot)` shows these grouped, a few per line; the snapshot is still the plain mapping underneath.

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
             "prefetch_issued", "prefetch_hits", "prefetch_wasted", "prefetch_promoted", "readahead_issued",
             "repeat_reads",
             "lookahead_guesses", "lookahead_used")


class StatsSnapshot(dict):
    """A plain mapping of the counters at one moment, with `reset()` to zero the live counters; `str()` (and so
    `print`) gives a grouped summary, `repr()` and `json.dumps` the mapping itself."""

    def __init__(self, data: dict, reset: Callable[[], None]):
        super().__init__(data)
        self._reset = reset

    def reset(self) -> None:
        self._reset()

    def __str__(self) -> str:
        return format_snapshot(self)


def format_snapshot(data: dict) -> str:
    """A snapshot as lines grouped by what they are about: the cache, timings, prefetch and look-ahead, each MoE
    layer, the devices, the auto plan, then any key not shown above (a hook's counters) as it is.

    Example:
        >>> print(format_snapshot({"hits": 3, "misses": 1, "hit_rate": 0.75}).splitlines()[2])
          hits 3, misses 1, hit rate 75.0%
    """
    lines = ["hf_moe_offload stats"]
    for title, group in (("cache", _cache_lines), ("timings", _timing_lines),
                         ("prefetch and look-ahead", _prefetch_lines), ("per layer", _layer_lines),
                         ("devices", _device_lines), ("plan", _plan_lines), ("other", _other_lines)):
        body = group(data)
        if body:
            lines += [title] + ["  " + line for line in body]
    return "\n".join(lines)


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"     # not reached


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if abs(s) < 1 else f"{s:.2f} s"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _cache_lines(d: dict) -> list[str]:
    if "hits" not in d:
        return []
    lines = [f"hits {d.get('hits', 0)}, misses {d.get('misses', 0)}, hit rate {d.get('hit_rate', 0.0):.1%}"]
    if d.get("cpu_computed"):
        lines.append(f"computed on the CPU {d['cpu_computed']} ({_bytes(d.get('cpu_bytes_read', 0))} read for them)")
    if "evictions" in d:
        lines.append(f"evictions {d['evictions']}, repeat reads in a pass {d.get('repeat_reads', 0)}")
    if "bytes_to_device" in d:
        lines.append(f"to device {_bytes(d['bytes_to_device'])}; cache holds {_bytes(d.get('resident_bytes'))}, "
                     f"peak {_bytes(d.get('peak_cache_bytes'))} of {_bytes(d.get('cache_capacity_bytes'))}")
    return lines


def _timing_lines(d: dict) -> list[str]:
    lines = []
    if "stall_s" in d:
        lines.append(f"stall waiting for experts {_seconds(d['stall_s'])}"
                     + (f"; CPU expert compute {_seconds(d['cpu_compute_s'])}" if d.get("cpu_compute_s") else ""))
    if d.get("passes"):
        passes = ", ".join(f"{name} {n}" for name, n in d["passes"].items())
        window = f", last stream window {d['last_stream_window']}" if d.get("last_stream_window") else ""
        lines.append(f"passes: {passes} (last {d.get('last_schedule')}{window}); forward calls "
                     f"{d.get('forward_calls', 0)}")
    for schedule, m in (d.get("measured") or {}).items():
        lines.append(f"measured {schedule}: {m['passes_timed']} passes, {_seconds(m['seconds_per_pass'])} per "
                     f"pass, {m['tokens_per_s']:.1f} tok/s")
    micro = d.get("micro_batches") or {}
    if any(micro.values()):
        lines.append(f"micro-batched layer calls: {micro.get('split', 0)} split, {micro.get('whole', 0)} whole")
    return lines


def _prefetch_lines(d: dict) -> list[str]:
    lines = []
    if "prefetch_issued" in d:
        lines.append(f"prefetched {d['prefetch_issued']} (read-ahead {d.get('readahead_issued', 0)}): "
                     f"{d.get('prefetch_hits', 0)} used ({d.get('prefetch_promoted', 0)} still being read), "
                     f"{d.get('prefetch_wasted', 0)} evicted unused")
    if "lookahead_on" in d:
        lines.append(f"look-ahead reading {'on' if d['lookahead_on'] else 'off'}: {d.get('lookahead_used', 0)} "
                     f"of {d.get('lookahead_guesses', 0)} guesses right, precision "
                     f"{_share(d.get('lookahead_precision'))} (break-even {_share(d.get('lookahead_break_even'))}), "
                     f"exposure {_share(d.get('lookahead_exposure'))}")
    trial = d.get("lookahead_trial")
    if trial:
        lines.append(f"look-ahead trial: {trial.get('verdict')} (stall per pass reading off "
                     f"{_seconds(trial.get('stall_per_pass_off'))}, on {_seconds(trial.get('stall_per_pass_on'))})")
    return lines


def _layer_lines(d: dict) -> list[str]:
    lines = []
    for i, layer in enumerate(d.get("per_layer") or []):
        hits, misses = layer.get("hits", 0), layer.get("misses", 0)
        lookups = hits + misses + layer.get("cpu_computed", 0)
        calls = layer.get("expert_calls") or []
        hot = sorted((e for e in range(len(calls)) if calls[e]), key=lambda e: -calls[e])[:3]
        line = f"{i}: hits {hits}, misses {misses}"
        if lookups:
            line += f" ({hits / lookups:.0%} hit)"
        line += f", stall {_seconds(layer.get('stall_s', 0))}, to device {_bytes(layer.get('bytes_to_device', 0))}"
        lines.append(line + (f", most called experts {hot}" if hot else ""))
    return lines


def _device_lines(d: dict) -> list[str]:
    return [f"{device} (layers {dev.get('layers')}): hits {dev.get('hits', 0)}, misses {dev.get('misses', 0)}, "
            f"to device {_bytes(dev.get('bytes_to_device', 0))}, cache holds {_bytes(dev.get('resident_bytes'))}, "
            f"peak {_bytes(dev.get('peak_cache_bytes'))} of {_bytes(dev.get('cache_capacity_bytes'))}"
            for device, dev in (d.get("devices") or {}).items()]


def _plan_lines(d: dict) -> list[str]:
    plan = d.get("plan")
    if not plan:
        return []
    lines = []
    if "predicted_tok_s" in plan:
        lines.append(f"predicted {plan['predicted_tok_s']:.1f} tok/s (prefill "
                     f"{plan.get('predicted_prefill_tok_s', 0):.1f}, decode "
                     f"{plan.get('predicted_decode_tok_s', 0):.1f}), bound by {plan.get('binding')}; schedule "
                     f"{plan.get('schedule')}")
    if "profile" in plan:
        lines.append(f"profile {plan['profile']} ({plan.get('profile_source')})")
    shown = {"predicted_tok_s", "predicted_prefill_tok_s", "predicted_decode_tok_s", "binding", "schedule",
             "profile", "profile_source"}
    return lines + [f"{key}: {_value(value)}" for key, value in plan.items() if key not in shown]


# Keys the groups above show; any other (a hook's counters, expert_compute="auto"'s inputs) goes under "other".
_SHOWN = {"hits", "misses", "hit_rate", "experts_used", "cpu_computed", "cpu_bytes_read", "evictions",
          "repeat_reads", "bytes_to_device", "resident_bytes", "peak_cache_bytes", "cache_capacity_bytes", "stall_s",
          "cpu_compute_s", "passes", "last_schedule", "last_stream_window", "forward_calls", "measured",
          "micro_batches",
          "prefetch_issued", "readahead_issued", "prefetch_hits", "prefetch_wasted", "prefetch_promoted",
          "lookahead_on",
          "lookahead_used", "lookahead_guesses", "lookahead_precision", "lookahead_break_even",
          "lookahead_exposure", "lookahead_trial", "per_layer", "devices", "plan"}


def _value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _other_lines(d: dict) -> list[str]:
    return [f"{key}: {_value(value)}" for key, value in d.items() if key not in _SHOWN]


class OffloadStats:
    """Live counters, updated by the cache and the copy engine (thread-safe)."""

    def __init__(self, num_layers: int, capacity_bytes: int = 0):
        self.num_layers = num_layers
        self.capacity_bytes = capacity_bytes   # set by the cache from its slots
        self._lock = threading.Lock()
        self.placement: Callable[[], dict] | None = None   # expert_compute="auto": its measured inputs
        self.prepacked: list = []                      # `cpu_kernels.PrepackedWeights` registrations (experts, own layers)
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
            self.last_stream_window: int | None = None
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

    def record_prefetch_promoted(self, layer: int) -> None:
        """A used speculative load still being read when its layer asked: the rest was read as a demand read."""
        with self._lock:
            self.layer["prefetch_promoted"][layer] += 1

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

    def record_pass(self, schedule: str, window: int | None = None) -> None:
        """A pass started with `schedule` (a streamed one with its stream `window`)."""
        with self._lock:
            self.passes[schedule] = self.passes.get(schedule, 0) + 1
            self.last_schedule = schedule
            if schedule == "stream":
                self.last_stream_window = window

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

    def record_model_forward(self) -> None:
        """A call of the model's own forward (a generate step; an encoder-decoder's encoder runs apart)."""
        with self._lock:
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
                "last_stream_window": self.last_stream_window,
                "micro_batches": dict(self.micro_batches),
                "resident_bytes": self.resident_bytes,
                "peak_cache_bytes": self.peak_cache_bytes,
                "cache_capacity_bytes": self.capacity_bytes,
                "prepacked_bytes": sum(p.packed_bytes for p in self.prepacked),
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
