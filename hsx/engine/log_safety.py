"""Values a request sent, made safe for a log line or an error message.

A request names channels, keys and parameters of its own choosing: written raw, a newline
forges a log line and a megabyte makes one line a megabyte. ``shown`` escapes what is not
printable (as ``repr`` does: newlines, NUL, terminal escapes, bidirectional overrides) and cuts
long values, saying how long they were.
"""

from __future__ import annotations

import reprlib
from typing import Any

# Characters of a value kept in a log line or message (before escaping).
SHOWN_CHARACTERS = 120

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxdict = _REPR.maxlist = _REPR.maxtuple = _REPR.maxset = 6
_REPR.maxstring = SHOWN_CHARACTERS
_REPR.maxlong = 40
_REPR.maxother = SHOWN_CHARACTERS


def shown(value: Any, limit: int = SHOWN_CHARACTERS) -> str:
    """``value`` escaped (control and unprintable characters as ``repr`` writes them) and cut
    to about ``limit`` characters, with its full length when cut."""
    if isinstance(value, str | bytes):
        text = repr(value[:limit])
        if len(value) <= limit:
            return text
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{text}... ({len(value)} {unit})"
    text = _REPR.repr(value)  # cuts containers and long strings inside them as it goes
    return text if len(text) <= 4 * limit else text[: 4 * limit] + "..."
