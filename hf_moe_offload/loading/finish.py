"""The steps every way of offloading shares (`from_pretrained` and `enable`): refusing CPU attention early, loading
the policy's predictor, and what is attached after the engine (predictor hook, CPU attention, batching defaults,
CPU kernels for the model's own linear layers, the auto plan's summary), each undone by `disable()`."""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import PreTrainedModel

from .._logging import progress
from ..attention.cpu import check_cpu_attention, cpu_attention_enabled, restore_attention, use_cpu_attention
from ..batching.config import install_batching_defaults
from ..layout import SlabLayout
from ..memory.cpu_kernels import DenseLinears, prepack_budget
from ..memory.cpu_threads import apply_default_threads
from ..planning.resolve import ResolvedPolicy
from ..policy.offload_policy import OffloadPolicy
from ..prefetch.hash import HashPredictor, HashPrefetcher
from ..runtime.engine import OffloadEngine
from ..runtime.pass_scheduler import PassScheduler
from ..storage.checkpoint import CheckpointIndex
from ..storage.pages import release_pages
from ..storage.store import CpuStore
from .file_maps import FileMaps
from .mapped_dense import map_dense_weights

logger = logging.getLogger(__name__)


def finish_offloading(model: PreTrainedModel, engine: OffloadEngine, resolved: ResolvedPolicy,
                      predictor: HashPredictor | None, index: CheckpointIndex | None = None,
                      maps: FileMaps | None = None, *, loaded: bool = True) -> PreTrainedModel:
    """Attach what rides on the engine: the plan summary, the wide stream window ("auto" on the CPU without a plan),
    the predictor's hook, CPU attention, batching defaults, CPU kernels. `index`: the checkpoint's safetensors
    tensors the model was loaded from, where its own dense weights can be left in their files (mapped in `maps`,
    which may hold the input embedding table already); the files mapped are checked before every forward and
    `state_dict()` until `disable()`. On a failure the engine comes off: `enable()`'s model (`loaded=False`) gets
    its experts back; a model being loaded (`loaded=True`: never returned) only frees what the engine holds."""
    engine.plan = resolved.plan
    try:
        if resolved.widen_stream_window:
            for hook in engine.hooks:
                if isinstance(hook, PassScheduler):
                    hook.widen_stream_window()
        if predictor is not None:
            engine.attach_prefetcher(HashPrefetcher(engine, predictor, routing=engine.policy.routing))
        _apply_attention(model, engine)
        _apply_batching(model, engine)
        maps = FileMaps() if maps is None else maps
        _apply_cpu_kernels(model, engine, index, maps)
    except BaseException:
        try:
            if loaded:
                engine.release()          # reading every expert back could be what memory cannot hold
            else:
                engine.detach()           # enable()'s model is left as it was before
        except Exception:
            logger.exception("hf_moe_offload: undoing the offload that failed failed too")
        raise                             # the first failure is the one to report
    if maps.mapped:
        engine.on_detach.append(maps.guard(model))
        engine.detach_checks.append(maps.check)      # disable() reads the mapped embedding table back
    return model


def check_attention(policy: OffloadPolicy, model: nn.Module) -> None:
    """attention="cpu" on a model it cannot serve is refused before anything is loaded or allocated."""
    if policy.attention == "cpu":
        check_cpu_attention(model)

def _apply_attention(model: PreTrainedModel, engine: OffloadEngine) -> None:
    """attention="cpu": CPU attention against a host KV cache, undone by `disable()` (the engine's on_detach)."""
    if engine.policy.attention != "cpu":
        return
    if cpu_attention_enabled(model):      # the user turned it on already: theirs to undo
        return
    use_cpu_attention(model)
    engine.on_detach.append(lambda: restore_attention(model))

def _apply_batching(model: PreTrainedModel, engine: OffloadEngine) -> None:
    """`generate_batch` without a ContinuousBatchingConfig sizes its token budget for offloading (`batching.config`),
    undone by `disable()`."""
    remove = install_batching_defaults(model)
    if remove is not None:
        engine.on_detach.append(remove)

def _apply_cpu_kernels(model: PreTrainedModel, engine: OffloadEngine, index: CheckpointIndex | None,
                       maps: FileMaps) -> None:
    """The model's own bfloat16 linear layers on the CPU take the experts' CPU kernels (`memory.cpu_kernels`). A
    layer whose weight the checkpoint holds as loaded keeps only its packed copy, the weight left in the file
    (`loading.mapped_dense`); the others' copies come within what memory (RAM, or the container's limit) leaves once
    the store's experts could be packed too and a CPU expert cache is filled. On the CPU device, torch's thread
    count leaves the cores other processes use (`memory.cpu_threads`). Each undone by `disable()`."""
    on_cpu = torch.device(engine.policy.device).type == "cpu"
    copies_only = on_cpu and _keep_expert_copies_only(engine)
    experts = engine.store.total_bytes if engine.stats.prepacked and not copies_only else 0
    # A CPU cache's slots are allocated but not yet written: their pages do not count as used until they are.
    cache = engine.stats.capacity_bytes if on_cpu else 0
    skip = tuple(layer.name for layer in engine.layers)
    in_file = map_dense_weights(model, DenseLinears.eligible(model, skip), index, maps) if index is not None else []
    dense = DenseLinears.attach(model, skip=skip, budget_bytes=max(0, prepack_budget() - experts - cache),
                                packed_only=in_file, release=release_pages)
    engine.dense_in_file_bytes = sum(m.weight.numel() * m.weight.element_size() for m in dense.packed_only)
    if dense.modules:
        engine.stats.prepacked.extend(dense.registrations)
        engine.on_detach.append(dense.remove)
    if on_cpu:
        restore = apply_default_threads()
        if restore is not None:
            engine.on_detach.append(restore)

def _keep_expert_copies_only(engine: OffloadEngine) -> bool:
    """A CPU store served in place keeps only its experts' packed copies: each layer's experts are packed now and
    its slabs' pages handed back, so the copies are the experts' only memory (their plain bytes are read from the
    checkpoint again for `state_dict()` and `disable()`). Only where every expert part computes through the packed
    kernel (`F.linear`-shaped experts; not the `x @ W` families) and the store kept its checkpoint reader."""
    store = engine.store
    if not (isinstance(store, CpuStore) and store.reader is not None and getattr(engine.cache, "zero_copy", False)
            and all(type(layout) is SlabLayout and all(len(shape) == 2 for _, shape in layout.parts)
                    for layout in store.layouts)):
        return False
    registration = next((r for r in engine.stats.prepacked if r.owns(store.slabs[0])), None)
    if registration is None:
        return False
    for layer in progress(range(len(store.slabs)), desc="Packing experts for the CPU kernels", unit="layer"):
        slabs = store.slabs[layer]
        weights = [w for e in range(slabs.shape[0]) for w in store.layouts[layer].views(slabs[e]).values()]
        registration.pack_and_release(slabs, weights, lambda: store.release_plain(layer))
    return True


def load_predictor(policy: OffloadPolicy, model: nn.Module) -> HashPredictor | None:
    """The policy's hash predictor, its files and fingerprint checked against `model` (a skeleton will do)."""
    if not policy.predictor:
        return None
    return HashPredictor.load(policy.predictor, model=model, device="cpu")
