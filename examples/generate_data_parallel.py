"""Batch generation split across processes, one offloaded model each, outputs gathered in the prompts' order.

    python examples/generate_data_parallel.py --out out.jsonl                              # one process
    torchrun --nproc_per_node 2 examples/generate_data_parallel.py --out out.jsonl         # two, same file
    accelerate launch --num_processes 2 --cpu examples/generate_data_parallel.py --out out.jsonl

`--prompts` is a JSON-lines file with a "text" field (default: the demo model's held-out texts, cut to 24 words);
each process takes every n-th prompt (`hf_moe_offload.integrations.distributed.map_sharded`), generates greedily in batches, and
rank 0 writes one line per prompt, in order. On a GPU machine each process uses the GPU of its local rank.
"""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_moe_offload
from hf_moe_offload.demo import DEMO_MODEL
from hf_moe_offload.integrations.distributed import device_for_rank, launch_world, map_sharded

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=str(DEMO_MODEL))
parser.add_argument("--prompts", default=str(DEMO_MODEL / "heldout.jsonl"))
parser.add_argument("--policy", default='{"store": "disk", "expert_cache": "25%"}')
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--max-new-tokens", type=int, default=16)
parser.add_argument("--out", required=True)
args = parser.parse_args()

with open(args.prompts) as f:
    prompts = [" ".join(json.loads(line)["text"].split()[:24]) for line in f if line.strip()]
policy = hf_moe_offload.OffloadPolicy.from_any(args.policy)    # a preset name or a JSON object
policy.device = device_for_rank(policy.device)
torch.set_num_threads(1)

tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(args.model, offload_policy=policy)


def generate(batch_prompts: list[str]) -> list[str]:
    texts = []
    for start in range(0, len(batch_prompts), args.batch_size):
        inputs = tokenizer(batch_prompts[start:start + args.batch_size], return_tensors="pt",
                           padding=True).to(model.device)
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        texts += tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return texts


outputs = map_sharded(prompts, generate, chunk=args.batch_size)   # the batches one process would run
if launch_world()[0] == 0:
    with open(args.out, "w") as f:
        for prompt, text in zip(prompts, outputs):
            f.write(json.dumps({"prompt": prompt, "generated": text}) + "\n")
    print(f"wrote {len(outputs)} generations to {args.out}")
