"""The fragment-set grammar of ``sync --fragments`` (``0-3,7``): parsed with bounded
memory, and written back compactly."""

from __future__ import annotations

import re
from typing import Iterable

from ddiloco_cli.errors import UsageError

MAX_FRAGMENTS = 99_999  # fragment indices are 5 digits in every key (layout.frag)
_PART = re.compile(r"([0-9]{1,6})(?:-([0-9]{1,6}))?")


def parse_fragment_spec(spec: str | None) -> list[int] | None:
    """``"0-3,7"`` -> ``[0, 1, 2, 3, 7]``; None, ``""`` or ``"all"`` -> None (every fragment).

    Each part is an index or an ascending range ``a-b`` (inclusive) of indices
    below ``MAX_FRAGMENTS``, so the result never holds more than that many
    numbers. Raises UsageError naming the bad part.
    """
    if spec is None or spec.strip() in ("", "all"):
        return None
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        m = _PART.fullmatch(part)
        if m is None:
            raise UsageError(f"--fragments: {part!r} is not a fragment index or range; use e.g. 0-3,7 or all")
        a = int(m.group(1))
        b = a if m.group(2) is None else int(m.group(2))
        if b < a:
            raise UsageError(f"--fragments: range {part!r} runs backwards; write it as {b}-{a}")
        if b >= MAX_FRAGMENTS:
            raise UsageError(f"--fragments: {b} is not a fragment index (they are below {MAX_FRAGMENTS})")
        out.update(range(a, b + 1))
    return sorted(out)


def format_fragment_spec(frags: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the inverse of ``parse_fragment_spec``); ``""`` for none."""
    frags = sorted(frags)
    parts, i = [], 0
    while i < len(frags):
        j = i
        while j + 1 < len(frags) and frags[j + 1] == frags[j] + 1:
            j += 1
        parts.append(str(frags[i]) if i == j else f"{frags[i]}-{frags[j]}")
        i = j + 1
    return ",".join(parts)
