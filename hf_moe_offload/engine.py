"""`OffloadEngine`: everything hf_moe_offload attaches to one model (store, cache, stats, per-layer runtimes),
listed in one place so that `detach()` can put the model back exactly as it was.
"""

from __future__ import annotations

import logging
from typing import Iterator, Sequence

import torch
from torch import nn

from .arch import MoEArch, MoELayer
from .cache import ExpertCache
from .policy import OffloadPolicy
from .stats import OffloadStats
from .store import ExpertStore

logger = logging.getLogger(__name__)

ENGINE_ATTR = "_hf_moe_offload_engine"


class LayerRuntime:
    """What an offloaded experts forward calls: `fetch` the slabs of the experts its tokens were routed to."""

    def __init__(self, engine: "OffloadEngine", layer: MoELayer):
        self.engine, self.layer = engine, layer

    def fetch(self, experts: Sequence[int]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Yield (expert, named weight views on the device), resident experts first."""
        self.engine.stats.record_forward(self.layer.index, len(experts))
        prefetcher = self.engine.prefetcher
        on_pinned = prefetcher.on_layer(self.layer.index) if prefetcher is not None else None
        for expert, slab in self.engine.cache.fetch(self.layer.index, experts, on_pinned):
            yield expert, self.layer.layout.views(slab)


class OffloadEngine:
    """Owns the offloading state of one model.

    Example:
        >>> engine = OffloadEngine.attach(model, policy, arch, layers, store, budget_bytes=2**30)  # doctest: +SKIP
        >>> engine.detach()                                                                          # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, policy: OffloadPolicy, arch: MoEArch, layers: list[MoELayer],
                 store: ExpertStore, cache: ExpertCache, stats: OffloadStats, restore_device: torch.device,
                 moved_resident_from: torch.device | None):
        self.model, self.policy, self.arch, self.layers = model, policy, arch, layers
        self.store, self.cache, self.stats = store, cache, stats
        self.restore_device = restore_device            # where experts go back on detach
        self.moved_resident_from = moved_resident_from  # where the non-expert part was before enable(), if moved
        self.runtimes = [LayerRuntime(self, layer) for layer in layers]
        self.prefetcher = None    # a HashPrefetcher when the policy names a predictor

    @classmethod
    def attach(cls, model: nn.Module, policy: OffloadPolicy, arch: MoEArch, layers: list[MoELayer],
               store: ExpertStore, budget_bytes: int, restore_device: torch.device | None = None,
               moved_resident_from: torch.device | None = None) -> "OffloadEngine":
        device = torch.device(policy.device)
        stats = OffloadStats(num_layers=len(layers))
        cache = ExpertCache(store, device, budget_bytes, policy.eviction, stats)
        engine = cls(model, policy, arch, layers, store, cache, stats, restore_device or device, moved_resident_from)
        for layer, runtime in zip(layers, engine.runtimes):
            arch.release_expert_params(layer.module)
            arch.attach(model, layer, runtime)
        setattr(model, ENGINE_ATTR, engine)
        logger.info("hf_moe_offload: %d MoE layers offloaded (device=%s, store=%s, %d cache slots%s)", len(layers),
                    policy.device, policy.store, cache.num_slots, ", zero-copy" if cache.zero_copy else "")
        return engine

    def attach_predictor(self, predictor: nn.Module) -> None:
        from .prefetch.hash_runner import HashPrefetcher

        self.prefetcher = HashPrefetcher(self, predictor, routing=self.policy.routing)

    def stats_snapshot(self):
        snap = self.stats.snapshot()
        if self.prefetcher is not None:
            snap["predictor_s"] = self.prefetcher.predict_s
            snap["predictor_wait_s"] = self.prefetcher.wait_s
        return snap

    def detach(self) -> None:
        """Give the experts back to the model as parameters and remove everything attached."""
        if self.prefetcher is not None:
            self.prefetcher.detach()
            self.prefetcher = None
        for layer in self.layers:
            self.arch.detach(self.model, layer)
            self.arch.set_expert_params(layer.module, self._stacked_experts(layer))
        self.cache.close()
        self.store.close()
        if self.moved_resident_from is not None:
            move_resident_part(self.model, self.layers, self.moved_resident_from)
        delattr(self.model, ENGINE_ATTR)

    def _stacked_experts(self, layer: MoELayer) -> dict[str, torch.Tensor]:
        stacked = {name: torch.empty((layer.num_experts, *shape), dtype=self.store.dtype, device=self.restore_device)
                   for name, shape in layer.layout.parts}
        buf = torch.empty(layer.layout.numel, dtype=self.store.dtype)
        for e in range(layer.num_experts):
            slab = self.store.host_slab(layer.index, e)
            if slab is None:
                self.store.read_into(layer.index, e, buf)
                slab = buf
            for name, view in layer.layout.views(slab).items():
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
