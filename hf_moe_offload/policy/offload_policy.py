"""`OffloadPolicy`: what runs where, validated before anything is allocated.

A policy is given as an `OffloadPolicy`, a dict of its fields, or a preset name (``"auto"``, ``"low-ram"``).
Fields left at ``"auto"`` are resolved against the model and the machine by `hf_moe_offload.planning.resolve`.

Example:
    >>> from hf_moe_offload import OffloadPolicy
    >>> OffloadPolicy.from_any({"device": "cpu", "store": "disk", "expert_cache": "512MiB"}).expert_cache
    '512MiB'
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Mapping

import torch

logger = logging.getLogger(__name__)

AUTO = "auto"
STORES = ("cpu", "disk")
DISK_READS = ("auto", "buffered", "direct")   # expert reads through the page cache, or around it (O_DIRECT)
EVICTIONS = ("lru", "lfu", "layer", "lookahead")
PREFETCHERS = ("auto", "none", "hash", "lookahead")
QUANTIZATIONS = ("none", "int8", "int4")
EXPERT_COMPUTES = ("device", "cpu", "auto")
EMBEDDINGS = ("auto", "memory", "mapped")   # the input embedding table loaded, or mapped from its file
ATTENTIONS = ("auto", "device", "cpu")   # where attention runs and the KV cache lives (hf_moe_offload.attention.cpu)
DEFAULT_INT4_GROUP_SIZE = 64     # quant_group_size="auto" for int4 (int8 is scaled per output channel)
ROUTINGS = ("router", "predicted")
SCHEDULES = ("auto", "on_demand", "stream")
DEFAULT_STREAM_WINDOW = 2        # stream_window="auto"
# stream_window="auto" on the CPU without a planned window: a streamed pass with at least WIDE_WINDOW_ROWS rows per
# expert (tokens x top_k / experts) gets WIDE_STREAM_WINDOW slots. Its experts compute long enough for the disk to idle
# behind a narrow window, while a pass of few rows per expert is read-bound and pays only the window's extra bytes.
WIDE_STREAM_WINDOW = 4
WIDE_WINDOW_ROWS = 8
DEFAULT_MAX_BATCH_SIZE = 1       # max_batch_size="auto"
DEFAULT_MAX_SEQ_LEN = 4096       # max_seq_len="auto" caps the model's max_position_embeddings at this
# Upper bounds of the workload hints: above them the KV cache alone is more than any machine holds, and the budget
# rule would only report an expert cache of 0 B. Models' contexts reach about ten million tokens.
MAX_BATCH_SIZE = 1 << 16
MAX_SEQ_LEN = 1 << 24
# A size given as a bare number string below this is probably a forgotten "%" or unit ("25" meant "25%"): warned.
BARE_SIZE_FLOOR = 1 << 20

# Preset name -> field overrides applied on top of the defaults (every default is "auto" or a safe choice).
PRESETS: dict[str, dict[str, Any]] = {
    "auto": {},
    # Experts never all in host memory: read per expert from the checkpoint files.
    "low-ram": {"store": "disk"},
}

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
# Digits only, no exponent: a string's value then has at most as many digits as the string, so exact arithmetic
# on it stays cheap ("1e999999999" would be a billion-digit integer).
_NUMBER = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_SIZE_RE = re.compile(rf"^\s*({_NUMBER})\s*([a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(rf"^\s*({_NUMBER})\s*%\s*$")
_NON_FINITE = ("nan", "inf", "infinity")
@dataclass(frozen=True)
class SizeField:
    """What a size names, for `parse_size`'s errors: the field, what a share is of (None: no share), and whether
    "auto" is allowed."""

    name: str = "expert_cache"
    share_of: str | None = "all expert bytes"
    auto: bool = True

    def allowed(self) -> str:
        share = f", a share of {self.share_of} from '0%' to '100%'" if self.share_of else ""
        auto = ", or 'auto'" if self.auto else ""
        return (f"allowed: a whole number of bytes >= 0 (an int), a size such as '512MiB', '6GiB' or '1.5GB' "
                f"(rounded down to whole bytes){share}{auto}")


EXPERT_CACHE = SizeField()


def _quoted(*names: str) -> str:
    """Allowed names as the docs show them (the policy table's "values" column)."""
    return ", ".join(f'"{name}"' for name in names)


def did_you_mean(value: Any, allowed: "list[str] | tuple[str, ...]") -> str:
    """'; did you mean "x"?' for a string close to one of `allowed` (the end of an error message), else "".

    Example:
        >>> did_you_mean("disc", ["cpu", "disk"]), did_you_mean("gpu", ["cpu", "device"])
        ('; did you mean "disk"?', '')
    """
    if not isinstance(value, str):
        return ""
    # 0.7: one letter off in a short name ("disc", "atuo"), but not "gpu" for "cpu" (a GPU is "device")
    close = difflib.get_close_matches(value.strip().lower(), [str(a) for a in allowed], n=1, cutoff=0.7)
    return f'; did you mean "{close[0]}"?' if close else ""


class PolicyError(ValueError):
    """A policy key, name or value is not allowed; the message lists what is."""


@dataclass
class OffloadPolicy:
    """Where the model's parts live and how experts move.

    Example:
        >>> p = OffloadPolicy(device="cpu", store="disk", expert_cache="1GiB", eviction="lfu")
        >>> p.validate().eviction
        'lfu'
    """

    device: str = field(
        default=AUTO,
        metadata={"short": "Where non-expert weights live and compute runs; auto: the first CUDA GPU, else CPU",
                  "values": _quoted(AUTO, "cpu", "cuda:N"),
                  "help": 'Where non-expert weights live and compute runs: "cuda:N", "cpu" or "auto" '
                          "(the first CUDA GPU, else the CPU)."},
    )
    store: str = field(
        default=AUTO,
        metadata={"short": "Experts in (pinned) host memory, or read per expert from the checkpoint's files",
                  "values": _quoted(AUTO, *STORES),
                  "help": '"cpu": experts in host memory (pinned when the device is CUDA); "disk": experts stay in '
                          'the checkpoint\'s safetensors files and are read per expert on demand; "auto".'},
    )
    disk_reads: str = field(
        default=AUTO,
        metadata={"short": "Expert reads through the page cache or around it; auto: around it where RAM cannot "
                           "keep them",
                  "values": _quoted(*DISK_READS),
                  "help": 'How experts are read from files (store="disk", and the host store\'s load): "buffered" '
                          '(through the page cache: an expert read again soon after comes from RAM), "direct" '
                          "(O_DIRECT, around the page cache: nothing is left behind, so a container's memory limit, "
                          "which counts the page cache, is spent on the expert cache instead, and the kernel never "
                          'reclaims the process\'s own pages for it; a file system without O_DIRECT reads buffered), '
                          'or "auto" (direct where the host memory left beside the expert cache, within a '
                          "container's limit, cannot hold the experts, so their pages would be evicted before their "
                          "next use and a buffered read would only add the kernel's copy; else buffered)."},
    )
    expert_cache: int | str = field(
        default=AUTO,
        metadata={"short": "Device bytes for resident experts; auto: what is left after the rest and the KV cache",
                  "values": 'bytes, "6GiB", "25%", "auto"',
                  "help": 'Device bytes for resident experts: an int, a size ("512MiB", "6GiB"), a share of all '
                          'expert bytes ("25%", at most "100%"), or "auto" (device memory left after the resident '
                          'part, the KV cache and activations; see max_batch_size, max_seq_len). A size above all '
                          'expert bytes is capped to them. With device and store on the CPU, experts are used in '
                          'place and a budget below 100% is refused (use store="disk"); a GGUF, GPTQ, AWQ or '
                          'compressed-tensors checkpoint\'s experts are not: the cache holds them dequantized, '
                          'and the budget counts those dense bytes. A bare number string '
                          'below 1 MiB ("25": bytes) logs a warning that a share needs "%" ("25%").'},
    )
    eviction: str = field(
        default="layer",
        metadata={"short": "Which resident expert leaves when a slot is needed",
                  "values": _quoted(*EVICTIONS),
                  "help": 'Which resident expert leaves when a slot is needed: "lru", "lfu", "layer" (the one '
                          "whose layer comes up last in the forward order, sparing experts its router chose in the "
                          "last passes, as many as the cache holds, while another is idle; best when decode cycles "
                          "through layers), "
                          'or "lookahead" (the one whose next use is predicted furthest away: the next routers '
                          "applied to the current input for this pass, the last step's routing for the next). "
                          "Streamed passes always evict in forward order."},
    )
    prefetch: str = field(
        default=AUTO,
        metadata={"short": "Read experts ahead: router look-ahead (auto: while it pays) or a hash predictor",
                  "values": _quoted(*PREFETCHERS),
                  "help": '"auto" (default): in few-token passes, read the next layer\'s router look-ahead guesses '
                          "ahead only while their measured precision is above the break-even (wasted reads cost "
                          'bytes); "none"; "hash": a SiDA hash predictor (see `predictor`) names each layer\'s experts '
                          'before the forward reaches it, and they are loaded ahead; "lookahead": always read the '
                          "next layer's router guesses (its top-k on this layer's input) while this layer computes. "
                          "Streamed passes always read ahead. Exact: the router still decides."},
    )
    predictor: str | None = field(
        default=None,
        metadata={"short": "A predictor trained by `hf-moe-offload train-hash`, for prefetch='hash'",
                  "values": 'a directory or Hub repo id',
                  "help": "A directory or Hub repo id of a predictor trained by `hf-moe-offload train-hash` "
                          "(needed by prefetch='hash' and routing='predicted')."},
    )
    routing: str = field(
        default="router",
        metadata={"short": "predicted: the predictor's experts replace the router (SiDA; approximate)",
                  "values": _quoted(*ROUTINGS),
                  "help": '"router" (exact), or "predicted": SiDA\'s serving mode, the predictor\'s experts and '
                          "scale factors replace the router (approximate, opt-in)."},
    )
    max_batch_size: int | str = field(
        default=AUTO,
        metadata={"short": "Hint for expert_cache='auto': sequences run at once; auto: 1",
                  "values": f'"auto", an int from 1 to {MAX_BATCH_SIZE}',
                  "help": 'Most sequences run at once (generate batch), a hint for expert_cache="auto": the device '
                          'memory left to the KV cache and activations grows with it; "auto": 1.'},
    )
    max_seq_len: int | str = field(
        default=AUTO,
        metadata={"short": "Hint for expert_cache='auto': longest prompt + new tokens",
                  "values": f'"auto", an int from 1 to {MAX_SEQ_LEN}',
                  "help": 'Longest sequence (prompt + new tokens), a hint for expert_cache="auto" like '
                          'max_batch_size; "auto": the model\'s max_position_embeddings, at most '
                          f'{DEFAULT_MAX_SEQ_LEN}.'},
    )

    schedule: str = field(
        default=AUTO,
        metadata={"short": "Per pass: fetch routed experts on demand, or stream them in forward order",
                  "values": _quoted(*SCHEDULES),
                  "help": 'How a forward pass brings its experts: "on_demand" (each layer fetches what its router '
                          'picked), "stream" (forward order through a small window of slots, the next layer read '
                          'ahead, the rest of the cache a stable resident set), or "auto": stream the passes expected '
                          "to touch at least half of a layer's experts (prefill, batches of 8+). Exact either way."},
    )
    stream_window: int | str = field(
        default=AUTO,
        metadata={"short": f"Slots a streamed layer may have loading at once; auto: {DEFAULT_STREAM_WINDOW}, on the CPU "
                           f"{WIDE_STREAM_WINDOW} for large batches",
                  "values": '"auto", an int >= 1',
                  "help": "Slots a streamed layer may have loading or landed-unused at once (the rest keep resident "
                          f'experts); "auto": the planner\'s choice where a machine profile is cached, else '
                          f"{DEFAULT_STREAM_WINDOW}, and on the CPU {WIDE_STREAM_WINDOW} for a pass with at least "
                          f"{WIDE_WINDOW_ROWS} rows per expert (tokens x top_k / experts: a large batch), whose "
                          "experts compute long enough for the disk to idle behind a narrow window."},
    )
    micro_batches: int | str = field(
        default=AUTO,
        metadata={"short": "Slices per layer call, each expert read once for all of them; auto: 1 (off)",
                  "values": '"auto", an int >= 1',
                  "help": "Each decoder layer with offloaded experts runs its batch as this many slices, one after "
                          "the other, and keeps the layer's experts on the device until the last slice has used "
                          "them: every expert is read once per pass and serves every slice (FlexGen's zig-zag, "
                          "Klotski's multi-batch, MoE-Lightning's CGOPipe). On a GPU with attention='cpu', one "
                          "slice's CPU attention runs while the device computes the previous slice's experts. "
                          "Needs a cache holding one layer's experts (a smaller resident set: more bytes per pass). "
                          "A slice's matmuls have fewer rows, which the BLAS may round differently (float32 "
                          "logits within about 1e-7 on the CPU; more on a GPU's cuBLAS), so near-tied greedy tokens "
                          "can differ from the whole batch's. \"auto\": 1 "
                          "(off): where measured on a GPU, two slices were slower than one."},
    )

    quantize: str = field(
        default="none",
        metadata={"short": "Experts stored, moved and computed as int8 or int4 (approximate, opt-in)",
                  "values": _quoted(*QUANTIZATIONS),
                  "help": 'Experts stored, moved and computed quantized (approximate, opt-in): "none" (exact), '
                          '"int8" (one scale per output channel) or "int4" (one scale and zero per group of '
                          "quant_group_size input weights). Fewer bytes per expert: more experts fit the cache and "
                          "each miss reads less."},
    )
    quant_group_size: int | str = field(
        default=AUTO,
        metadata={"short": "int4 input weights per scale and zero; auto: " f"{DEFAULT_INT4_GROUP_SIZE}",
                  "values": '"auto", 32, 64, 128, 256',
                  "help": f'Input weights sharing one int4 scale: 32, 64, 128 or 256; "auto": '
                          f"{DEFAULT_INT4_GROUP_SIZE}."},
    )
    expert_compute: str = field(
        default="device",
        metadata={"short": "Where a non-resident expert computes: copied to the device, or on the CPU",
                  "values": _quoted(*EXPERT_COMPUTES),
                  "help": 'Where an expert that is not resident on the device computes: "device" (copy it there), '
                          '"cpu" (compute it from the host copy, only the tokens move; Fiddler, llama.cpp '
                          '--cpu-moe) or "auto" (per expert and step, whichever the measured bandwidth and CPU '
                          "throughput say is faster: few tokens on the CPU, many copied)."},
    )
    attention: str = field(
        default=AUTO,
        metadata={"short": "Where attention runs and the KV cache lives; auto: cpu when the KV cache won't fit",
                  "values": _quoted(*ATTENTIONS),
                  "help": 'Where attention runs and its KV cache lives: "device" (the model\'s own attention '
                          'implementation, KV cache on the device), "cpu" (MoE-Lightning, FlexGen: keys and values '
                          "in (pinned) host memory, attention on the CPU, only the query and output cross PCIe; the "
                          "batch is then limited by host memory, not device memory; decoder-only models whose "
                          "attention transformers' sdpa runs (not GPT-OSS's sinks); "
                          'generate_batch is refused with it; exact within float tolerance) or "auto" (default: '
                          '"cpu" on a GPU when the KV cache of max_batch_size x max_seq_len does not fit the device '
                          'beside the resident part and the expert cache, else "device").'},
    )
    embedding: str = field(
        default=AUTO,
        metadata={"short": "The input embedding table in memory, or mapped from its file; auto: mapped on the CPU",
                  "values": _quoted(*EMBEDDINGS),
                  "help": 'Where the input embedding table lives: "memory" (loaded, as transformers does), "mapped" '
                          "(read in place from the checkpoint's safetensors file through a memory map: a token "
                          "costs only its own row's pages, so the table's memory goes to the expert cache; the CPU "
                          "device without a device_map, a table not tied to the output layer and stored at the "
                          "model's dtype, files transformers would map too (not with from_pretrained(disable_mmap="
                          'True), not on hf-mount); refused with the reason otherwise) or "auto" (mapped where it '
                          'can be, else in memory).'},
    )
    resident_layers: int | str = field(
        default=0,
        metadata={"short": "Experts of the first N MoE layers stay on the device, never evicted",
                  "values": 'an int >= 0',
                  "help": "The experts of the first N MoE layers stay on the device for the whole run and are "
                          "never evicted (llama.cpp's split; with expert_compute='cpu' the other layers compute on "
                          "the CPU); 0: none."},
    )

    @classmethod
    def from_any(cls, value: "OffloadPolicy | Mapping[str, Any] | str | None") -> "OffloadPolicy":
        """Build a validated policy from a policy, a dict of fields, a preset name, or a JSON object string."""
        if value is None:
            value = AUTO
        if isinstance(value, OffloadPolicy):
            return dataclasses.replace(value).validate()
        if isinstance(value, str):
            value = policy_value(value)
        if isinstance(value, str):
            if value not in PRESETS:
                raise PolicyError(f"unknown offload_policy preset {value!r}; allowed presets: {sorted(PRESETS)}, "
                                  f"or a dict with keys {field_names()}, or an OffloadPolicy"
                                  f"{did_you_mean(value, sorted(PRESETS))}")
            return cls(**PRESETS[value]).validate()
        if isinstance(value, Mapping):
            unknown = sorted((k for k in value if k not in field_names()), key=str)
            if unknown:
                hints = "".join(f"; {k!r}: {hint[2:]}" for k in unknown if (hint := did_you_mean(k, field_names())))
                raise PolicyError(f"unknown offload_policy key(s) {unknown}; allowed keys: {field_names()}{hints}")
            return cls(**dict(value)).validate()
        raise PolicyError(f"offload_policy must be an OffloadPolicy, a dict or a preset name {sorted(PRESETS)}, "
                          f"not {type(value).__name__}")

    def validate(self) -> "OffloadPolicy":
        """Check every field's type and value (not yet against the machine or the model); return self."""
        if self.device != AUTO:
            self.device = str(normalize_device(self.device))
        for name, allowed in _CHOICES.items():
            _check_choice(name, getattr(self, name), allowed)
        if self.expert_cache != AUTO:
            _warn_bare_size(self.expert_cache, parse_size(self.expert_cache, total=1))   # raises if malformed
        for name in ("max_batch_size", "max_seq_len", "stream_window", "micro_batches"):
            setattr(self, name, parse_count(name, getattr(self, name)))
        self.quant_group_size = parse_count("quant_group_size", self.quant_group_size)
        if self.quant_group_size not in (AUTO, 32, 64, 128, 256):
            raise PolicyError(f"quant_group_size={self.quant_group_size!r} is not allowed; allowed: 32, 64, 128, "
                              f"256 or 'auto' ({DEFAULT_INT4_GROUP_SIZE})")
        layers = self.resident_layers
        if isinstance(layers, str) and re.fullmatch(r"\s*[0-9]+\s*", layers):
            layers = int(layers)
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
            raise PolicyError(f"resident_layers={self.resident_layers!r} is not allowed; allowed: a whole number "
                              f">= 0 (0: no layer's experts pinned on the device)")
        self.resident_layers = layers
        if self.predictor is not None and not isinstance(self.predictor, (str, os.PathLike)):
            raise PolicyError(f"predictor={self.predictor!r} has type {type(self.predictor).__name__}; allowed: a "
                              f"directory (a string or path) or a Hub repo id 'owner/name', or None")
        if isinstance(self.predictor, os.PathLike):
            self.predictor = os.fspath(self.predictor)
        self._check_combinations()
        return self

    def _check_combinations(self) -> None:
        """Fields that cannot run together: a predictor's modes need one, and whole-batch predictions."""
        needs_predictor = [f"{name}={value!r}" for name, value in (("prefetch", self.prefetch),
                                                                  ("routing", self.routing))
                           if value in ("hash", "predicted")]
        if self.micro_batches not in (AUTO, 1) and needs_predictor:
            raise PolicyError(f"micro_batches={self.micro_batches} cannot run with {' and '.join(needs_predictor)}: "
                              f"the predictor names experts for the whole batch's tokens, a micro-batch holds some "
                              f"of them; use micro_batches=1")
        if needs_predictor and not self.predictor:
            raise PolicyError(f"{' and '.join(needs_predictor)} needs a predictor: set predictor= to the directory "
                              f"`hf-moe-offload train-hash` wrote, or a Hub repo id holding one")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The fields whose value is one of a few names (device is parsed by `normalize_device`).
_CHOICES: dict[str, tuple[str, ...]] = {
    "store": (AUTO, *STORES), "disk_reads": DISK_READS, "eviction": EVICTIONS, "prefetch": PREFETCHERS,
    "routing": ROUTINGS, "schedule": SCHEDULES, "quantize": QUANTIZATIONS, "expert_compute": EXPERT_COMPUTES,
    "attention": ATTENTIONS, "embedding": EMBEDDINGS,
}


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    """Refuse a value of `name` that is not one of `allowed`: another type, or a name (with the closest one)."""
    if not isinstance(value, str):
        raise PolicyError(f"{name}={value!r} has type {type(value).__name__}, not a name; allowed: {list(allowed)}")
    if value not in allowed:
        raise PolicyError(f"{name}={value!r} is not allowed; allowed: {list(allowed)}{did_you_mean(value, allowed)}")


def policy_value(text: str) -> str | dict[str, Any]:
    """A policy given as text (a command line, lm-eval's model arguments): a JSON object becomes a dict of fields,
    anything else is a preset name. The one place policy strings are parsed.

    Example:
        >>> policy_value(' {"store": "disk"} '), policy_value("low-ram")
        ({'store': 'disk'}, 'low-ram')
    """
    text = text.strip()
    if not text.startswith("{"):
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise PolicyError(f"offload policy {text!r} is not valid JSON ({err}); allowed: a preset name "
                          f"{sorted(PRESETS)} or a JSON object with keys {field_names()}") from None
    if not isinstance(value, dict):
        raise PolicyError(f"offload policy {text!r} is not a JSON object; allowed keys: {field_names()}")
    return value


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(OffloadPolicy)]


def normalize_device(device: str | int | torch.device) -> torch.device:
    """Parse a device and check that it exists on this machine."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise PolicyError(f"device={device!r} has type {type(device).__name__}; allowed: 'cpu', 'cuda:N' or 'auto'")
    try:
        dev = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    except (RuntimeError, TypeError) as err:
        raise PolicyError(f"device={device!r} is not a device; allowed: 'cpu', 'cuda:N' or 'auto'") from err
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise PolicyError(f"device={device!r} is not supported; allowed: 'cpu', 'cuda:N' or 'auto'")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = 0 if dev.index is None else dev.index
    if index >= count:
        have = f"cuda:0..cuda:{count - 1}" if count else "no CUDA device"
        raise PolicyError(f"device={device!r} does not exist on this machine ({have}); allowed: 'cpu'"
                          + (f", {have}" if count else "") + " or 'auto'")
    return torch.device("cuda", index)


def parse_size(value: int | float | str, total: int, size_of: SizeField = EXPERT_CACHE) -> int:
    """Whole bytes from an int, a size string, or a percentage of `total`; exact for any magnitude.

    A bare number of bytes must be whole (an int, an integral float, "1234"); a size with a unit is rounded down
    to whole bytes. A share must lie between 0% and 100%. Sizes larger than what exists are returned as given (the
    caller caps them). `size_of`: what the size is for, which the errors name (default: `expert_cache`).

    Example:
        >>> parse_size("1.5GB", 0), parse_size("25%", 400), parse_size("1" + "0" * 30, 0)
        (1500000000, 100, 1000000000000000000000000000000)
    """
    if isinstance(value, bool):       # bool is an int subclass: True would silently mean 1 byte
        raise _size_error(value, "is a bool, not a size", size_of)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _size_error(value, "is not a finite number", size_of)
        return _whole_bytes(value, Fraction(value), False, size_of)
    if isinstance(value, int):
        return _whole_bytes(value, Fraction(value), False, size_of)
    if isinstance(value, str):
        if value.strip().lower().lstrip("+-") in _NON_FINITE:
            raise _size_error(value, "is not a finite number", size_of)
        pct = _PERCENT_RE.match(value)
        if pct and size_of.share_of:
            return _share(value, Fraction(pct.group(1)), total, size_of)
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            unit = _UNITS[m.group(2).lower()]
            return _whole_bytes(value, Fraction(m.group(1)) * unit, unit > 1, size_of)
    if isinstance(value, str):
        hint = did_you_mean(value, [AUTO]) if size_of.auto else ""
        raise PolicyError(f"{size_of.name}={value!r} is not a size; {size_of.allowed()}{hint}")
    raise _size_error(value, f"has type {type(value).__name__}, not a size", size_of)


def _whole_bytes(value: Any, amount: Fraction, rounded: bool, size_of: SizeField) -> int:
    """`amount` as whole bytes: negative is refused; a fraction is rounded down only when a unit was given."""
    if amount < 0:
        raise _size_error(value, "is negative", size_of)
    if not rounded and amount.denominator != 1:
        raise _size_error(value, "is not a whole number of bytes", size_of)
    return math.floor(amount)


def _share(value: str, percent: Fraction, total: int, size_of: SizeField) -> int:
    """`percent` of `total` bytes, rounded down; a share outside 0%..100% is refused rather than capped."""
    if not 0 <= percent <= 100:
        raise PolicyError(f"{size_of.name}={value!r} is outside 0%..100%: a share is of {size_of.share_of}; "
                          f"{size_of.allowed()}")
    return math.floor(total * percent / 100)


def _size_error(value: Any, reason: str, size_of: SizeField) -> PolicyError:
    return PolicyError(f"{size_of.name}={value!r} {reason}; {size_of.allowed()}")


def _warn_bare_size(value: Any, amount: int) -> None:
    """Warn about a bare number string of a few bytes: bytes on a command line are digits, so it is kept, but
    "25" almost always meant "25%" or "25GiB" (the budget check would then refuse a cache of 25 bytes anyway)."""
    if isinstance(value, str) and value.strip().isdigit() and 0 < amount < BARE_SIZE_FLOOR:
        number = value.strip()
        logger.warning("hf_moe_offload: expert_cache=%r is read as %d bytes; a share of all expert bytes needs "
                       "'%%' (%s%%), a size a unit (%sMiB, %sGiB); give so few bytes as an int (%d) to silence "
                       "this", value, amount, number, number, number, amount)


def parse_count(name: str, value: int | str) -> int | str:
    """A count: "auto", or a whole number >= 1 given as an int or a digit string (command-line flags); the
    workload hints `max_batch_size` and `max_seq_len` also at most `MAX_BATCH_SIZE` / `MAX_SEQ_LEN`.

    Example:
        >>> parse_count("max_batch_size", "8"), parse_count("max_seq_len", "auto")
        (8, 'auto')
    """
    if value == AUTO:
        return AUTO
    if isinstance(value, str) and re.fullmatch(r"\s*[0-9]+\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PolicyError(f"{name}={value!r} is not allowed; allowed: a whole number >= 1, or 'auto'"
                          f"{did_you_mean(value, [AUTO])}")
    bound = _COUNT_BOUNDS.get(name)
    if bound is not None and value > bound[0]:
        raise PolicyError(f"{name}={value} is more than {bound[0]} {bound[1]}; allowed: a whole number from 1 to "
                          f"{bound[0]}, or 'auto'")
    return value


# Counts with an upper bound: (bound, what it counts, for the message).
_COUNT_BOUNDS = {"max_batch_size": (MAX_BATCH_SIZE, "sequences at once"),
                 "max_seq_len": (MAX_SEQ_LEN, "tokens per sequence (longer than any model's context)")}


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
