"""`OffloadEngine`: everything hf_moe_offload attaches to one model (store, cache, stats, hooks, per-layer
runtimes), listed in one place so that `detach()` can put the model back exactly as it was.

What the model keeps promising while offloaded:
- `state_dict()` (and so `save_pretrained` / `push_to_hub`) holds every expert, read back from the store;
- `.to(...)`, `.half()` and other dtype/device changes that would strand the experts are refused with a clear
  error instead of failing later;
- `detach()` reads every expert back before it changes anything: if a read fails, the model stays offloaded and
  usable.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ..arch import MoEArch
from ..hooks import HookHandle, LayerHook
from ..layout import RELEASED_ATTR, MoELayer, SlabLayout
from ..memory.cache import ExpertCache, fetch_landed
from ..memory.cache_group import CacheGroup, DevicePlan, build_cache_group
from ..policy.offload_policy import OffloadPolicy, PolicyError
from ..stats import OffloadStats, StatsSnapshot
from ..storage.store import ExpertStore
from . import microbatch
from .not_copyable import NotCopyable
from .pass_scheduler import PassScheduler

logger = logging.getLogger(__name__)

ENGINE_ATTR = "_hf_moe_offload_engine"


class LayerRuntime(NotCopyable):
    """What an offloaded experts forward calls: `fetch` the slabs of the experts its tokens were routed to."""

    def __init__(self, engine: "OffloadEngine", layer: MoELayer):
        self.engine, self.layer = engine, layer

    def fetch(self, experts: Sequence[int], hidden_states: torch.Tensor | None = None,
              tokens: Sequence[int] | None = None) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Yield (expert, named weight views on the device, or in host memory for an expert computed on the CPU),
        resident experts first; close it when done early. `hidden_states` [tokens, hidden] is the layer's input,
        shown to the hooks (read-ahead uses it); `tokens[i]`: rows routed to `experts[i]` (expert_compute="auto")."""
        on_pinned = self._announce(experts, hidden_states)
        layout = self.engine.store.layouts[self.layer.index]   # the store's: quantized slabs give `QuantizedWeight`s
        micro_batch = microbatch.current()
        hold = micro_batch is not None and not micro_batch.last   # later micro-batches of this layer reuse them
        for expert, slab in self.engine.cache.fetch(self.layer.index, experts, on_pinned, tokens, hold):
            yield expert, layout.views(slab)
        self._finish()

    def fetch_landed(self, experts: Sequence[int], hidden_states: torch.Tensor | None = None
                     ) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
        """For a layer whose experts have all landed in the cache's dense slots: yield once (each expert's slot,
        every slot's weights stacked by name, [slots, *shape]) for one grouped computation. Yields nothing, and
        records nothing, otherwise (an expert to load or compute on the CPU, quantized slabs, a micro-batch that
        holds its experts): then `fetch` serves the layer."""
        index = self.layer.index
        cache = self.engine.cache
        cache = cache.by_layer[index] if isinstance(cache, CacheGroup) else cache
        micro_batch = microbatch.current()
        if cache.zero_copy or (micro_batch is not None and not micro_batch.last):
            return
        stacked = self._stacked_slots(cache.memory)
        if stacked is None:
            return
        landed = False
        for slots, _ in fetch_landed(cache, index, experts, lambda: self._announce(experts, hidden_states)):
            landed = True
            yield slots, stacked
        if landed:
            self._finish()

    def _stacked_slots(self, memory: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """This layer's weights over every slot of the cache's `memory`, stacked by name (views), or None where the
        grouped kernels cannot read them: quantized slabs, no slots, or a weight that does not start 16-byte
        aligned at a 16-byte multiple stride. Made per call: views kept here would keep a closed cache's memory."""
        layout = self.engine.store.layouts[self.layer.index]
        if not isinstance(layout, SlabLayout) or memory.dim() != 2:
            return None
        stacked = layout.stacked_views(memory[:, :layout.numel])
        if any(w.data_ptr() % 16 or w.stride(0) * w.element_size() % 16 for w in stacked.values()):
            return None
        return stacked

    def _announce(self, experts: Sequence[int], hidden_states: torch.Tensor | None) -> Callable[[], None] | None:
        """Count the layer's forward and tell the hooks its input and route; the `on_pinned` callback to give the
        cache (None without hooks)."""
        index, hooks = self.layer.index, self.engine.hooks
        self.engine.stats.record_forward(index, experts)
        if hidden_states is not None:
            for hook in hooks:
                hook.before_experts(index, hidden_states)
        for hook in hooks:
            hook.on_route(index, experts)

        def on_pinned() -> None:
            for hook in hooks:
                hook.on_pinned(index)
        return on_pinned if hooks else None

    def _finish(self) -> None:
        for hook in self.engine.hooks:
            hook.on_layer_done(self.layer.index)


class OffloadEngine(NotCopyable):
    """Owns the offloading state of one model.

    Example:
        >>> engine = OffloadEngine.attach(model, policy, arch, layers, store, budget_bytes=2**30)  # doctest: +SKIP
        >>> engine.detach()                                                                          # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, policy: OffloadPolicy, arch: MoEArch, layers: list[MoELayer],
                 store: ExpertStore, cache: "ExpertCache | CacheGroup", stats: OffloadStats,
                 restore_device: torch.device, moved_resident_from: torch.device | None,
                 devices: "DevicePlan | None" = None):
        self.model, self.policy, self.arch, self.layers = model, policy, arch, layers
        self.store, self.cache, self.stats = store, cache, stats
        self.restore_device = restore_device            # where experts go back on detach
        self.devices = devices                          # several cache devices (a device_map), else None
        # Each layer's experts go back to its own device (the device_map's), else all to restore_device.
        self.restore_devices = [devices.physical[d] for d in devices.layer_devices] if devices is not None \
            else [restore_device] * len(layers)
        self.moved_resident_from = moved_resident_from  # where the non-expert part was before enable(), if moved
        self.runtimes = [LayerRuntime(self, layer) for layer in layers]
        self.hooks: list[LayerHook] = []
        self.prefetcher = None    # the HashPrefetcher hook when the policy names a predictor
        self.embedding = "memory"   # "mapped": the input embedding table read in place from its file
        self.dense_in_file_bytes = 0  # own dense weights left in the checkpoint's file, kept as packed copies
        self.plan: dict | None = None   # the auto plan's prediction (`stats()["plan"]`), set by whoever resolved it
        # ContinuousBatchingConfig fields fixed for generate_batch without a config; the rest sized for offloading.
        self.batching_overrides: dict[str, Any] = {}
        self._model_hooks: list = []
        self.on_detach: list[Callable[[], None]] = []   # clean-ups owned by whoever attached (e.g. a spill dir)
        self.detach_checks: list[Callable[[], None]] = []   # run before detach changes anything; may raise
        self.micro_batched: microbatch.MicroBatchedLayers | None = None   # policy.micro_batches > 1

    @classmethod
    def attach(cls, model: nn.Module, policy: OffloadPolicy, arch: MoEArch, layers: list[MoELayer],
               store: ExpertStore, budget_bytes: int, restore_device: torch.device | None = None,
               moved_resident_from: torch.device | None = None, devices: "DevicePlan | None" = None
               ) -> "OffloadEngine":
        """Release the experts' parameters, then allocate the cache (so a model whose experts sat on the device
        frees them first) and route the experts' forward through it. `devices` (a device_map over several
        devices): one cache per device with its own budget (`CacheGroup`); `budget_bytes` is then their
        sum."""
        device = torch.device(policy.device)
        restore_to = restore_device or device
        restore_each = [devices.physical[d] for d in devices.layer_devices] if devices is not None \
            else [restore_to] * len(layers)
        for layer in layers:
            arch.release_expert_params(layer.module)
        if device.type == "cuda" or any(d.type == "cuda" for d in restore_each):
            torch.cuda.empty_cache()              # the released experts' blocks, before the cache asks for its own
        stats = OffloadStats(num_layers=len(layers))
        store.read_directly(policy.disk_reads == "direct")
        try:
            if devices is not None:
                cache = build_cache_group(store, devices, policy, stats)
            else:
                cache = ExpertCache(store, device, budget_bytes, policy.eviction, stats, policy.expert_compute,
                                    policy.resident_layers)
        except BaseException:                     # e.g. out of device memory: give the experts back, unchanged
            _restore_after_failed_attach(arch, layers, store, restore_each)
            raise
        engine = cls(model, policy, arch, layers, store, cache, stats, restore_to, moved_resident_from, devices)
        if not cache.zero_copy:
            engine.add_hook(PassScheduler(engine))     # per-pass schedule: on demand, or streamed in forward order
        for layer, runtime in zip(layers, engine.runtimes):
            arch.attach(model, layer, runtime)
        if int(policy.micro_batches) > 1:         # resolved: "auto" is a number by now
            engine.micro_batched = microbatch.MicroBatchedLayers.attach(
                model, microbatch.decoder_layers(model, [layer.name for layer in layers]), int(policy.micro_batches),
                on_split=stats.record_micro_batching, on_end=cache.release_held)
        engine._guard_model()
        setattr(model, ENGINE_ATTR, engine)
        where = policy.device if devices is None else ", ".join(
            f"{d}: {len(devices.layers_of(d))} layers" for d in devices.cache_devices)
        logger.info("hf_moe_offload: %d MoE layers offloaded (device=%s, store=%s, %d cache slots%s)", len(layers),
                    where, policy.store, cache.num_slots, ", zero-copy" if cache.zero_copy else "")
        return engine

    # -- hooks and stats --------------------------------------------------------------------------------------------

    def add_hook(self, hook: LayerHook) -> HookHandle:
        """Call `hook` at every offloaded MoE layer (see `hf_moe_offload.hooks`); `handle.remove()` undoes it."""
        self.hooks.append(hook)
        return HookHandle(self.hooks, hook)

    def attach_prefetcher(self, prefetcher: LayerHook) -> None:
        """Add the policy's predictor hook; it stays reachable as `engine.prefetcher` (its stats, its tuning)."""
        self.prefetcher = prefetcher
        self.add_hook(prefetcher)

    def stats_snapshot(self) -> StatsSnapshot:
        """The cache's counters and every hook's (e.g. the predictor's timings); `reset()` zeroes them all."""
        self.cache.settle_stalls()
        data = dict(self.stats.snapshot())
        for hook in self.hooks:
            data.update(hook.stats())
        if not self.store.in_host_memory:     # experts read from files at every miss
            data["disk_reads"] = "direct" if self.store.reads_directly else "buffered"
        data["embedding"] = self.embedding
        data["dense_in_file_bytes"] = self.dense_in_file_bytes
        if self.plan is not None:   # the plan's predicted tok/s beside data["measured"]
            data["plan"] = dict(self.plan)
        return StatsSnapshot(data, self.reset_stats)

    def reset_stats(self) -> None:
        self.cache.settle_stalls()
        self.stats.reset()
        for hook in self.hooks:
            hook.reset_stats()

    # -- what the model promises while offloaded ----------------------------------------------------------------

    def _guard_model(self) -> None:
        """state_dict() with the experts; dtype/device changes refused (they would strand the experts)."""
        for layer in self.layers:
            in_tree = self.model.get_submodule(layer.name)
            handle = in_tree.register_state_dict_post_hook(self._experts_into_state_dict(layer))
            self._model_hooks.append(handle)
        self._model_hooks.append(self.model.register_load_state_dict_pre_hook(self._refuse_expert_weights))
        # An instance attribute shadows nn.Module._apply for this model only; `.to`, `.half`, `.cuda`... go there.
        self.model._apply = self._guarded_apply
        self.model.num_parameters = self._num_parameters      # the experts are no module parameters now
        self.model.get_parameter = self._get_parameter        # save_pretrained's conversions check their shapes
        # Bound methods, not lambdas: a copy or pickle of the model reaches the engine and gets its clear error.
        self._model_hooks.append(self.model.register_forward_pre_hook(self._count_model_forward))
        # generate() auto-compiles static-cache decoding on CUDA; the offloaded forward decides on the host at every
        # step (graph breaks, recompiles), so compiling it only costs time. Decided here, per model instance: the
        # generation config stays the user's (save_pretrained writes it).
        self.model._valid_auto_compile_criteria = self._no_auto_compile

    def _experts_into_state_dict(self, layer: MoELayer):
        def add_experts(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
            stacked = read_layer_experts(self.store, layer, torch.device("cpu"))
            for name, tensor in self.arch.expert_state(layer, stacked).items():
                state_dict[prefix + name] = tensor

        return add_experts

    def _get_parameter(self, target: str) -> nn.Parameter:
        """`nn.Module.get_parameter`, and for an offloaded expert weight a meta parameter of its shape and dtype:
        transformers' save-time conversions (Qwen3-VL-MoE's transposes) check the shape of what they write."""
        path, _, name = target.rpartition(".")
        module = self.model.get_submodule(path)
        released = module.__dict__.get(RELEASED_ATTR, {})
        if name in released and getattr(module, name, None) is None:
            shape, dtype, requires_grad, _ = released[name]
            return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=requires_grad)
        return type(self.model).get_parameter(self.model, target)

    def _count_model_forward(self, module: nn.Module, args: tuple) -> None:
        self.stats.record_model_forward()

    @staticmethod
    def _no_auto_compile(model_kwargs: dict, generation_config: Any) -> bool:
        return False

    def _refuse_expert_weights(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        """`load_state_dict` (a pre-hook of the model: it runs before any module is loaded) with expert weights:
        refused, since the experts are read from the store and would silently stay the old ones."""
        own = {prefix + name for name, _ in self.model.named_parameters()}
        own |= {prefix + name for name, _ in self.model.named_buffers()}
        for layer in self.layers:
            start = f"{prefix}{layer.name}."
            experts = sorted(k for k in state_dict if k.startswith(start) and k not in own)
            if experts:
                raise PolicyError(f"load_state_dict: {experts[0]!r} is a weight of an offloaded experts module; "
                                  f"offloaded experts are read from their store and cannot take new weights. Call "
                                  f"hf_moe_offload.disable(model), load the state dict, then offload again "
                                  f"(hf_moe_offload.enable)")

    def _num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """transformers' `num_parameters`, the offloaded experts counted in (they cannot be trained offloaded)."""
        count = type(self.model).num_parameters(self.model, only_trainable=only_trainable,
                                                exclude_embeddings=exclude_embeddings)
        if only_trainable:
            return count
        return count + sum(layer.num_experts * layer.layout.numel for layer in self.layers)

    def _guarded_apply(self, fn, recurse: bool = True):
        # With several devices every one is probed: moving all to one of them would strand the others' caches.
        for device in dict.fromkeys([torch.device(self.policy.device), *self.restore_devices]):
            probe = torch.empty(0, dtype=self.store.compute_dtype, device=device)
            converted = fn(probe)
            if converted.dtype != probe.dtype or converted.device != probe.device:
                change = " and ".join(([f"moving it to {converted.device}"] if converted.device != probe.device
                                       else []) + ([f"casting it to {converted.dtype}"]
                                                   if converted.dtype != probe.dtype else []))
                raise PolicyError(f"this model's experts are offloaded by hf_moe_offload as {probe.dtype} for "
                                  f"{device}; {change} would leave them behind. Call hf_moe_offload.disable(model) "
                                  f"first, or load with the dtype/device you want (offload_policy 'device', "
                                  f"from_pretrained dtype=, device_map=)")
        return nn.Module._apply(self.model, fn, recurse)

    # -- detach ---------------------------------------------------------------------------------------------------

    def _restore_experts(self, experts: list | None) -> None:
        """Give each layer its experts back as parameters, one layer at a time: from `experts` (read before), or
        straight from a host store, whose copy of the layer is released once restored."""
        with torch.inference_mode(False):
            for i, (layer, device) in enumerate(zip(self.layers, self.restore_devices)):
                if experts is None:
                    stacked = read_layer_experts(self.store, layer, device)
                else:
                    stacked, experts[i] = experts[i], None
                self.arch.set_expert_params(layer.module, {name: t.to(device) for name, t in stacked.items()})
                del stacked
                if experts is None:
                    self.store.release_layer(layer.index)

    def detach(self) -> None:
        """Give the experts back to the model as parameters and remove everything attached.

        `detach_checks` run first, then experts whose plain bytes are in files (a disk store, or a CPU store that
        keeps only packed copies: `ExpertStore.plain_in_memory`) are read into host memory: a failed check or read
        raises here and leaves the model offloaded and working. Slabs in host memory cannot fail a read, so their
        experts go back one layer at a time, each layer's host copy released once restored: host memory never holds
        a second copy of every expert. Either way the cache is freed before the experts go back to the device, so
        the two never coexist there.
        """
        for check in self.detach_checks:
            check()
        experts: list | None = None
        if not self.store.plain_in_memory:       # read from files: every expert first, a read may fail
            with torch.inference_mode(False), self.cache.lock:
                experts = [read_layer_experts(self.store, layer, torch.device("cpu")) for layer in self.layers]
        self._remove_hooks()
        del self.model._apply
        del self.model.num_parameters
        del self.model.get_parameter
        del self.model._valid_auto_compile_criteria
        for layer in self.layers:
            self.arch.detach(self.model, layer)
        self.cache.close()
        self._restore_experts(experts)
        self.store.close()
        if self.moved_resident_from is not None:
            move_resident_part(self.model, self.layers, self.moved_resident_from)
        for cleanup in self.on_detach:
            cleanup()
        delattr(self.model, ENGINE_ATTR)

    def release(self) -> None:
        """Free what the engine holds (hooks, threads, cache, store, the `on_detach` cleanups) without giving the
        experts back: for a model that never reached its user (a `from_pretrained` that failed after attaching),
        whose experts were never in memory and may not fit there."""
        self._remove_hooks()
        self.cache.close()
        self.store.close()
        for cleanup in self.on_detach:
            cleanup()
        delattr(self.model, ENGINE_ATTR)

    def _remove_hooks(self) -> None:
        for hook in list(self.hooks):
            hook.close()
        self.hooks.clear()
        self.prefetcher = None
        for handle in self._model_hooks:
            handle.remove()
        if self.micro_batched is not None:
            self.micro_batched.detach()
            self.micro_batched = None


def _restore_after_failed_attach(arch: MoEArch, layers: list[MoELayer], store: ExpertStore,
                                 restore_each: list[torch.device]) -> None:
    """Give the released experts back after the cache could not be built (e.g. out of device memory): what that
    attempt allocated is returned to the device first, then the layers come back one at a time."""
    if any(d.type == "cuda" for d in restore_each):
        torch.cuda.empty_cache()
    for layer, to in zip(layers, restore_each):
        arch.set_expert_params(layer.module, read_layer_experts(store, layer, to))


def read_layer_experts(store: ExpertStore, layer: MoELayer, device: torch.device) -> dict[str, torch.Tensor]:
    """Every expert of `layer` stacked per slab part ([E, ...] on `device`), read from `store`.

    A quantized store gives the dequantized weights in the compute dtype: approximate, so `disable()`,
    `state_dict()` and `save_pretrained` of a quantized model hold what it computed with, not the original."""
    layout = store.layouts[layer.index]
    stacked = {name: torch.empty((layer.num_experts, *shape), dtype=store.compute_dtype, device=device)
               for name, shape in layer.layout.parts}
    buf = None if store.plain_in_memory else torch.empty(layout.numel, dtype=store.dtype)
    for e in range(layer.num_experts):
        if buf is None:
            slab = store.host_slab(layer.index, e)
        else:
            store.read_into(layer.index, e, buf)
            slab = buf
        views = layout.dequantize(slab) if store.quantized else layout.views(slab)
        for name, view in views.items():
            stacked[name][e].copy_(view)
    return stacked


def get_engine(model: nn.Module) -> OffloadEngine | None:
    return getattr(model, ENGINE_ATTR, None)


def move_resident_part(model: nn.Module, layers: Sequence[MoELayer], device: torch.device) -> None:
    """Move every parameter and buffer outside the experts modules to `device`."""
    expert_prefixes = tuple(layer.name + "." for layer in layers)
    for name, module in model.named_modules():
        if (name + ".").startswith(expert_prefixes):
            continue
        for tensors in (module._parameters, module._buffers):
            for key, t in tensors.items():
                if t is not None and t.device != device and t.device.type != "meta":
                    t.data = t.data.to(device)
