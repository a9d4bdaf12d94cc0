#!/usr/bin/env python
"""Train a SiDA hash predictor (expert-routing predictor) for a Mixture-of-Experts model.

The same command as `hf-moe-offload train-hash` with the same flags (this script only calls it); see
`hf_moe_offload/training/cli.py`.

Example:
    python scripts/train_hash.py --model PATH --dataset data.jsonl --text-field text --out predictor/ \\
        --epochs 3 --top-t 30
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hf_moe_offload.training.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
