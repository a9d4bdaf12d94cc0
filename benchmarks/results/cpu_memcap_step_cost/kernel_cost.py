"""One-row bf16 products on weights cold in memory (24 distinct weights cycled, more than the last-level cache):
F.linear on the plain layout against oneDNN's prepacked copy, and what packing costs, at one torch thread.

    python benchmarks/results/cpu_memcap_step_cost/kernel_cost.py
"""
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
WEIGHTS = 24


def per_call_ms(fn, reps: int = 3) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        for i in range(WEIGHTS):
            fn(i)
    return (time.perf_counter() - start) / (reps * WEIGHTS) * 1000


for name, (n, k) in {"gate_up": (7168, 1024), "down": (1024, 3584)}.items():
    weights = [torch.randn(n, k).bfloat16() for _ in range(WEIGHTS)]
    x = torch.randn(1, k).bfloat16()
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    plain = [w.to_mkldnn() for w in weights]
    # copy_ into an existing packed tensor reorders (same bits as F.linear after it), at the same cost as packing
    target = torch.ops.mkldnn._reorder_linear_weight(weights[0], 1)
    target.copy_(plain[1])
    same = torch.equal(torch.ops.mkldnn._linear_pointwise(x, target, None, "none", [], ""), F.linear(x, weights[1]))
    print(f"{name} [{n}, {k}]: F.linear {per_call_ms(lambda i: F.linear(x, weights[i])):.2f} ms, prepacked "
          f"{per_call_ms(lambda i: torch.ops.mkldnn._linear_pointwise(x, packed[i], None, 'none', [], '')):.2f} ms, "
          f"packing {per_call_ms(lambda i: torch.ops.mkldnn._reorder_linear_weight(weights[i], 1), 1):.2f} ms, "
          f"packing by copy_ {per_call_ms(lambda i: packed[i].copy_(plain[i]), 1):.2f} ms (same bits: {same}), "
          f"plain copy {per_call_ms(lambda i: weights[i].clone(), 1):.2f} ms")
