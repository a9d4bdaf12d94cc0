"""Probe (not the library): how much memory `store="cpu"` would save by holding only the packed oneDNN copies of its
experts, and whether decoding ever reads the plain slabs. Loads the benchmark's checkpoint with every weight in
RAM, packs every expert (generate, then any expert not routed yet), hands the slabs' pages back to the kernel
(`madvise(MADV_DONTNEED)`: their bytes read as zeros from then on) and decodes again. The same greedy tokens mean
nothing read the slabs; the resident set before and after is what a packed-only store would save.

    python probe.py /tmp/hf_moe_offload_bench/mixtral_h1024_i3584_l10_e8_k2_a16x8_v32000_seed0
"""
import sys
import time

import psutil
import torch
from transformers import AutoModelForCausalLM

import hf_moe_offload
from hf_moe_offload.loading.mapped_dense import release_pages
from hf_moe_offload.memory import cpu_kernels

torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16,
                                             offload_policy={"device": "cpu", "store": "cpu"})
engine = hf_moe_offload.get_engine(model)
store = engine.store
ids = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0))


def decode() -> tuple[list[int], float]:
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, 16:].tolist(), 32 / (time.perf_counter() - start)


def rss_gib() -> float:
    return psutil.Process().memory_info().rss / 2**30


tokens, _ = decode()
registration = next(r for r in cpu_kernels.active_registrations() if r.owns(store.slabs[0][0]))
for layer, slabs in enumerate(store.slabs):                 # every expert packed, routed or not
    for expert in range(slabs.shape[0]):
        for weight in store.layouts[layer].views(slabs[expert]).values():
            assert registration.packed(weight) is not None
_, before = decode()
print(f"slabs {sum(s.nbytes for s in store.slabs) / 2**30:.2f} GiB, packed copies "
      f"{registration.packed_bytes / 2**30:.2f} GiB; RSS with both {rss_gib():.2f} GiB; decode {before:.1f} tok/s")
for slabs in store.slabs:                                   # the plain bytes handed back: zeros if read again
    release_pages(slabs)                                    # the whole pages inside each layer's slabs
after_tokens, after = decode()
print(f"RSS with the packed copies only {rss_gib():.2f} GiB; decode {after:.1f} tok/s; "
      f"same greedy tokens: {after_tokens == tokens}")
