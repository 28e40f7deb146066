"""The ``degenerate_repetition`` detector: the same words or line over and over in prose."""

from __future__ import annotations

import re
import zlib
from collections import Counter
from typing import Any

from verifier_service.extract import answer_tag_spans

_CODE_BLOCKS = re.compile(r"(?:```|~~~)[^\n]*\n.*?(?:```|~~~|$)", re.DOTALL)


def _prose(completion: str) -> str:
    """The response without code blocks and answer-tag contents (code and answers may repeat by nature)."""
    text = _CODE_BLOCKS.sub("\n", completion)
    parts, last = [], 0
    for a, b in answer_tag_spans(text):
        parts.append(text[last:a])
        last = b
    parts.append(text[last:])
    return " ".join(parts)


def degenerate_repetition(completion: str, n: int = 4) -> dict[str, Any] | None:
    """Evidence when the prose (``_prose``) loops: one ``n``-gram holding a word of 3+ letters makes up
    half of at least 40 words, the same line of 12+ characters (with a word) repeats 6+ times in a
    row, or a text of 600+ characters and 40+ words, mostly letters, compresses below a tenth of its
    size (zlib)."""
    text = _prose(completion)
    words = text.split()
    if len(words) >= 40:
        grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
        for gram, count in grams.most_common(3):
            if count >= 4 and count * n >= 0.5 * len(words) and any(len(w) >= 3 and w.isalpha() for w in gram):
                return {"ngram": " ".join(gram)[:80], "repeats": count, "words": len(words)}
    run, prev = 1, None
    for line in text.splitlines():
        s = line.strip()
        if len(s) >= 12 and s == prev and re.search(r"[A-Za-z]{3}", s):
            run += 1
            if run >= 6:
                return {"line": s[:80], "repeats": run}
        else:
            run = 1
        prev = s
    if len(text) >= 600 and len(words) >= 40 and sum(c.isalpha() for c in text) > 0.5 * len(text):
        raw = text.encode("utf-8", "replace")
        ratio = len(zlib.compress(raw)) / len(raw)
        if ratio < 0.1:
            return {"compression_ratio": round(ratio, 4)}
    return None
