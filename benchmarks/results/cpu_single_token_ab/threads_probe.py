"""How oneDNN's packed one-row bf16 products scale with a second thread: 16 experts' weights (352 MB, beyond the
caches) at 1 and 2 torch threads, and split by expert over two Python threads of one torch thread each; and whether
the bits depend on the thread count. `python threads_probe.py` (output: threads_probe.txt)."""
import time, torch, sys
torch.manual_seed(0)
def bench(f, n=50):
    for _ in range(5): f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1e6
# 40 experts' worth of weights (> L3): gate_up [7168,1024], down [1024,3584]
W = [(torch.randn(7168, 1024).bfloat16(), torch.randn(1024, 3584).bfloat16()) for _ in range(16)]
P = [(torch.ops.mkldnn._reorder_linear_weight(a, 1), torch.ops.mkldnn._reorder_linear_weight(b, 1)) for a, b in W]
x = torch.randn(1, 1024).bfloat16(); z = torch.randn(1, 3584).bfloat16()
lp = torch.ops.mkldnn._linear_pointwise
def run():
    for a, b in P:
        lp(x, a, None, "none", [], ""); lp(z, b, None, "none", [], "")
nbytes = sum(a.numel() + b.numel() for a, b in W) * 2
for t in (1, 2):
    torch.set_num_threads(t)
    us = bench(run, 20)
    print(f"threads {t}: {us:.0f} us for {nbytes/1e6:.0f} MB -> {nbytes/us/1e3:.1f} GB/s", flush=True)
import threading
from concurrent.futures import ThreadPoolExecutor
torch.set_num_threads(2)
def init(): torch.set_num_threads(1)
pool = ThreadPoolExecutor(2, initializer=init)
def part(ps):
    for a, b in ps:
        lp(x, a, None, "none", [], ""); lp(z, b, None, "none", [], "")
def run2():
    f = [pool.submit(part, P[0::2]), pool.submit(part, P[1::2])]
    for q in f: q.result()
us = bench(run2, 20)
print(f"2 py threads x 1 omp: {us:.0f} us -> {nbytes/us/1e3:.1f} GB/s; main threads {torch.get_num_threads()}")
# per-expert granularity: 2 experts at a time
def run3():
    for i in range(0, 16, 2):
        f = [pool.submit(part, [P[i]]), pool.submit(part, [P[i+1]])]
        for q in f: q.result()
us = bench(run3, 20)
print(f"pairs: {us:.0f} us -> {nbytes/us/1e3:.1f} GB/s")
# exactness: 1-thread vs 2-thread results
torch.set_num_threads(2); r2 = lp(x, P[0][0], None, "none", [], "")
torch.set_num_threads(1); r1 = lp(x, P[0][0], None, "none", [], "")
print("same bits 1 vs 2 threads:", torch.equal(r1, r2), torch.equal(r1, torch.nn.functional.linear(x, W[0][0])))
torch.set_num_threads(2); print("F.linear 2t equal packed 1t:", torch.equal(r1, torch.nn.functional.linear(x, W[0][0])))
x8 = torch.randn(8, 1024).bfloat16()
torch.set_num_threads(2); r2 = lp(x8, P[0][0], None, "none", [], "")
torch.set_num_threads(1); r1 = lp(x8, P[0][0], None, "none", [], "")
print("batch 8 same bits 1 vs 2 threads:", torch.equal(r1, r2))
