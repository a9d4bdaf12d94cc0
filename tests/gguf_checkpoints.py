"""Tiny GGUF MoE checkpoints in llama.cpp's published layout, written with the `gguf` package (tests/test_gguf.py,
scripts/bench_gguf.py).

Tensors are the ones llama.cpp's converter writes for the architecture (`blk.N.ffn_{gate,up,down}_exps` merged
[E, rows, cols], norms and router in F32). Types the `gguf` package quantizes (Q4_0 ... Q8_0, BF16) are quantized
from random values with `gguf.quants.quantize`; it has no K-quant quantizer, so K-quant blocks hold random codes
with finite, small fp16 scales: valid blocks that decode to weights of a plausible size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

# The fp16 scale fields of each K-quant block (byte offsets), set to finite values; Q8_0's, for random blocks
# written fast (`write_gguf(..., quantize=False)`).
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
_RANDOM_BLOCKS = {**_K_SCALES, "Q8_0": (0,)}


@dataclass(frozen=True)
class Dims:
    """The shape of a tiny model. transformers reads the experts' width from the config class's default (the GGUF
    config mapping has no key for it): 768 for Qwen3-MoE, 1408 for Qwen2-MoE (and a shared expert of 5632)."""

    hidden: int = 256
    experts: int = 8
    top_k: int = 2
    layers: int = 2
    vocab: int = 320
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    expert_width: int = 768
    shared_width: int = 0


def values(shape: tuple[int, ...], qtype: Q, rng: np.random.Generator, scale: float = 0.05,
           quantize: bool = True) -> tuple[np.ndarray, Q | None]:
    """(array to write, raw_dtype for `GGUFWriter.add_tensor`) holding values of `shape` stored as `qtype`; with
    `quantize=False` a Q8_0 tensor is random blocks too (large files in seconds)."""
    if qtype == Q.F32:
        return (rng.standard_normal(shape) * scale).astype(np.float32), None
    if qtype == Q.F16:
        return (rng.standard_normal(shape) * scale).astype(np.float16), None
    if qtype.name in (_K_SCALES if quantize else _RANDOM_BLOCKS):
        elements, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // elements * nbytes), dtype=np.uint8)
        flat = raw.reshape(-1, nbytes)
        for offset in _RANDOM_BLOCKS[qtype.name]:
            flat[:, offset:offset + 2] = (rng.uniform(2e-4, 6e-4, size=(flat.shape[0], 1)).astype(np.float16)
                                          .view(np.uint8))
        return raw, qtype
    try:
        return gguf.quants.quantize((rng.standard_normal(shape) * scale).astype(np.float32), qtype), qtype
    except NotImplementedError:                         # no quantizer (IQ*): random bytes, for refusals
        pass
    elements, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, size=(*shape[:-1], shape[-1] // elements * nbytes), dtype=np.uint8), qtype


ExpertTypes = Callable[[int], tuple[Q, Q, Q]]


@dataclass(frozen=True)
class Vocab:
    """A tokenizer as GGUF metadata (llama.cpp's `tokenizer.ggml.*` keys): llama.cpp refuses a file without one,
    and transformers builds `AutoTokenizer.from_pretrained(dir, gguf_file=...)` from it."""

    model: str                                     # "llama" (sentencepiece) or "gpt2" (byte-level BPE)
    tokens: list[str]
    types: list[int]                               # gguf.TokenType values
    merges: list[str] = field(default_factory=list)
    bos: int = 1
    eos: int = 2
    unk: int | None = 0
    pad: int | None = None
    add_bos: bool = True


def stand_in_vocab(size: int) -> Vocab:
    """A sentencepiece vocabulary of `size` made-up tokens (<unk>, <s>, </s>, the 256 byte tokens, then "t0",
    "t1", ...), for files whose prompts are token ids."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"t{i}" for i in range(size - len(tokens))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    return Vocab("llama", tokens, [int(t) for t in types] + [int(gguf.TokenType.NORMAL)] * (size - len(types)))


def byte_level_vocab(tokenizer) -> Vocab:
    """A transformers fast tokenizer over a byte-level BPE model (tests/test_eval_support.py's) as a "gpt2" GGUF
    vocabulary: its tokens in id order, its merges, its special tokens as control tokens."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    special = set(tokenizer.all_special_ids)
    types = [int(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL) for i in range(len(tokens))]
    return Vocab("gpt2", tokens, types, [m if isinstance(m, str) else " ".join(m) for m in merges],
                 bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id, unk=tokenizer.unk_token_id,
                 pad=tokenizer.pad_token_id)


def add_vocab(w: gguf.GGUFWriter, vocab: Vocab) -> None:
    """Write `vocab` as the file's `tokenizer.ggml.*` metadata."""
    w.add_tokenizer_model(vocab.model)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.model == "llama":
        w.add_token_scores([0.0] * len(vocab.tokens))
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    if vocab.unk is not None:
        w.add_unk_token_id(vocab.unk)
    if vocab.pad is not None:
        w.add_pad_token_id(vocab.pad)
    w.add_add_bos_token(vocab.add_bos)


def write_gguf(path: str, arch: str = "qwen3moe", dims: Dims = Dims(), experts: ExpertTypes = lambda b: (Q.Q8_0,) * 3,
               other: Q = Q.Q8_0, split_max_tensors: int = 0, seed: int = 0, quantize: bool = True,
               vocab: Vocab | None = None) -> None:
    """Write a random MoE checkpoint of `arch` ("qwen3moe", "qwen2moe", or "llama" with experts: Mixtral's
    layout) to `path`; `experts(block)` gives the (gate, up, down) types of a block, `other` the type of the
    embeddings, output and attention matrices. `split_max_tensors` writes llama.cpp's split files instead.
    `vocab` adds a tokenizer (of `dims.vocab` tokens); without one the file has none."""
    rng = np.random.default_rng(seed)
    d = dims
    if vocab is not None and len(vocab.tokens) != d.vocab:
        raise ValueError(f"vocab has {len(vocab.tokens)} tokens; the model's vocabulary is dims.vocab={d.vocab}")
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_block_count(d.layers)
    w.add_context_length(512)
    w.add_embedding_length(d.hidden)
    w.add_feed_forward_length(d.expert_width)
    w.add_head_count(d.heads)
    w.add_head_count_kv(d.kv_heads)
    w.add_key_length(d.head_dim)
    w.add_value_length(d.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(d.experts)
    w.add_expert_used_count(d.top_k)
    w.add_expert_feed_forward_length(d.expert_width)
    w.add_vocab_size(d.vocab)
    if vocab is not None:
        add_vocab(w, vocab)

    def add(name: str, shape: tuple[int, ...], qtype: Q, scale: float = 0.05) -> None:
        array, raw = values(shape, qtype, rng, scale, quantize)
        w.add_tensor(name, array, raw_dtype=raw)

    add("token_embd.weight", (d.vocab, d.hidden), other)
    add("output_norm.weight", (d.hidden,), Q.F32, 1.0)
    add("output.weight", (d.vocab, d.hidden), other)
    for b in range(d.layers):
        add(f"blk.{b}.attn_norm.weight", (d.hidden,), Q.F32, 1.0)
        add(f"blk.{b}.attn_q.weight", (d.heads * d.head_dim, d.hidden), other)
        add(f"blk.{b}.attn_k.weight", (d.kv_heads * d.head_dim, d.hidden), other)
        add(f"blk.{b}.attn_v.weight", (d.kv_heads * d.head_dim, d.hidden), other)
        add(f"blk.{b}.attn_output.weight", (d.hidden, d.heads * d.head_dim), other)
        if arch == "qwen3moe":
            add(f"blk.{b}.attn_q_norm.weight", (d.head_dim,), Q.F32, 1.0)
            add(f"blk.{b}.attn_k_norm.weight", (d.head_dim,), Q.F32, 1.0)
        if arch == "qwen2moe":
            for proj in ("q", "k", "v"):
                heads = d.heads if proj == "q" else d.kv_heads
                add(f"blk.{b}.attn_{proj}.bias", (heads * d.head_dim,), Q.F32)
            add(f"blk.{b}.ffn_gate_inp_shexp.weight", (d.hidden,), Q.F32)
            add(f"blk.{b}.ffn_gate_shexp.weight", (d.shared_width, d.hidden), other)
            add(f"blk.{b}.ffn_up_shexp.weight", (d.shared_width, d.hidden), other)
            add(f"blk.{b}.ffn_down_shexp.weight", (d.hidden, d.shared_width), other)
        add(f"blk.{b}.ffn_norm.weight", (d.hidden,), Q.F32, 1.0)
        add(f"blk.{b}.ffn_gate_inp.weight", (d.experts, d.hidden), Q.F32, 0.5)
        gate, up, down = experts(b)
        add(f"blk.{b}.ffn_gate_exps.weight", (d.experts, d.expert_width, d.hidden), gate)
        add(f"blk.{b}.ffn_up_exps.weight", (d.experts, d.expert_width, d.hidden), up)
        add(f"blk.{b}.ffn_down_exps.weight", (d.experts, d.hidden, d.expert_width), down)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# llama.cpp's Q4_K_M: gate/up in Q4_K, down in Q6_K on some blocks and Q4_K on the others.
Q4_K_M: ExpertTypes = lambda b: (Q.Q4_K, Q.Q4_K, Q.Q6_K if b % 2 == 0 else Q.Q4_K)
QWEN2_MOE = Dims(hidden=64, experts=4, layers=2, heads=4, kv_heads=2, head_dim=16, expert_width=1408,
                 shared_width=5632)
