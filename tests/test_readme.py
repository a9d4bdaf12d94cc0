"""The README's Python usage snippet runs as written (on the embedded demo model, offline)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_snippet_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    usage = next(b for b in blocks if "offload_policy=" in b and "generate(" in b)
    exec(compile(usage, str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert "The import statement" in printed and "'misses':" in printed


def test_readme_families_table_matches_the_registry():
    from hf_moe_offload.arch import families_markdown
    table = re.search(r"<!-- families:start -->\n(.*?)\n<!-- families:end -->", README.read_text(), flags=re.S)
    assert table is not None, "README lost its generated families table"
    assert table.group(1) == families_markdown(), ("README families table is stale; regenerate it with "
                                                  "`python -c \"from hf_moe_offload.arch import families_markdown; "
                                                  "print(families_markdown())\"`")
