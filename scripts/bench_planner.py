"""The planner's prediction beside a measured benchmark row: decode tok/s from `hf_moe_offload.planning.planner.predict`
for the row's model shape, store, resident expert share and batch, with a machine profile whose disk rate is the one
measured in the same run (the shared disk's rate varies between runs).

Rows the planner does not model (accelerate, llama.cpp) get None.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("bench_planner")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE = REPO_ROOT / "benchmarks" / "results" / "profile_cpu_1thread.json"


def base_profile(spec: str | None, threads: int) -> tuple[Any, str]:
    """(profile, where it came from): a file, or "measure" to profile this machine now at `threads` threads
    (the demo model's framework overhead left out: it needs the demo checkpoint)."""
    from hf_moe_offload.planning.profile import MachineProfile

    if spec and spec != "measure":
        path = Path(spec).resolve()
        return MachineProfile.load(path), str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)
    import torch

    from hf_moe_offload.planning.measure import measure

    old = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        profile = measure(disk_piece_bytes=16 << 20, disk_pieces=8, seconds_per_kernel=0.2, device="cpu")
    finally:
        torch.set_num_threads(old)
    return profile, "measured at the start of this run"


def with_disk_rate(profile: Any, disk_bytes_per_s: float | None) -> Any:
    from hf_moe_offload.planning.profile import MachineProfile

    if not disk_bytes_per_s:
        return profile
    return MachineProfile.from_dict({**profile.to_dict(), "disk_read_bytes_per_s": disk_bytes_per_s})


def planner_shape(shape: Any) -> Any:
    """The planner's view of bench.py's `ModelShape` (a meta skeleton measured as the loader measures it)."""
    import torch
    from bench import mixtral_config

    from hf_moe_offload.planning.planner import ModelShape

    return ModelShape.from_config(mixtral_config(shape), torch.bfloat16)


def unpatched(profile: Any) -> Any:
    """`profile` as transformers' own model (or ours with the CPU kernels off) runs: every product through
    `F.linear`, none through a prepacked copy."""
    import dataclasses

    return dataclasses.replace(profile, cpu_expert_flops_bf16_packed=None)


def predict_decode(pshape: Any, profile: Any, store: str, share: float, batch: int, prompt_len: int,
                   new_tokens: int, read_bytes_per_token: float | None = None) -> float:
    """Predicted decode tok/s of an hf_moe_offload (or resident: store "cpu", share 1) row. `read_bytes_per_token`:
    the row's measured store reads per decode token, in place of uniform routing's estimate."""
    from hf_moe_offload.planning.planner import Candidate, predict
    from hf_moe_offload.runtime.pass_scheduler import is_wide_pass

    def schedule(tokens: int) -> str:
        return "stream" if is_wide_pass(tokens, pshape.top_k, pshape.experts) else "on_demand"

    cand = Candidate(schedule(batch * prompt_len), schedule(batch), min(1.0, share), batch * prompt_len, "device")
    _pre, dec, _overall, _binding = predict(pshape, profile, cand, "cpu", store, batch, prompt_len, new_tokens,
                                            read_bytes=(None, read_bytes_per_token))
    return dec


def row_prediction(pshape: Any, profile: Any, row: dict[str, Any], prompt_len: int, new_tokens: int
                   ) -> dict[str, float | None]:
    """`planner_tok_s` (uniform routing) and `planner_measured_bytes_tok_s` (the row's own reads per token) for a
    bench.py-style row; None for systems the planner does not model (peers, quantized experts) or rows that
    failed."""
    system = row.get("system", "")
    quantized = (row.get("policy") or {}).get("quantize", "none") != "none"
    if "error" in row or quantized or not (system == "resident" or system.startswith(("hf_moe_offload", "ours"))):
        return {"planner_tok_s": None, "planner_measured_bytes_tok_s": None}
    batch = row["batch"]
    if system == "resident" or row.get("store") == "cpu":
        dec = predict_decode(pshape, unpatched(profile) if system == "resident" else profile, "cpu", 1.0, batch,
                             prompt_len, new_tokens)
        return {"planner_tok_s": dec, "planner_measured_bytes_tok_s": dec}
    ours = row.get("ours") or {}
    share = (ours.get("cache_capacity_bytes") or 0) / pshape.all_expert_bytes
    return {"planner_tok_s": predict_decode(pshape, profile, "disk", share, batch, prompt_len, new_tokens),
            "planner_measured_bytes_tok_s": predict_decode(pshape, profile, "disk", share, batch, prompt_len,
                                                           new_tokens, row.get("read_bytes_per_token"))}
