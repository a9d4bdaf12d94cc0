"""Decode tok/s per GB/s of the run's median store-like read rate, library A against B, and the table of every run:
`python plot.py` writes ab.png beside the JSONs and prints the table."""
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
runs: dict[int, dict[str, list[float]]] = {}
table: dict[int, dict[str, str]] = {}
tokens: dict[int, set] = {}
for path in sorted(glob.glob(str(here / "disk_*_[AB][12].json"))):
    tag = Path(path).stem.rsplit("_", 1)[1]
    data = json.load(open(path))
    rate = data["store_read_bandwidth"]["median_bytes_per_s"] / 1e9
    for row in data["results"]:
        batch, tok_s = row["batch"], row["decode_tok_s"]
        runs.setdefault(batch, {"A": [], "B": []})[tag[0]].append(tok_s / rate)
        table.setdefault(batch, {})[tag] = (f"{tok_s:.2f} ({rate:.2f}) → {tok_s / rate:.2f}; "
                                           f"{row['read_bytes_per_token'] / 1e6:.1f} MB/token, "
                                           f"{row['peak_rss_bytes'] / 2**30:.2f} GiB")
        tokens.setdefault(batch, set()).add(json.dumps(row["tokens"]))
print("| batch | " + " | ".join(("A1", "B1", "B2", "A2")) + " | same tokens |")
print("|---|---|---|---|---|---|")
for batch in sorted(table):
    print(f"| {batch} | " + " | ".join(table[batch].get(t, "–") for t in ("A1", "B1", "B2", "A2"))
          + f" | {'yes' if len(tokens[batch]) == 1 else 'no'} |")
fig, ax = plt.subplots(figsize=(6, 4))
scatter_ab(ax, {b: runs[b] for b in sorted(runs)}, [f"batch {b}" for b in sorted(runs)], size=20)
ax.set_ylabel("decode tok/s per GB/s of the disk")
ax.set_ylim(bottom=0)
ax.legend()
fig.suptitle("experts on disk: A = 33872e2, B = 04d1e5e (alternated A B B A)")
fig.tight_layout()
fig.savefig(here / "ab.png", dpi=110)
