"""Generate with a Mixture-of-Experts model whose experts stay on disk, with a 25% expert cache.

    python examples/generate_offloaded.py                      # the embedded demo model
    python examples/generate_offloaded.py --model PATH --policy auto
"""

import argparse
import json

import hf_moe_offload
from hf_moe_offload.demo import DEMO_MODEL
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=str(DEMO_MODEL))
parser.add_argument("--policy", default='{"store": "disk", "expert_cache": "25%"}')
args = parser.parse_args()
policy = json.loads(args.policy) if args.policy.startswith("{") else args.policy

tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(args.model, offload_policy=policy)
inputs = tokenizer(["The import statement", "A class definition"], return_tensors="pt", padding=True).to(model.device)
out = model.generate(**inputs, max_new_tokens=30, do_sample=False, pad_token_id=tokenizer.pad_token_id)
print(tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print({k: v for k, v in hf_moe_offload.stats(model).items() if k != "per_layer"})
