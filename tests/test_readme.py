"""The README's quick start runs as written (on the embedded demo model, offline), and the generated tables in the
README and docs/ equal what the code renders now."""

from __future__ import annotations

import re
from pathlib import Path

from hf_moe_offload.policy import reference

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MODELS = ROOT / "docs" / "models.md"


def test_readme_usage_snippet_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    usage = next(b for b in blocks if "offload_policy=" in b and "generate(" in b)
    assert re.search(r"^import hf_moe_offload\b", usage, flags=re.M), "the quick start must show the import"
    exec(compile(usage, str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert "The import statement" in printed and "hits " in printed and "misses " in printed


def test_readme_stays_short():
    assert len(README.read_text().splitlines()) <= 150


def test_policy_docs_match_the_field_metadata():
    for path in reference.BLOCKS:
        text, new = reference.rendered(path, ROOT)
        assert text == new, (f"{path} is stale; regenerate it with "
                             f"`python -m hf_moe_offload.policy.reference --write`")


def test_policy_short_texts_fit_one_line():
    import dataclasses

    from hf_moe_offload import OffloadPolicy
    for f in dataclasses.fields(OffloadPolicy):
        assert {"short", "values", "help"} <= set(f.metadata), f.name
        assert len(f.metadata["short"]) <= reference.SHORT_LIMIT, f.name


def test_models_families_table_matches_the_registry():
    from hf_moe_offload.arch import families_markdown
    table = re.search(r"<!-- families:start -->\n(.*?)\n<!-- families:end -->", MODELS.read_text(), flags=re.S)
    assert table is not None, "docs/models.md lost its generated families table"
    assert table.group(1) == families_markdown(), ("docs/models.md families table is stale; regenerate it with "
                                                  "`python -c \"from hf_moe_offload.arch import families_markdown; "
                                                  "print(families_markdown())\"`")
