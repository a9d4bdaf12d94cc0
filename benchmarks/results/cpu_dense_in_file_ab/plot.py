"""Decode tok/s of every run, library A against B, per row: `python plot.py` writes ab.png beside the JSONs."""
import glob
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from ab_plot import scatter_ab  # noqa: E402

here = Path(__file__).parent
runs: dict[tuple, dict[str, list[float]]] = {}
for path in sorted(glob.glob(str(here / "memcap_*.json"))):
    tree = Path(path).stem.split("_")[1]
    for row in json.load(open(path))["rows"]:
        if row.get("cap_bytes") and row["system"].startswith("ours") and row.get("decode_tok_s"):
            key = (row["system"].removeprefix("ours_"), row["cap_share"], row["batch"])
            runs.setdefault(key, {"A": [], "B": []})[tree].append(row["decode_tok_s"])
keys = sorted(runs)
fig, ax = plt.subplots(figsize=(11, 4.5))
scatter_ab(ax, {key: runs[key] for key in keys}, [f"{s}\n{int(c * 100)}% b{b}" for s, c, b in keys])
ax.set_yscale("log")
ax.set_ylabel("decode tok/s (every run)")
ax.set_title("Own dense weights in memory (A, bbd902d) or left in the file (B, 3ecb846), under a memory cap")
ax.legend()
fig.tight_layout()
fig.savefig(here / "ab.png", dpi=110)
