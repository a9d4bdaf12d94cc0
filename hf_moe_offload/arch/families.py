"""The table of families hf_moe_offload knows (supported or refused), from the registered adapters and the fused
families discovered in the installed transformers; the README's table is generated from it."""

from __future__ import annotations

from .base import registered_archs
from .fused import FusedExpertsArch, discover_families


def supported_families() -> list[dict[str, str]]:
    """One row per model type hf_moe_offload knows, supported or refused: `model_type`, `experts` (the experts
    class), `checkpoint` (how its experts are found in a Hub checkpoint), `status` ("supported", or "refused: why").
    The README's table of families is generated from it.

    Example:
        >>> rows = supported_families()
        >>> next(r for r in rows if r["model_type"] == "mixtral")["checkpoint"]
        'per expert: w1, w3, w2'
    """
    rows = []
    for family in discover_families().values():
        if family.fused_renames:
            where = "fused: " + ", ".join(old.removesuffix(".weight").rsplit(".", 1)[-1]
                                          for old, _ in family.fused_renames)
        elif family.expert_names:
            where = "per expert: " + ", ".join(family.expert_names)
        else:
            where = "fused, or per expert gate_proj/up_proj/down_proj or w1/w3/w2"
        rows.append({"model_type": family.model_type, "experts": ", ".join(family.experts_classes),
                     "checkpoint": where, "status": "supported" if family.supported else f"refused: {family.refused}"})
    for arch in registered_archs():
        if not isinstance(arch, FusedExpertsArch):
            rows += [{"model_type": t, "experts": "own adapter (" + type(arch).__name__ + ")",
                      "checkpoint": getattr(arch, "checkpoint_note", "per expert"), "status": "supported"}
                     for t in arch.model_types]
    return sorted(rows, key=lambda r: r["model_type"])


def families_markdown() -> str:
    """The README's table of families (`supported_families()` as Markdown); tests check the README matches it.

    Example:
        >>> print(families_markdown().splitlines()[0])
        | model type | experts class | experts in a Hub checkpoint | status |
    """
    lines = ["| model type | experts class | experts in a Hub checkpoint | status |", "|---|---|---|---|"]
    lines += [f"| `{r['model_type']}` | {r['experts']} | {r['checkpoint']} | {r['status']} |"
              for r in supported_families()]
    return "\n".join(lines)
