"""Incremental detokenization for the engine: each new token costs the same, however long the output is.

`TokenText` holds a tokenizer's bytes per token id (looked up once per id, shared by every request).
`Detokenizer` is one request's stream: the engine calls `add(token_id)` per generated token and gets the text
that became final with it, and `flush()` once at the end. Per token it decodes that token's bytes only (an
incremental UTF-8 decoder holds a multi-byte character back until its last byte arrives), and matches stop
strings on a window of the text's last characters (a stop string can span tokens), never on the whole text.

Special tokens (Kimi's 256 reserved ids, and ids past the tokenizer's vocabulary that a model's padded
vocabulary may hold) give no text unless skip_special_tokens is false; then a special id gives its name, as
the tokenizer decodes it.
"""

from __future__ import annotations

import codecs
from typing import Sequence


class TokenText:
    """Bytes of each token id of `tokenizer` (a k2jax.tokenizer.KimiTokenizer: decode_bytes, vocab_size,
    special_tokens), cached on first use."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.specials = frozenset(tokenizer.special_tokens.values())
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        """The token's bytes (a special's name; b"" past the tokenizer's vocabulary)."""
        b = self._bytes.get(token_id)
        if b is None:
            b = self.tokenizer.decode_bytes([token_id]) if 0 <= token_id < self.vocab_size else b""
            self._bytes[token_id] = b
        return b

    def is_special(self, token_id: int) -> bool:
        return token_id in self.specials or not 0 <= token_id < self.vocab_size

    def text_of(self, token_id: int) -> str:
        """One token as text on its own (an incomplete UTF-8 piece becomes U+FFFD): for logprobs."""
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """A whole sequence at once (prompts for echo and /detokenize)."""
        return b"".join(self.bytes_of(int(i)) for i in ids
                        if not (skip_special_tokens and self.is_special(int(i)))).decode("utf-8", errors="replace")

    def stream(self, skip_special_tokens: bool = True, stop: Sequence[str] = ()) -> "Detokenizer":
        return Detokenizer(self, skip_special_tokens, stop)


class Detokenizer:
    """One request's output as text, a token at a time. `add` returns the text made final by a token: a
    multi-byte character is held back until complete, and a tail that may be the start of a stop string
    until it is known not to be one. When a stop string completes, `stopped` is set and the text ends where
    the stop string begins."""

    def __init__(self, table: TokenText, skip_special_tokens: bool = True, stop: Sequence[str] = ()):
        self.table, self.skip_special = table, skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.keep = max((len(s) for s in self.stop), default=1) - 1  # characters a stop string can reach back
        # Every non-empty beginning of a stop string, for _stop_prefix: a set lookup per tail length instead of
        # a scan of the stop strings (two stop strings: 8.9 -> 4.6 us per token).
        self._starts = frozenset(x[:k] for x in self.stop for k in range(1, len(x) + 1))
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._window = ""  # the text's last `keep` characters (reported or held)
        self._held = ""  # a suffix of _window not reported yet: it may begin a stop string
        self.stopped = False

    def add(self, token_id: int, check_stop: bool = True) -> str:
        """The text that became final with this token ("" while held back). check_stop=False (before a
        request's min_tokens) reports the text without matching stop strings."""
        if self.stopped:
            return ""
        if self.skip_special and self.table.is_special(token_id):
            return ""
        new = self._utf8.decode(self.table.bytes_of(token_id))
        if not new or not self.stop:
            return new
        s = self._window + new  # bounded: keep + len(new) characters
        start = len(self._window) - len(self._held)  # where the unreported text begins in s
        if check_stop:
            # An occurrence ending in `new` starts at or after `start`: an earlier start would mean the
            # reported text ended with a stop string's beginning, which is held back instead.
            hits = [i for i in (s.find(x, start) for x in self.stop) if i >= 0]
            if hits:
                self.stopped, self._held = True, ""
                return s[start:min(hits)]
            held = self._stop_prefix(s)
        else:
            held = 0
        out, self._held = s[start:len(s) - held], s[len(s) - held:]
        self._window = s[-self.keep:] if self.keep else ""
        return out

    def _stop_prefix(self, s: str) -> int:
        """Length of the longest suffix of s that begins a stop string (at most keep characters)."""
        for k in range(min(self.keep, len(s)), 0, -1):
            if s[-k:] in self._starts:
                return k
        return 0

    def flush(self) -> str:
        """At the end of the output: the held-back text, and an incomplete character as U+FFFD."""
        if self.stopped:
            return ""
        out = self._held + self._utf8.decode(b"", final=True)
        self._held = ""
        return out


class NoText:
    """The detokenizer of an engine without a tokenizer: token ids only, no text."""

    stopped = False

    def add(self, token_id: int, check_stop: bool = True) -> str:
        return ""

    def flush(self) -> str:
        return ""
