"""The converter's error type."""

from __future__ import annotations

import re


class ConvertError(ValueError):
    """Bad input or a failed conversion; the message says what and where."""


def first_line(e: BaseException) -> str:
    """An exception's first line, without tensorstore's source locations (for one-line reports)."""
    return re.sub(r"\s*\[source locations=.*", "", str(e).strip().splitlines()[0] if str(e).strip() else repr(e))
