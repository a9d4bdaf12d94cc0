#!/usr/bin/env python
"""Perplexity of a model on a local text / JSON-lines dataset, with any offload policy (or none).

Same flags as `hf-moe-offload perplexity` (this script only calls it); see
`hf_moe_offload/integrations/perplexity.py` for the method.

Example:
    HF_HUB_OFFLINE=1 python scripts/perplexity.py --model hf_moe_offload/demo_model \\
        --data hf_moe_offload/demo_model/heldout.jsonl --text-field text \\
        --policy '{"device": "cpu", "store": "disk", "expert_cache": "25%"}' --out ppl.json
    HF_HUB_OFFLINE=1 python scripts/perplexity.py --model hf_moe_offload/demo_model \\
        --data hf_moe_offload/demo_model/heldout.jsonl --policy none        # the unpatched model
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from hf_moe_offload.integrations.perplexity import main

if __name__ == "__main__":
    sys.exit(main())
