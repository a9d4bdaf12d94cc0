"""A user's `device_map` / `max_memory` next to `offload_policy`: where the non-expert part goes, which device
each MoE layer's expert cache lives on, and each device's share of the cache budget (`plan_devices`). The runtime
side, one `ExpertCache` per device behind one face, is `memory.cache_group`.

- A string map ("auto", "balanced", "balanced_low_0", "sequential") is computed by accelerate
  (`get_balanced_memory` / `get_max_memory`, then `infer_auto_device_map`) on the meta skeleton with the experts'
  parameters stripped (they are not placed: the policy's store holds them), with each device's expert-cache share
  taken off its `max_memory`. A dict is the user's placement; experts modules always load as "meta".
- A layer's cache lives on the device of the map entry that covers its experts module: the decoder layer's entry
  (its attention and router), or an entry naming the experts module itself.
- Every module computes where it lives: with more than one device, accelerate's `AlignDevicesHook`s move the
  activations between blocks (a "cpu" entry computes on the CPU; accelerate's weight streaming of "cpu" entries to
  the GPU is not used, and "disk" entries are refused: the policy's store is the offload for experts).
- Budget: `expert_cache` is the total; it is split over the devices that hold MoE layers in proportion to the
  user's `max_memory` for them, else to each device's free memory (equal shares for stand-ins of one device), and
  each share is capped at its layers' expert bytes. `expert_cache="auto"` is each device's own auto budget
  (`max_memory` or free memory, less the non-expert bytes placed there and the headroom), summed. A CPU device
  with experts in host memory uses them in place and takes no share.

Test seam: `stand_in_devices("dev0", "dev1")` declares logical devices backed by the CPU, so that a CPU-only
machine runs two caches with their own budgets and copy engines from a dict map that names them.

Example:
    >>> with stand_in_devices("dev0", "dev1"):                                        # doctest: +SKIP
    ...     model = AutoModelForCausalLM.from_pretrained(path, device_map={"": "dev0", "model.layers.1": "dev1"},
    ...                                                  offload_policy={"store": "disk", "expert_cache": "50%"})
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Iterator, Sequence

import torch
from accelerate.utils import get_balanced_memory, get_max_memory, infer_auto_device_map
from torch import nn

from ..layout import MoELayer
from ..memory.cache_group import DevicePlan
from ..policy.offload_policy import (AUTO, OffloadPolicy, PolicyError, SizeField, format_bytes, normalize_device,
                                     parse_size)
from .footprint import Footprint, auto_device, free_bytes, headroom_bytes, workload
from .resolve import ResolvedPolicy, check_placement, resolve, resolve_micro_batches

logger = logging.getLogger(__name__)

STRING_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
ALLOWED_MAPS = (f"allowed: one of {list(STRING_MAPS)}, a dict {{module name: device}}, or one device "
                f"('cpu', 'cuda:N', an int N)")

_stand_ins: dict[str, torch.device] = {}
_stand_in_lock = threading.Lock()


@contextlib.contextmanager
def stand_in_devices(*names: str, backing: str | torch.device = "cpu") -> Iterator[None]:
    """Declare logical devices `names`, all backed by `backing`, for loads inside the block (a test seam: a
    CPU-only machine gets several caches, each with its own budget and copy engine, from a dict map naming them).

    Example:
        >>> with stand_in_devices("dev0", "dev1"):
        ...     physical_device("dev1")
        device(type='cpu')
    """
    physical = torch.device(backing)
    with _stand_in_lock:
        for name in names:
            if _is_device_string(name) or name in ("disk", "meta"):
                raise ValueError(f"stand-in device {name!r} is a real device name; use another name (e.g. 'dev1')")
            if name in _stand_ins:
                raise ValueError(f"stand-in device {name!r} is declared already")
        _stand_ins.update(dict.fromkeys(names, physical))
    try:
        yield
    finally:
        with _stand_in_lock:
            for name in names:
                _stand_ins.pop(name, None)


def _is_device_string(name: str) -> bool:
    try:
        torch.device(name)
        return True
    except (RuntimeError, TypeError):
        return False


def physical_device(name: str) -> torch.device:
    """The torch device behind a logical device name (itself, unless it is a declared stand-in)."""
    with _stand_in_lock:
        if name in _stand_ins:
            return _stand_ins[name]
    return torch.device(name)


def _logical_name(value: Any, where: str) -> str:
    """A device map or max_memory value as a logical device name ("cpu", "cuda:N", a stand-in), checked."""
    with _stand_in_lock:
        stand_ins = sorted(_stand_ins)
    if isinstance(value, str) and value in stand_ins:
        return value
    allowed = "'cpu', 'cuda:N' or an int N" + (f", or a stand-in device {stand_ins}" if stand_ins else "")
    if value == "disk":
        raise PolicyError(f"{where} places modules on 'disk': with offload_policy the policy's store is the offload "
                          f"for experts, and offloading non-expert modules to disk is not supported; allowed: "
                          f"{allowed} (use store='disk' for the experts)")
    if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
        raise PolicyError(f"{where} has device {value!r}; allowed: {allowed}")
    try:
        return str(normalize_device(value))
    except PolicyError as err:
        raise PolicyError(f"{where} has device {value!r}, which is not a device of this machine; allowed: "
                          f"{allowed} ({err})") from None


def plan_devices(skeleton: nn.Module, layers: Sequence[MoELayer], device_map: Any, max_memory: Any,
                 policy: OffloadPolicy, fp: Footprint, dtype: torch.dtype) -> tuple[DevicePlan, ResolvedPolicy]:
    """Validate `device_map` / `max_memory`, place the non-expert part and split the cache budget; raises a
    `PolicyError` before anything is allocated. Strips the experts' parameters off `skeleton` (a meta model).

    Example:
        >>> plan, resolved = plan_devices(skeleton, layers, "auto", {"cpu": "2GiB"}, policy, fp,
        ...                               torch.float32)                                     # doctest: +SKIP
    """
    limits = _parse_max_memory(max_memory)
    default = str(normalize_device(policy.device)) if policy.device != AUTO else str(auto_device())
    expert_names = [lay.name for lay in layers]
    for name in expert_names:                 # not placed by accelerate: the store holds them
        for module in skeleton.get_submodule(name).modules():
            for pname in list(module._parameters):
                module._parameters[pname] = None
    if isinstance(device_map, str) and device_map in STRING_MAPS:
        logical_map = _accelerate_map(skeleton, device_map, limits, layers, policy, fp, dtype)
    elif isinstance(device_map, Mapping):
        logical_map = _user_map(skeleton, device_map)
    elif isinstance(device_map, (int, torch.device)) or isinstance(device_map, str):
        if isinstance(device_map, str) and not _is_device_string(device_map) and device_map not in _stand_ins:
            raise PolicyError(f"device_map={device_map!r} is not allowed; {ALLOWED_MAPS}")
        logical_map = {"": _logical_name(device_map, "device_map")}
    else:
        raise PolicyError(f"device_map={device_map!r} is not allowed; {ALLOWED_MAPS}")
    for key in limits:
        if key not in logical_map.values() and key != "cpu":
            logger.info("hf_moe_offload: max_memory names %s, which holds nothing of this model", key)

    layer_devices = tuple(_covering(logical_map, lay.name, default) for lay in layers)
    physical = {d: physical_device(d) for d in {*logical_map.values(), *layer_devices, default}}
    cache_devices = list(dict.fromkeys(layer_devices))
    gpus = [d for d in cache_devices if physical[d].type != "cpu"]
    primary = physical[gpus[0]] if gpus else torch.device("cpu")
    if policy.resident_layers and len(cache_devices) > 1:
        raise PolicyError(f"resident_layers={policy.resident_layers} with MoE layers on several devices "
                          f"({', '.join(cache_devices)}) is not supported; allowed: resident_layers=0, or a "
                          f"device_map that puts every MoE layer on one device")
    resolved, budgets = _budgets(policy, fp, primary, layers, layer_devices, physical, limits, logical_map, skeleton,
                                 dtype, default)

    loaded_map = module_map(skeleton, expert_names,
                            lambda name: str(physical[_covering(logical_map, name, default)]))
    used = {_covering(logical_map, name, default) for name in loaded_map if name not in expert_names}
    prefixes = tuple(e + "." for e in expert_names)
    blocks = {name: str(physical[d]) for name, d in _split_containing(skeleton, logical_map).items()
              if name not in expert_names and not name.startswith(prefixes)}
    blocks[""] = str(physical[_covering(logical_map, "", default)])
    # Activations cross devices only between blocks: accelerate's hooks move them (not needed on one device).
    hook_map = blocks if len(used | set(layer_devices)) > 1 else None
    plan = DevicePlan(loaded_map, hook_map, layer_devices, physical, budgets, primary)
    logger.info("hf_moe_offload: device_map: MoE layers on %s; expert cache %s",
                ", ".join(f"{d} ({len(plan.layers_of(d))} layers)" for d in cache_devices),
                ", ".join(f"{d} {format_bytes(b)}" for d, b in budgets.items()))
    return plan, resolved


def _parse_max_memory(max_memory: Any) -> dict[str, int]:
    """max_memory {device: bytes or size string} with logical device names as keys."""
    if max_memory is None:
        return {}
    if not isinstance(max_memory, Mapping):
        raise PolicyError(f"max_memory={max_memory!r} is not allowed; allowed: a dict {{device: size}} such as "
                          f"{{0: '20GiB', 'cpu': '64GiB'}}")
    limits = {}
    for key, value in max_memory.items():
        name = _logical_name(key, "max_memory")
        limits[name] = parse_size(value, 0, SizeField(f"max_memory[{key!r}]", share_of=None, auto=False))
    return limits


def _accelerate_map(skeleton: nn.Module, kind: str, limits: Mapping[str, int], layers: Sequence[MoELayer],
                    policy: OffloadPolicy, fp: Footprint, dtype: torch.dtype) -> dict[str, str]:
    """accelerate's placement of the non-expert part, with each cache device's share taken off its memory."""

    no_split = list(getattr(skeleton, "_no_split_modules", None) or [])
    accel_memory = {(physical_device(k).index if physical_device(k).type == "cuda" else "cpu"): v
                    for k, v in limits.items()}

    def infer(reserve: dict[str, int]) -> dict[str, str]:
        if kind == "sequential":
            memory = get_max_memory(dict(accel_memory) if accel_memory else None)
        else:
            memory = get_balanced_memory(skeleton, max_memory=dict(accel_memory) if accel_memory else None,
                                         no_split_module_classes=no_split, dtype=dtype,
                                         low_zero=kind == "balanced_low_0")
        for key in list(memory):
            name = "cpu" if key == "cpu" else (f"cuda:{key}" if isinstance(key, int) else str(key))
            memory[key] = max(0, memory[key] - reserve.get(name, 0))
        placed = infer_auto_device_map(skeleton, max_memory=memory, no_split_module_classes=no_split, dtype=dtype)
        return {name: _logical_name(device, f"device_map={kind!r} (accelerate's placement)")
                for name, device in placed.items()}

    first = infer({})
    # Second pass: the devices that hold MoE layers keep room for their share of the cache.
    devices = [_covering(first, lay.name, "cpu") for lay in layers]
    shares = _split(_planned_total(policy, fp), _weights(dict.fromkeys(devices), limits))
    return infer({d: b for d, b in shares.items() if d != "cpu" or policy.store == "disk"}) if shares else first


def _planned_total(policy: OffloadPolicy, fp: Footprint) -> int:
    """The budget to reserve room for: the given one (a share of all expert bytes, bytes), else none ("auto" takes
    what is left after placement)."""
    if policy.expert_cache == AUTO:
        return 0
    return min(parse_size(policy.expert_cache, total=fp.expert_bytes), fp.expert_bytes)


def _user_map(skeleton: nn.Module, device_map: Mapping) -> dict[str, str]:
    names = {name for name, _ in skeleton.named_modules()}
    names |= {name for name, _ in skeleton.named_parameters()} | {name for name, _ in skeleton.named_buffers()}
    logical = {}
    for key, value in device_map.items():
        if not isinstance(key, str) or (key and key not in names):
            example = next((n for n, _ in skeleton.named_children()), "model")
            raise PolicyError(f"device_map names {key!r}, which is not a module of this model; allowed: module names "
                              f"such as {example!r}, or '' for the whole model")
        logical[key] = _logical_name(value, f"device_map[{key!r}]")
    return logical


def _split_containing(skeleton: nn.Module, logical_map: Mapping[str, str]) -> dict[str, str]:
    """`logical_map` with every entry that contains an entry for another device replaced by its children, down to
    that entry. accelerate's hooks move a block's inputs only for the blocks named in their map, so with
    {"": "cuda:0", "model.layers.1": "cpu"} the final norm, after the CPU layer, needs an entry of its own.

    Example:
        >>> _split_containing(model, {"": "cuda:0", "model.layers.1": "cpu"})               # doctest: +SKIP
        {'lm_head': 'cuda:0', 'model.embed_tokens': 'cuda:0', 'model.layers.0': 'cuda:0', 'model.layers.1': 'cpu',
         'model.norm': 'cuda:0', 'model.rotary_emb': 'cuda:0'}
    """
    split = dict(logical_map)
    while True:
        outer = next((key for key in sorted(split, key=len) if any(
            other != key and (key == "" or other.startswith(key + ".")) and split[other] != split[key]
            for other in split)), None)
        if outer is None:
            return split
        device = split.pop(outer)
        for child, _ in skeleton.get_submodule(outer).named_children():
            split.setdefault(f"{outer}.{child}" if outer else child, device)   # deeper entries keep their device


def _covering(logical_map: Mapping[str, str], name: str, default: str) -> str:
    """The device of the longest map entry that is `name` or a module containing it."""
    best, best_len = default, -1
    for key, device in logical_map.items():
        if (key == "" or name == key or name.startswith(key + ".")) and len(key) > best_len:
            best, best_len = device, len(key)
    return best


def module_map(skeleton: nn.Module, expert_names: Sequence[str], device_of: Callable[[str], str]) -> dict[str, str]:
    """What transformers loads with: every module that owns tensors -> `device_of(its name)`, every experts module
    -> "meta" (not loaded: the store holds the experts)."""
    placed: dict[str, str] = {}
    prefixes = tuple(e + "." for e in expert_names)
    for name, module in skeleton.named_modules():
        if name in expert_names or name.startswith(prefixes):
            continue
        owns = any(t is not None for t in module._parameters.values()) or any(
            t is not None for t in module._buffers.values())
        if owns:
            placed[name] = device_of(name)
    placed.update(dict.fromkeys(expert_names, "meta"))
    return placed


def _weights(devices: Iterable[str], limits: Mapping[str, int]) -> dict[str, int]:
    """How much of the budget each device takes: the user's max_memory for it, else its free memory, read once per
    physical device (stand-ins of one device get equal shares, not two readings of a memory that moves)."""
    free: dict[torch.device, int] = {}
    weights = {}
    for device in devices:
        if device in limits:
            weights[device] = limits[device]
            continue
        physical = physical_device(device)
        if physical not in free:
            free[physical] = max(1, free_bytes(physical))
        weights[device] = free[physical]
    return weights


def _split(total: int, weights: Mapping[str, int]) -> dict[str, int]:
    """`total` bytes over `weights`, rounded down (integers: exact for any size)."""
    whole = sum(weights.values())
    return {d: total * w // whole for d, w in weights.items()} if whole else {}


def _budgets(policy: OffloadPolicy, fp: Footprint, primary: torch.device, layers: Sequence[MoELayer],
             layer_devices: Sequence[str], physical: Mapping[str, torch.device], limits: Mapping[str, int],
             logical_map: Mapping[str, str], skeleton: nn.Module, dtype: torch.dtype,
             default: str) -> tuple[ResolvedPolicy, dict[str, int]]:
    """Resolve the policy for `primary` and give each cache device its share of the budget, checked."""
    # attention="auto" keeps attention on the devices of the map: CPU attention next to a device map is the
    # user's explicit choice (attention="cpu"), its host KV cache is not split by the map's budgets.
    attention = "device" if policy.attention == AUTO else policy.attention
    resolved = resolve(dataclasses.replace(policy, device=str(primary), attention=attention), fp)
    store = resolved.policy.store
    cache_devices = list(dict.fromkeys(layer_devices))
    in_place = {d for d in cache_devices if physical[d].type == "cpu" and store == "cpu"}   # zero-copy: no share
    slotted = [d for d in cache_devices if d not in in_place]
    experts_on = {d: sum(lay.num_experts for lay, ld in zip(layers, layer_devices) if ld == d) * fp.slab_bytes
                  for d in cache_devices}
    placed = _placed_bytes(skeleton, logical_map, dtype, default)
    budgets = dict.fromkeys(in_place, 0)
    if not slotted:
        return resolved, budgets
    if policy.expert_cache == AUTO:
        batch, seq_len = workload(resolved.policy, fp)
        for d in slotted:
            free = limits.get(d, free_bytes(physical[d]))
            budgets[d] = max(0, free - placed.get(d, 0) - headroom_bytes(physical[d], fp, batch, seq_len))
        total = sum(budgets[d] for d in slotted)
        # expert_compute="cpu" copies only the resident layers: the cache is capped to them, as without a map.
        capped = check_placement(resolved.policy, fp.layer_experts, fp.slab_bytes, fp.top_k, total, False)
        if capped < total:
            budgets.update(_split(capped, {d: max(1, budgets[d]) for d in slotted}))
            total = sum(budgets[d] for d in slotted)
        resolved = dataclasses.replace(resolved, cache_bytes=total,
                                       policy=dataclasses.replace(resolved.policy, expert_cache=total))
    else:
        weights = _weights(slotted, limits)
        budgets.update(_split(resolved.cache_bytes, weights))
        _check_shares(policy, fp, resolved.cache_bytes, weights, budgets)
    for d in slotted:
        budgets[d] = min(budgets[d], experts_on[d])
        if d in limits and budgets[d] + placed.get(d, 0) > limits[d]:
            room = max(0, limits[d] - placed.get(d, 0))
            raise PolicyError(f"the expert cache's share on {d} ({format_bytes(budgets[d])}) does not fit "
                              f"max_memory[{d!r}]={format_bytes(limits[d])} next to the "
                              f"{format_bytes(placed.get(d, 0))} of non-expert weights placed there; use a smaller "
                              f"expert_cache (at most {format_bytes(room)} on {d}) or raise max_memory")
    if policy.expert_cache == AUTO:
        _check_shares(policy, fp, sum(budgets[d] for d in slotted), {d: 1 for d in slotted}, budgets, auto=True)
    for d in slotted:     # micro-batches pin a layer's experts in the cache of that layer's device
        resolve_micro_batches(resolved.policy, fp, store, budgets[d], False, where=f" (its share on {d})")
    return resolved, budgets


def _check_shares(policy: OffloadPolicy, fp: Footprint, total: int, weights: Mapping[str, int],
                  budgets: Mapping[str, int], auto: bool = False) -> None:
    """Every device's share holds one layer's top-k working set (none needed with expert_compute="cpu")."""
    if policy.expert_compute == "cpu":
        return
    need = fp.min_cache_bytes
    short = {d: budgets[d] for d in weights if budgets[d] < need}
    if not short:
        return
    whole = sum(weights.values())
    smallest = max(-(-need * whole // w) for w in weights.values())
    shares = ", ".join(f"{d} {format_bytes(b)}" for d, b in budgets.items())
    if auto:
        raise PolicyError(f"expert_cache='auto' leaves {', '.join(short)} less than one layer's top-k working set "
                          f"(top_k={fp.top_k} x {format_bytes(fp.slab_bytes)} = {format_bytes(need)}; shares: "
                          f"{shares}); raise max_memory there or put fewer modules on it")
    raise PolicyError(f"expert_cache={format_bytes(total)} split over the devices holding MoE layers ({shares}) "
                      f"leaves {', '.join(short)} less than one layer's top-k working set (top_k={fp.top_k} x "
                      f"{format_bytes(fp.slab_bytes)} = {format_bytes(need)}); use at least expert_cache={smallest}")


def _placed_bytes(skeleton: nn.Module, logical_map: Mapping[str, str], dtype: torch.dtype,
                  default: str) -> dict[str, int]:
    """Non-expert bytes each logical device gets (the experts' parameters are stripped off the skeleton)."""
    placed: dict[str, int] = {}
    for name, p in skeleton.named_parameters():
        d = _covering(logical_map, name, default)
        placed[d] = placed.get(d, 0) + p.numel() * dtype.itemsize
    return placed
