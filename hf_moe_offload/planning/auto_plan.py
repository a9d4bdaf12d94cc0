"""The planner's step of `offload_policy="auto"`: with this machine's cached profile, choose the performance fields
the user left "auto" (`schedule`, `stream_window`) for the policy's job, within the budget the memory rule
(`resolve`) already set. Exact either way: only performance fields change.

The job is `max_batch_size` sequences of `max_seq_len` tokens, half prompt and half new tokens. Without a usable
profile the memory rule's choices stay and one log line says how to get one (`hf-moe-offload profile`).

Example:
    >>> from hf_moe_offload.policy.offload_policy import OffloadPolicy
    >>> from hf_moe_offload.planning.profile import load_profile
    >>> fp = Footprint(expert_bytes=64 * 22020096, slab_bytes=22020096, resident_bytes=181569536, top_k=2,
    ...                kv_bytes_per_token=32768, layer_experts=(8,) * 8)
    >>> given = OffloadPolicy(device="cpu", store="disk", expert_cache="25%", max_batch_size=32, max_seq_len=80)
    >>> done = dataclasses.replace(given, expert_cache=16 * 22020096, stream_window=2)
    >>> planned, summary = plan_for_policy(given, done, fp, load_profile("t4"))   # the T4 machine's host side
    >>> planned.schedule, planned.stream_window in STREAM_WINDOWS, summary["profile"]
    ('auto', True, 'T4')
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..policy.offload_policy import AUTO, DEFAULT_STREAM_WINDOW, OffloadPolicy
from ..runtime.pass_scheduler import is_wide_pass
from .footprint import Footprint
from .measure import format_duration
from .planner import STREAM_WINDOWS, Candidate, ModelShape, predict, runnable_schedules
from .profile import SHIPPED_PROFILES, MachineProfile, ProfileError, default_profile_path, load_profile

logger = logging.getLogger(__name__)

PLANNED_FIELDS = ("schedule", "stream_window")


@dataclass(frozen=True)
class Job:
    """What "auto" plans for: `batch` sequences of `prompt_len` prompt tokens and `gen_len` new ones."""

    batch: int
    prompt_len: int
    gen_len: int

    @classmethod
    def of(cls, resolved: OffloadPolicy) -> "Job":
        seq = int(resolved.max_seq_len)
        return cls(int(resolved.max_batch_size), max(1, seq // 2), max(1, seq - seq // 2))


def shape_from_footprint(fp: Footprint, dtype_bytes: int = 2) -> ModelShape:
    """A `ModelShape` from a `Footprint` alone (what `resolve` has; no config): expert bytes, layers, top-k and
    KV bytes are exact; the rest are documented estimates that only move small terms: the hidden size from an
    expert of Mixtral's proportions (3 x hidden x 3.5 hidden weights), the non-expert weights split evenly over the
    layers plus two more for the embeddings and the LM head, heads of 128.

    Example:
        >>> fp = Footprint(expert_bytes=64 * 22020096, slab_bytes=22020096, resident_bytes=181569536, top_k=2,
        ...                kv_bytes_per_token=32768, layer_experts=(8,) * 8)
        >>> s = shape_from_footprint(fp); s.hidden, s.layers, s.experts
        (1024, 8, 8)
    """
    layers = len(fp.layer_experts) or 1
    experts = max(fp.layer_experts) if fp.layer_experts else max(1, fp.expert_bytes // max(fp.slab_bytes, 1))
    expert_params = fp.slab_bytes / dtype_bytes
    hidden = max(1, round(math.sqrt(expert_params / 10.5)))
    resident_params = fp.resident_bytes // dtype_bytes
    head_dim = min(128, hidden)
    return ModelShape(layers=layers, experts=experts, top_k=fp.top_k, expert_bytes=fp.slab_bytes,
                      dtype_bytes=dtype_bytes, dense_params_per_layer=resident_params // (layers + 2),
                      head_params=resident_params // (layers + 2), heads=max(1, hidden // head_dim),
                      head_dim=head_dim, kv_bytes_per_token=fp.kv_bytes_per_token,
                      activation_bytes_per_token=fp.activation_bytes_per_token, resident_bytes=fp.resident_bytes,
                      hidden=hidden)


def plan_for_policy(policy: OffloadPolicy, resolved: OffloadPolicy, fp: Footprint,
                    profile: MachineProfile | None = None) -> tuple[OffloadPolicy, dict[str, Any] | None]:
    """`resolved` with the planned fields chosen, and the plan's summary for `stats(model)["plan"]` (None when
    no plan was made). `policy` is what the user gave (which fields are "auto"); `resolved` has every field
    concrete. Logs one INFO line: the schedule picked, the predicted tok/s, the binding resource and the profile
    (its file and age when it is this machine's cached one)."""
    free = [f for f in PLANNED_FIELDS if getattr(policy, f) == AUTO]
    if not free:                        # nothing to choose: no profile is needed (nor a word about a missing one)
        return resolved, None
    origin = "" if profile is not None else profile_origin(None)
    profile = _planning_profile(resolved, profile)
    if profile is None:
        return resolved, None
    shape, job = shape_from_footprint(fp, fp.dtype_bytes), Job.of(resolved)
    best = _best_candidate(policy, resolved, shape, profile, free, job, fp.host_store_in_place)
    if best is None:
        return resolved, None
    cand, (pre_tok_s, dec_tok_s, overall, binding) = best
    planned = dataclasses.replace(resolved, **_planned_changes(cand, shape, free, job))
    summary = {"profile": profile.name, "profile_source": profile.source, **_origin_fields(origin),
               "schedule": f"prefill {cand.prefill_schedule}, decode {cand.decode_schedule}",
               "policy_fields": {"schedule": planned.schedule, "stream_window": planned.stream_window},
               "job": dataclasses.asdict(job), "predicted_prefill_tok_s": pre_tok_s,
               "predicted_decode_tok_s": dec_tok_s, "predicted_tok_s": overall, "binding": binding}
    logger.info("hf_moe_offload auto plan: schedule=%s (prefill %s, decode %s) stream_window=%s for batch %d x %d "
                "prompt + %d new tokens; predicted prefill %.1f tok/s, decode %.1f tok/s; bound by %s (profile %s%s)",
                planned.schedule, cand.prefill_schedule, cand.decode_schedule, planned.stream_window, job.batch,
                job.prompt_len, job.gen_len, pre_tok_s, dec_tok_s, binding, profile.name, origin)
    return planned, summary


def profile_origin(spec: str | os.PathLike | None) -> str:
    """Where a profile given as `load_profile(spec)` comes from, as a phrase to append to its name: the cached
    file and its age for this machine's own (`spec` None), the file for a path, nothing for a shipped name.

    Example:
        >>> profile_origin("t4")
        ''
    """
    if spec is not None and str(spec) in SHIPPED_PROFILES:
        return ""
    path = Path(spec) if spec is not None else default_profile_path()
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return ""
    return f", {path}, saved {format_duration(max(age, 0.0))} ago"


def _origin_fields(origin: str) -> dict[str, Any]:
    """The profile file and its age in seconds, for the plan's summary (empty for a profile given in code)."""
    if not origin:
        return {}
    path = default_profile_path()
    try:
        return {"profile_path": str(path), "profile_age_s": round(time.time() - path.stat().st_mtime, 1)}
    except OSError:
        return {}


def _planning_profile(resolved: OffloadPolicy, profile: MachineProfile | None) -> MachineProfile | None:
    """The profile to plan with, reduced to its CPU side for a CPU policy; None (logged) when there is none."""
    if profile is None:
        try:
            profile = load_profile(None)
        except ProfileError as err:
            logger.info("hf_moe_offload auto plan: no usable machine profile (%s); schedule=%s stream_window=%s by "
                        "the memory rule (stream passes expected to touch half a layer's experts, window %d). Run "
                        "`hf-moe-offload profile` once (saved to %s) to let the planner choose",
                        str(err).split(";")[0], resolved.schedule, resolved.stream_window, DEFAULT_STREAM_WINDOW,
                        default_profile_path())
            return None
    on_gpu = str(resolved.device).startswith("cuda")
    if not on_gpu and profile.has_device:   # plan the CPU side of a GPU machine's profile
        return dataclasses.replace(profile, h2d_bytes_per_s=None, device_flops=None, device_memory_bytes=None,
                                   device_memory_bytes_per_s=None, device_name=None)
    if on_gpu and not profile.has_device:
        logger.info("hf_moe_offload auto plan: the cached profile %r has no GPU numbers; schedule and stream_window "
                    "by the memory rule (re-run `hf-moe-offload profile` on this GPU machine)", profile.name)
        return None
    return profile


def _schedule_options(tokens: int, shape: ModelShape, free: list[str], field_value: str) -> tuple[str, ...]:
    """The schedules weighed for a pass of `tokens`: the engine's rule, plus "stream" beside "on_demand" for a
    wide pass when the user left `schedule` to the planner."""
    rule = "stream" if is_wide_pass(tokens, shape.top_k, shape.experts) else "on_demand"
    if "schedule" not in free:
        return (rule,) if field_value == AUTO else (field_value,)
    return ("on_demand", "stream") if rule == "stream" else (rule,)


def _best_candidate(policy: OffloadPolicy, resolved: OffloadPolicy, shape: ModelShape, profile: MachineProfile,
                    free: list[str], job: Job, host_store_in_place: bool = True
                    ) -> tuple[Candidate, tuple[float, float, float, str]] | None:
    """The candidate with the highest predicted tok/s, and its prediction; None if the cache fits none.
    `host_store_in_place`: a CPU store's experts are computed with where they are (`resolve`'s rule; a store kept
    in another form than the one computed with, e.g. packed, feeds cache slots instead)."""
    device = "cuda" if str(resolved.device).startswith("cuda") else "cpu"
    zero_copy = device == "cpu" and resolved.store == "cpu" and host_store_in_place
    share = 1.0 if zero_copy else min(1.0, int(resolved.expert_cache) / max(1, shape.all_expert_bytes))
    slots = int(resolved.expert_cache) // max(1, shape.expert_bytes)
    windows = STREAM_WINDOWS if "stream_window" in free else (int(resolved.stream_window),)
    prompt_tokens = job.batch * job.prompt_len
    best = None
    for pre in _schedule_options(prompt_tokens, shape, free, policy.schedule):
        for dec in _schedule_options(job.batch, shape, free, policy.schedule):
            if not runnable_schedules(shape, pre, dec, prompt_tokens, job.batch):
                continue
            streams = "stream" in (pre, dec)
            for window in (windows if streams else (int(resolved.stream_window),)):
                if streams and not zero_copy and slots < window + shape.top_k:
                    continue   # the cache cannot give the window up and still hold a layer's top-k
                cand = Candidate(pre, dec, share, prompt_tokens, resolved.attention, window)
                result = predict(shape, profile, cand, device, resolved.store, job.batch, job.prompt_len,
                                 job.gen_len)
                if best is None or result[2] > best[1][2]:
                    best = (cand, result)
    return best


def _planned_changes(cand: Candidate, shape: ModelShape, free: list[str], job: Job) -> dict[str, Any]:
    """The policy fields the plan sets: `schedule` only where it departs from the engine's own per-pass rule
    (and is the same for both phases), `stream_window` only for a plan that streams."""
    changes: dict[str, Any] = {}
    if "schedule" in free:
        rule = {n: "stream" if is_wide_pass(n, shape.top_k, shape.experts) else "on_demand"
                for n in (job.batch * job.prompt_len, job.batch)}
        follows_rule = (cand.prefill_schedule == rule[job.batch * job.prompt_len]
                        and cand.decode_schedule == rule[job.batch])
        if not follows_rule and cand.prefill_schedule == cand.decode_schedule:
            changes["schedule"] = cand.prefill_schedule
    if "stream_window" in free and "stream" in (cand.prefill_schedule, cand.decode_schedule):
        changes["stream_window"] = cand.stream_window
    return changes
