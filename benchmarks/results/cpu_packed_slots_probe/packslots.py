"""Prototype (not the library): pack each disk-store cache slot for oneDNN on the reader thread right after its
read, so cached experts compute through the packed kernel. Extra memory (copies beside the slots): a measurement of
what packed slots would give, not a candidate as is."""
import os, sys, time, glob, torch
from transformers import AutoModelForCausalLM, StoppingCriteria
import hf_moe_offload
from hf_moe_offload.memory import cpu_kernels
from hf_moe_offload.memory.copy_engine import CpuCopyEngine
mode, cache = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
path = [p for p in glob.glob("/tmp/hf_moe_offload_bench/mixtral_*") if "_l8_" in p][0]
files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
def drop():
    for f in files:
        fd = os.open(f, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
class Step(StoppingCriteria):
    def __init__(self): self.times, self.evict = [], 0.0
    def __call__(self, ids, scores, **kw):
        t = time.perf_counter(); drop(); self.evict += time.perf_counter() - t
        self.times.append(time.perf_counter())
        return torch.zeros(ids.shape[0], dtype=torch.bool)
m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, offload_policy={"device": "cpu", "store": "disk", "expert_cache": cache})
engine = hf_moe_offload.get_engine(m)
if mode == "packed":
    c = engine.cache
    reg = cpu_kernels.PrepackedWeights([c.memory], budget_bytes=1 << 40)
    c._proto_reg = reg
    layout = engine.store.layouts[0]
    orig = CpuCopyEngine._timed_read
    def timed_read(self, layer, expert, slot):
        views = engine.store.layouts[layer].views(slot)
        with reg._lock:   # the slot is rewritten: its copies are stale
            for w in views.values():
                old = reg._packed.pop((w.data_ptr(), w.shape[0], w.shape[1]), None)
                if old is not None:
                    reg.packed_bytes -= w.numel() * w.element_size()
        orig(self, layer, expert, slot)
        for w in views.values():
            reg.packed(w)
    CpuCopyEngine._timed_read = timed_read
ids = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
m.generate(ids, max_new_tokens=4, do_sample=False)
for r in range(2):
    s = Step(); drop()
    out = m.generate(ids, max_new_tokens=33, min_new_tokens=33, do_sample=False, stopping_criteria=[s])
    steps = [b - a for a, b in zip(s.times[1:], s.times[2:])]
    ev = s.evict / len(s.times)
    print(f"{mode} cache {cache}: decode {len(steps)/(sum(steps) - ev*len(steps)):.2f} tok/s (eviction excluded), tokens {out[0, -8:].tolist()}", flush=True)
