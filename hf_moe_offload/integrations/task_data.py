"""Build the JSONL data of the shipped lm-eval tasks (`integrations/tasks/data/`), deterministically and offline.

The shipped files were written by this module; rerun it only to regenerate them (the pydoc text it reads comes with
CPython, so a different Python version gives slightly different pydoc-based files):

    $ python -m hf_moe_offload.integrations.task_data --out hf_moe_offload/integrations/tasks/data

Sources:
- `pydoc_data.topics` (the reference-manual snippets behind `help()`), split into training and held-out topics
  exactly like `scripts/make_tiny_moe.py` does for the demo model (seed 0, 10% of the characters held out), so the
  pydoc tasks only use text the demo model never trained on.
- Arithmetic questions drawn from a seeded `random.Random`.

Example:
    >>> docs = arithmetic_docs(3, seed=1)
    >>> sorted(docs[0])
    ['answer', 'question']
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

HELDOUT_FRAC = 0.1
SPLIT_SEED = 0
CLOZE_DOCS = 200
CLOZE_CHOICES = 4
ARITH_TEST_DOCS = 100
ARITH_TRAIN_DOCS = 50

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_LAST_WORD = re.compile(r"^(?P<context>.+\S)\s+(?P<word>[A-Za-z]{3,})\.$")


def pydoc_topics() -> dict[str, str]:
    """CPython's pydoc topic texts, stripped, empty ones dropped."""
    from pydoc_data.topics import topics  # deferred: the bundled text is read only when asked for

    return {key: text.strip() for key, text in topics.items() if text.strip()}


def heldout_topic_keys(topics: dict[str, str], frac: float = HELDOUT_FRAC, seed: int = SPLIT_SEED) -> list[str]:
    """The held-out topic keys of `scripts/make_tiny_moe.py`'s split (whole topics until `frac` of the chars)."""
    keys = sorted(topics)
    random.Random(seed).shuffle(keys)
    target = frac * sum(len(t) for t in topics.values())
    heldout: list[str] = []
    chars = 0
    for key in keys:
        if chars >= target:
            break
        heldout.append(key)
        chars += len(topics[key])
    return sorted(heldout)


def prose_sentences(text: str) -> Iterable[str]:
    """Sentences of the prose paragraphs of a pydoc topic (no code, grammar, headings or tables)."""
    for paragraph in re.split(r"\n\s*\n", text):
        lines = paragraph.splitlines()
        if not lines or any(line.startswith((" ", "\t")) for line in lines):
            continue                                  # code samples and grammar rules are indented
        if any(set(line.strip()) <= set("*=-+|") for line in lines):
            continue                                  # headings and tables
        flat = " ".join(line.strip() for line in lines)
        if ">>>" in flat or not flat.isascii():
            continue
        yield from _SENTENCE_END.split(flat)


def cloze_docs(topics: dict[str, str], keys: list[str], n: int = CLOZE_DOCS, num_choices: int = CLOZE_CHOICES,
               seed: int = 0) -> list[dict]:
    """Multiple-choice docs "which word ends the sentence": context, choices (words), label (index of the answer)."""
    candidates = []
    for key in keys:
        for sentence in prose_sentences(topics[key]):
            m = _LAST_WORD.match(sentence)
            if m and 5 <= len(sentence.split()) <= 40:
                candidates.append((key, m.group("context"), m.group("word")))
    rng = random.Random(seed)
    rng.shuffle(candidates)
    words = sorted({w.lower() for _, _, w in candidates})
    docs = []
    for key, context, word in candidates[:n]:
        distractors = rng.sample([w for w in words if w != word.lower()], num_choices - 1)
        choices = [word, *distractors]
        rng.shuffle(choices)
        docs.append({"topic": key, "context": context, "choices": choices, "label": choices.index(word)})
    return docs


def heldout_texts(topics: dict[str, str], keys: list[str]) -> list[dict]:
    """One doc per held-out topic, `{"topic", "text"}` (the demo model's `heldout.jsonl` format)."""
    return [{"topic": key, "text": topics[key]} for key in keys]


def arithmetic_docs(n: int, seed: int) -> list[dict]:
    """Questions "What is A plus B?" / "What is A minus B?" with small non-negative answers."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        if rng.random() < 0.5:
            docs.append({"question": f"What is {a} plus {b}?", "answer": str(a + b)})
        else:
            a, b = max(a, b), min(a, b)
            docs.append({"question": f"What is {a} minus {b}?", "answer": str(a - b)})
    return docs


def write_jsonl(path: Path, docs: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
    logger.info("wrote %d docs to %s", len(docs), path)


def build_all(out: Path) -> None:
    """Write every task's data files under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    topics = pydoc_topics()
    keys = heldout_topic_keys(topics)
    write_jsonl(out / "pydoc_cloze.jsonl", cloze_docs(topics, keys))
    write_jsonl(out / "pydoc_heldout.jsonl", heldout_texts(topics, keys))
    write_jsonl(out / "arith_train.jsonl", arithmetic_docs(ARITH_TRAIN_DOCS, seed=1))
    write_jsonl(out / "arith_test.jsonl", arithmetic_docs(ARITH_TEST_DOCS, seed=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "tasks" / "data")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    build_all(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
