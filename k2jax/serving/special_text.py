"""Hide special-token names in output text (skip_special_tokens), whole or streamed.

The parsers read text with special tokens by name; what reaches the client as content or reasoning must not
show them (a malformed tool-call section's markers, a reserved token a weak model emits). Names are removed
where they occur whole; a stream holds back a tail that may be the start of a name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from k2jax.serving.tool_calls import partial_marker_tail


class SpecialTextFilter:
    """Removes the given names from text; `feed`/`finish` do it over a stream with the same result."""

    def __init__(self, names: Iterable[str]):
        self.names = tuple(sorted({n for n in names if n}, key=len, reverse=True))
        self._re = re.compile("|".join(map(re.escape, self.names))) if self.names else None
        self._buf = ""

    def strip(self, text: str) -> str:
        """text without any of the names."""
        return self._re.sub("", text) if self._re is not None else text

    def feed(self, text: str) -> str:
        """Next piece -> the filtered text that is final now."""
        if self._re is None:
            return text
        self._buf += text
        out = self.strip(self._buf)
        keep = partial_marker_tail(out, self.names)
        self._buf = out[len(out) - keep:]
        return out[:len(out) - keep]

    def finish(self) -> str:
        """End of stream: the held tail (not a whole name)."""
        out, self._buf = self._buf, ""
        return out
