"""Write a compressed-tensors W4A16 ("pack-quantized", int4 weights, group-wise scales) copy of a float checkpoint,
packed by compressed-tensors' own compressor: the form llm-compressor publishes, to measure what reading such a
checkpoint costs in quality and speed against the float one (`hf-moe-offload perplexity`, scripts/bench_packed.py).

Quantizes every expert linear, and with --attention the attention projections too; the router, norms, embeddings
and the head stay as they are (llm-compressor's usual `ignore`).

    python scripts/pack_w4a16.py hf_moe_offload/demo_model /tmp/demo_w4a16_g64 --group 64
    hf-moe-offload perplexity --model /tmp/demo_w4a16_g64 --data hf_moe_offload/demo_model/heldout.jsonl ...
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file, save_file


def quantized(key: str, tensor: torch.Tensor, attention: bool) -> bool:
    """Whether `key` is a linear weight this script packs."""
    return key.endswith(".weight") and tensor.dim() == 2 and (
        ".experts." in key or (attention and ".self_attn." in key))


def pack_file(file: Path, out: Path, args: QuantizationArgs, scheme: QuantizationScheme, attention: bool
              ) -> dict[str, str]:
    """Pack one safetensors file into `out`; returns {new tensor name: file name} for the packed tensors and
    {old name: ""} for the weights they replace."""
    tensors, renamed = {}, {}
    for key, weight in load_file(file).items():
        if not quantized(key, weight, attention):
            tensors[key] = weight
            continue
        if weight.shape[1] % args.group_size:
            raise SystemExit(f"{key}: {weight.shape[1]} inputs are not a multiple of --group {args.group_size}")
        groups = weight.float().reshape(weight.shape[0], -1, args.group_size)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        state = {"weight": weight, "weight_scale": scale.to(weight.dtype)}
        if not args.symmetric:
            state["weight_zero_point"] = zero
        module = key.removesuffix(".weight")
        renamed[key] = ""
        for suffix, tensor in PackedQuantizationCompressor.compress(state, scheme).items():
            tensors[f"{module}.{suffix}"] = tensor.contiguous()
            renamed[f"{module}.{suffix}"] = file.name
    save_file(tensors, out / file.name, metadata={"format": "pt"})
    return renamed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dense", type=Path, help="a float checkpoint folder (safetensors, one file or sharded)")
    p.add_argument("out", type=Path, help="the folder to write (must not exist)")
    p.add_argument("--group", type=int, default=128, help="input weights per scale (default 128)")
    p.add_argument("--asymmetric", action="store_true", help="a zero point per group too")
    p.add_argument("--attention", action="store_true", help="pack the attention projections as well")
    a = p.parse_args()
    if a.out.exists():
        raise SystemExit(f"{a.out} exists; give a new folder")
    args = QuantizationArgs(num_bits=4, type="int", symmetric=not a.asymmetric, strategy="group", group_size=a.group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    a.out.mkdir(parents=True)
    for extra in a.dense.iterdir():          # tokenizer, generation config, held-out text: copied as they are
        if extra.suffix != ".safetensors" and extra.name not in ("config.json", "model.safetensors.index.json"):
            if extra.is_file():
                shutil.copy2(extra, a.out / extra.name)
    index_path = a.dense / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for file in sorted(a.dense.glob("*.safetensors")):
        renamed = pack_file(file, a.out, args, scheme, a.attention)
        if index is not None:
            for key, where in renamed.items():
                if where:
                    index["weight_map"][key] = where
                else:
                    del index["weight_map"][key]
    if index is not None:
        (a.out / index_path.name).write_text(json.dumps(index, indent=2))
    config = json.loads((a.dense / "config.json").read_text())
    config["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme}, format="pack-quantized", quantization_status="compressed",
        ignore=["lm_head"]).model_dump(mode="json")
    (a.out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"wrote {a.out}: int4, group {a.group}, {'asymmetric' if a.asymmetric else 'symmetric'}, experts"
          f"{' and attention' if a.attention else ''} packed")


if __name__ == "__main__":
    main()
