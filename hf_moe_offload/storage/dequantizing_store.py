"""A dense view of a store of checkpoint-quantized experts (GGUF blocks, GPTQ/AWQ/compressed-tensors packing): the
store keeps the quantized bytes, and each expert is dequantized into the model dtype as it is read into a cache
slot, so every slot holds the dense slab.

This is the precedent of fine-grained FP8 and MXFP4 (`DiskStore.read_into` dequantizes them as they are read) for
formats whose store stays quantized: a disk store reads the quantized bytes per miss, a host store holds them, and
the cache, the forward, the grouped path and the CPU kernels see an ordinary dense store. A hit costs nothing; a
miss costs the read plus one dequantization, by the layout's own arithmetic (`GGUFWeight.dequantize`,
`PackedWeight.dequantize`), so a slot's values are bit for bit those the compute-time dequantization gives.

`slab_bytes(layer)` stays the quantized bytes one expert's read takes (what the cache records as moved per miss
and the meters time); the slots are `layouts[layer].numel` elements of `dtype`, the dense size.

Example:
    >>> store = DequantizingStore(DiskStore(layers, pieces, torch.bfloat16, layouts=gguf_layouts))  # doctest: +SKIP
    >>> store.read_into(0, 3, slot)      # quantized bytes read, dequantized into the bf16 slot  # doctest: +SKIP
"""

from __future__ import annotations

import threading

import torch

from ..layout import SlabLayout
from .gguf_layout import GGUFSlabLayout
from .packed_layout import PackedSlabLayout
from .store import ExpertStore

CheckpointLayout = GGUFSlabLayout | PackedSlabLayout


class DequantizingStore(ExpertStore):
    """`inner` (a `DiskStore` or `CpuStore` of GGUF or packed slabs) seen as a dense store of the model dtype."""

    def __init__(self, inner: ExpertStore):
        if not all(isinstance(lay, (GGUFSlabLayout, PackedSlabLayout)) for lay in inner.layouts):
            raise TypeError(f"DequantizingStore needs a store of GGUF or packed slabs, got layouts "
                            f"{sorted({type(lay).__name__ for lay in inner.layouts})}")
        self.inner = inner
        self.quantized_layouts: list[CheckpointLayout] = list(inner.layouts)
        dense: list[SlabLayout] = [lay.dense for lay in self.quantized_layouts]
        super().__init__(dense, inner.num_experts, inner.compute_dtype)
        self._bounce = threading.local()    # per reader thread: one expert's quantized bytes from a disk store

    def slab_bytes(self, layer: int) -> int:
        """The bytes one expert's read takes: its quantized slab (the dense slot is `layouts[layer].numel`)."""
        return self.inner.slab_bytes(layer)

    def read_directly(self, on: bool = True) -> None:
        self.inner.read_directly(on)

    @property
    def reads_directly(self) -> bool:
        return self.inner.reads_directly

    @property
    def pinned_bytes(self) -> int:
        return self.inner.pinned_bytes

    def read_into(self, layer: int, expert: int, dst: torch.Tensor) -> None:
        """Fill the flat tensor `dst` (numel >= the dense slab, model dtype) with the expert's dequantized parts."""
        raw = self.inner.host_slab(layer, expert)
        if raw is None:
            raw = self._bounce_buffer(self.quantized_layouts[layer].numel)
            self.inner.read_into(layer, expert, raw)
        dense = self.layouts[layer].views(dst[:self.layouts[layer].numel])
        self.quantized_layouts[layer].dequantize_into(raw, dense)

    def _bounce_buffer(self, numel: int) -> torch.Tensor:
        """This thread's buffer for quantized bytes, grown to at least `numel` bytes (reused across experts)."""
        buffer = getattr(self._bounce, "buffer", None)
        if buffer is None or buffer.numel() < numel:
            with torch.inference_mode(False):   # worker threads and `generate` (no_grad) write into it
                buffer = self._bounce.buffer = torch.empty(numel, dtype=torch.uint8)
        return buffer[:numel]

    def release_layer(self, layer: int) -> None:
        self.inner.release_layer(layer)

    def close(self) -> None:
        self.inner.close()


def dense_slots_on(device: torch.device) -> bool:
    """Whether the cache on `device` holds checkpoint-quantized experts dequantized (`DequantizingStore`) rather
    than quantized: on the CPU, where dequantizing at every use costs far more than a dense matmul at small batch.
    On CUDA the slots stay quantized: more experts per device byte, each dequantized on the device as it computes.
    One rule for every block type: the CPU A/B per format, store and batch (docs/benchmarks.md, "GGUF checkpoints")
    found no regime where quantized slots are reliably faster, and the batch is not known when the cache is built."""
    return device.type == "cpu"


def dense_store_for(store: ExpertStore, device: torch.device) -> ExpertStore:
    """`store` as the cache on `device` should see it: dense (`DequantizingStore`) where `dense_slots_on(device)`."""
    return DequantizingStore(store) if dense_slots_on(device) else store
