"""The policy's documentation, rendered from `OffloadPolicy`'s field metadata (one source for each fact).

Each field carries ``metadata={"short": ..., "values": ..., "help": ...}``: the README's policy table shows
``values`` and ``short`` (one line, at most 100 characters), ``docs/policy.md`` the full ``help``. Both files keep the
rendered part between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` markers; the rest is written by hand.

    python -m hf_moe_offload.policy.reference --write    # regenerate the README table and docs/policy.md
    python -m hf_moe_offload.policy.reference --check    # exit 1 if either is stale (tests/test_readme.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

from .offload_policy import OffloadPolicy

SHORT_LIMIT = 100
ROOT = Path(__file__).resolve().parents[2]


def _default(f: dataclasses.Field) -> str:
    return "–" if f.default is None else f"`{f.default!r}`".replace("'", '"')


def policy_table() -> str:
    """The README's table: field | values | default | one line."""
    rows = ["| field | values | default | what it sets |", "|---|---|---|---|"]
    for f in dataclasses.fields(OffloadPolicy):
        short = f.metadata["short"]
        if len(short) > SHORT_LIMIT:
            raise ValueError(f"{f.name}'s short text has {len(short)} characters, more than {SHORT_LIMIT}")
        rows.append(f"| [`{f.name}`](docs/policy.md#{f.name}) | {f.metadata['values']} | {_default(f)} | {short} |")
    return "\n".join(rows)


def policy_fields() -> str:
    """docs/policy.md's field reference: one section per field with its values, default and full help."""
    parts = []
    for f in dataclasses.fields(OffloadPolicy):
        parts.append(f"### {f.name}\n\nValues: {f.metadata['values']}. Default: {_default(f)}.\n\n"
                     f"{f.metadata['help']}")
    return "\n\n".join(parts)


# file (relative to the repository root) -> {block name: renderer}
BLOCKS = {
    "README.md": {"policy-table": policy_table},
    "docs/policy.md": {"policy-fields": policy_fields},
}


def render(text: str, name: str, body: str) -> str:
    """`text` with the block between `<!-- name:start -->` and `<!-- name:end -->` replaced by `body`."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    pattern = re.compile(rf"{re.escape(start)}\n.*?{re.escape(end)}", flags=re.S)
    if not pattern.search(text):
        raise ValueError(f"no {start} ... {end} block")
    return pattern.sub(lambda m: f"{start}\n{body}\n{end}", text, count=1)


def rendered(path: str, root: Path = ROOT) -> tuple[str, str]:
    """(the file's text now, the text with every generated block re-rendered)."""
    text = (root / path).read_text()
    new = text
    for name, renderer in BLOCKS[path].items():
        new = render(new, name, renderer())
    return text, new


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="rewrite the generated blocks in place")
    action.add_argument("--check", action="store_true", help="exit 1 if a generated block is stale")
    args = parser.parse_args(argv)
    stale = []
    for path in BLOCKS:
        text, new = rendered(path)
        if new != text:
            stale.append(path)
            if args.write:
                (ROOT / path).write_text(new)
    verb = "rewrote" if args.write else "stale"
    print(f"{verb}: {', '.join(stale)}" if stale else "up to date")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
