"""Decode tok/s of every run, library A against B, per setting: `python plot.py` writes ab.png beside the JSONs."""
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
for path in sorted(glob.glob(str(here / "[AB]*.json"))):
    tree = Path(path).stem[0]
    for setting in json.load(open(path))["settings"]:
        for row in setting["rows"]:
            if row["system"] in ("ours", "llama_cpp"):
                key = (setting["threads"], row["batch"], row["system"])
                runs.setdefault(key, {"A": [], "B": []})[tree].append(row["tok_s"])
keys = sorted(runs)
fig, ax = plt.subplots(figsize=(10, 4.5))
scatter_ab(ax, {key: runs[key] for key in keys}, [f"{s}\n{t} thr, b{b}" for t, b, s in keys])
ax.set_ylabel("decode tok/s (every run)")
ax.set_title("Every weight in RAM: A (846df90) against B (cfb59f5); llama.cpp measured beside each")
ax.legend()
fig.tight_layout()
fig.savefig(here / "ab.png", dpi=110)
