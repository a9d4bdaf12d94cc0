"""llama.cpp (llama-cpp-python) as a benchmark peer: greedy decode of a batch of token-id prompts, one sequence per
KV-cache stream, every step timed with the disk bytes it made the process read (/proc/self/io).

Batch 1 is what `bench_cpu_kernels.llama_decode` runs through the high-level `Llama.eval`; a batch of B sequences
needs llama.cpp's own batch API (one token per sequence per `llama_decode` call), which the high-level class does
not expose, so this module builds its own context (n_seq_max = B) on the loaded model.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

import numpy as np

from bench import proc_read_bytes   # /proc/self/io: page faults of an mmap count too


def load(gguf: str, threads: int, mmap: bool = True):
    """The GGUF's model; the high-level object only owns the weights here (contexts are made per batch)."""
    from llama_cpp import Llama

    return Llama(gguf, n_threads=threads, n_threads_batch=threads, n_ctx=256, n_batch=64, use_mmap=mmap,
                 verbose=False)


def _context(llm, batch: int, seq_len: int, threads: int):
    import llama_cpp
    from llama_cpp import _internals as internals

    params = llama_cpp.llama_context_default_params()
    params.n_ctx = batch * 256 * math.ceil((seq_len + 16) / 256)   # split evenly between the sequences
    params.n_batch = params.n_ubatch = max(64, batch * seq_len)
    params.n_seq_max = batch
    params.n_threads = params.n_threads_batch = threads
    return internals.LlamaContext(model=llm._model, params=params, verbose=False), internals


def _fill(b, rows: list[tuple[int, int, int, bool]]) -> None:
    """(token, position, sequence, wants logits) per entry of the llama_batch `b`."""
    b.batch.n_tokens = len(rows)
    for j, (token, pos, seq, logits) in enumerate(rows):
        b.batch.token[j], b.batch.pos[j] = token, pos
        b.batch.seq_id[j][0], b.batch.n_seq_id[j], b.batch.logits[j] = seq, 1, logits


def _argmax(ctx, j: int, vocab: int) -> int:
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(ctx.ctx, j)
    return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(vocab,))))


def decode(llm, prompts: list[list[int]], new_tokens: int, threads: int) -> dict[str, Any]:
    """Greedy decode of every prompt (equal lengths) as one batch: the whole prompt batch in one call, then one
    call per step with one token per sequence. Per step after the first token: seconds and bytes read."""
    batch, length = len(prompts), len(prompts[0])
    vocab = llm.n_vocab()
    ctx, internals = _context(llm, batch, length + new_tokens, threads)
    b = internals.LlamaBatch(n_tokens=max(64, batch * length), embd=0, n_seq_max=batch, verbose=False)
    try:
        _fill(b, [(t, i, s, i == length - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)])
        ctx.decode(b)
        last = [_argmax(ctx, s * length + length - 1, vocab) for s in range(batch)]
        tokens = [[t] for t in last]
        stamps, reads = [time.perf_counter()], [proc_read_bytes()]
        for step in range(new_tokens - 1):
            _fill(b, [(last[s], length + step, s, True) for s in range(batch)])
            ctx.decode(b)
            last = [_argmax(ctx, s, vocab) for s in range(batch)]
            for s in range(batch):
                tokens[s].append(last[s])
            stamps.append(time.perf_counter())
            reads.append(proc_read_bytes())
    finally:
        b.close()
        ctx.close()
    steps = len(stamps) - 1
    return {"decode_step_s": [b1 - a for a, b1 in itertools.pairwise(stamps)],
            "decode_step_read_bytes": [b1 - a for a, b1 in itertools.pairwise(reads)],
            "decode_s": stamps[-1] - stamps[0], "decode_steps": steps, "decode_tokens": batch * steps,
            "tokens": tokens}
