"""How far a lossless code shrinks bf16 expert weights: each weight's high byte (sign and 7 exponent bits) and low
byte (1 exponent bit and the mantissa) compressed apart with zstd (`pip install zstandard`), and how fast the high
bytes decompress on one core.

    python benchmarks/results/cpu_memcap_step_cost/lossless_bytes.py <checkpoint folder>
"""
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zstandard
from safetensors import safe_open

shard = sorted(Path(sys.argv[1]).glob("*.safetensors"))[1]        # the first decoder layer's shard
with safe_open(shard, "pt") as f:
    names = [n for n in f.keys() if ".experts." in n][:3]          # one expert: w1, w2, w3
    weights = {n: f.get_tensor(n) for n in names}
weights["torch.randn (7168, 1024)"] = torch.randn(7168, 1024, generator=torch.Generator().manual_seed(0)).bfloat16()
for name, w in weights.items():
    pairs = w.contiguous().view(torch.uint8).numpy().reshape(-1, 2)        # little-endian: [low byte, high byte]
    low, high = np.ascontiguousarray(pairs[:, 0]).tobytes(), np.ascontiguousarray(pairs[:, 1]).tobytes()
    packed_high = zstandard.ZstdCompressor(level=1).compress(high)
    packed_low = zstandard.ZstdCompressor(level=1).compress(low)
    unpack = zstandard.ZstdDecompressor()
    start = time.perf_counter()
    for _ in range(5):
        unpack.decompress(packed_high)
    rate = 5 * len(high) / (time.perf_counter() - start) / 1e9
    total = (len(packed_high) + min(len(packed_low), len(low))) / (2 * len(high))
    print(f"{name} {tuple(w.shape)}: high bytes to {len(packed_high) / len(high):.3f}, low bytes to "
          f"{len(packed_low) / len(low):.3f}, the weight to {total:.3f}; high bytes decompress at {rate:.2f} GB/s")
