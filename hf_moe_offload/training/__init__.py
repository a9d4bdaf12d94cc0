"""Offline training of SiDA hash predictors (expert-routing predictors); not needed at inference time.

- `routing_data`: the model's own router logits over a text corpus (the teacher), in memory or in shards;
- `train`: truncated knowledge distillation, validation metrics, atomic per-epoch checkpoints;
- `cli`: `hf-moe-offload train-hash` (and `scripts/train_hash.py`).

The trained predictor is used by the inference side, `hf_moe_offload.prefetch` (policy ``prefetch="hash"``).

Example:
    $ hf-moe-offload train-hash --model hf_moe_offload/demo_model --dataset pydoc --out predictor/ --epochs 3
"""
