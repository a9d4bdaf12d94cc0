"""Peak RSS and decode tok/s of every run, library A against B: `python plot.py` writes ab.png beside the JSONs."""
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
runs: dict[tuple, dict[str, list[tuple[float, float]]]] = {}
for path in sorted(glob.glob(str(here / "[EF]*.json"))):
    tree = {"E": "A", "F": "B"}[Path(path).stem[0]]
    for row in json.load(open(path))["results"]:
        if row["system"] == "hf_moe_offload_cpu_store":
            runs.setdefault(row["batch"], {"A": [], "B": []})[tree].append(
                (row["peak_rss_bytes"] / 2**30, row["decode_tok_s"]))
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
for ax, index, label in ((axes[0], 0, "peak RSS (GiB)"), (axes[1], 1, "decode tok/s")):
    scatter_ab(ax, {b: {tree: [v[index] for v in runs[b][tree]] for tree in "AB"} for b in sorted(runs)},
               [f"batch {b}" for b in sorted(runs)], size=20)
    ax.set_ylabel(label)
    ax.set_ylim(bottom=0)
axes[0].legend()
fig.suptitle('store="cpu", every weight in RAM: slabs and packed copies (A, 04e7d76) or packed copies only (B, 77cd1f2)')
fig.tight_layout()
fig.savefig(here / "ab.png", dpi=110)
