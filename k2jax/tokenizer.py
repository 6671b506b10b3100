"""Kimi K2 tokenizer: tiktoken BPE plus Kimi's special tokens and chat format.

The released tokenizer is a `tiktoken.model` file (one `base64(token) rank` per
line, ranks 0..n-1) followed by 256 special tokens with ids n..n+255, named by
`tokenizer_config.json`'s `added_tokens_decoder` (falling back to the fixed
Kimi layout and `<|reserved_token_{id}|>`). A small vocabulary in the same format ships with
the package for the demo (k2jax.synthetic.demo_tokenizer; tests/bpe.py made it).
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import os
from pathlib import Path

import tiktoken

NUM_RESERVED_SPECIAL = 256
KIMI_NUM_REGULAR = 163_584  # regular tokens in the released tiktoken.model

# Kimi's pre-tokenizer. `&&` is character-class intersection: fancy-regex
# (used by tiktoken) supports it natively; Python's `regex` needs its V1 mode.
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Offsets of the named specials from the first special id (the Kimi layout).
KIMI_SPECIAL_OFFSETS = {
    "[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3,
    "<|im_assistant|>": 4, "<|start_header_id|>": 6, "<|end_header_id|>": 7,
    "[EOT]": 9, "<|im_system|>": 10, "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12, "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14, "<|tool_call_end|>": 15,
    "<|im_middle|>": 17, "[UNK]": 254, "[PAD]": 255,
}



def load_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Parse a tiktoken ranks file. Parsed here rather than with
    `tiktoken.load.load_tiktoken_bpe`, which caches by path and could serve a
    stale copy after the file changes."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer ranks file not found: {path}")
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"malformed line {lineno} in {path}: {line[:80]!r}") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        # Special ids start at len(ranks); gaps or duplicates would make them collide.
        raise ValueError(f"{path}: ranks must be unique tokens with ranks 0..n-1 (got {len(ranks)} tokens)")
    return ranks


TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja")


@functools.lru_cache(maxsize=8)
def tokenizer_dir(location: str | os.PathLike) -> str:
    """A local directory holding the tokenizer (and chat template) files at `location`: a local directory as it
    is; a gs:// prefix's `tiktoken.model`, `tokenizer_config.json` and `chat_template.jinja` copied into
    ~/.cache/k2jax/gcs/...; a Hugging Face repo id's fetched into the HF cache. A location that is none of these is
    a FileNotFoundError naming it."""
    from k2jax.checkpoint import storage

    loc = storage.location(location)
    if storage.is_gcs(loc):
        d = storage.open_dir(loc)
        local = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "k2jax" / "gcs" / d.bucket / d.prefix
        found = False
        for name in TOKENIZER_FILES:
            data = d.read(name)
            if data is not None:
                local.mkdir(parents=True, exist_ok=True)
                (local / f"{name}.tmp{os.getpid()}").write_bytes(data)
                os.replace(local / f"{name}.tmp{os.getpid()}", local / name)
                found = True
            else:
                (local / name).unlink(missing_ok=True)
        if not found:
            raise FileNotFoundError(f"{loc}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)})")
        return str(local)
    if os.path.exists(loc):
        return loc
    from k2jax.checkpoint import hub

    if hub.is_repo_id(loc):
        return str(hub.fetch_small(loc, TOKENIZER_FILES))
    raise FileNotFoundError(f"tokenizer directory not found: {loc} (nor a gs:// URL or a Hugging Face repo id)")


def _token_content(v) -> str | None:
    """tokenizer_config stores tokens either as a string or as an AddedToken dict."""
    return v.get("content") if isinstance(v, dict) else v


class KimiTokenizer:
    """Kimi K2 tokenizer (tiktoken BPE + 256 special tokens + chat template)."""

    def __init__(self, ranks: dict[bytes, int], special_names: dict[int, str] | None = None,
                 bos_token: str = "[BOS]", eos_token: str = "[EOS]", name: str = "kimi"):
        """`special_names` maps special id -> name for ids in the 256-slot block;
        unnamed slots use the Kimi layout, then `<|reserved_token_{id}|>`."""
        self.num_base = len(ranks)
        names = {self.num_base + off: tok for tok, off in KIMI_SPECIAL_OFFSETS.items()}
        if special_names:
            names.update(special_names)
        self.special_tokens = {
            names.get(i, f"<|reserved_token_{i}|>"): i
            for i in range(self.num_base, self.num_base + NUM_RESERVED_SPECIAL)
        }
        if len(self.special_tokens) != NUM_RESERVED_SPECIAL:
            raise ValueError("duplicate special token names")
        self._ranks = ranks
        self._enc = tiktoken.Encoding(name, pat_str=PAT_STR, mergeable_ranks=ranks,
                                      special_tokens=self.special_tokens)
        self.bos_id = self.id_of(bos_token)
        self.eos_id = self.id_of(eos_token)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "KimiTokenizer":
        """Load `tiktoken.model` and, if present, `tokenizer_config.json` from `path`: a directory, a gs:// URL
        or a Hugging Face repo id (see `tokenizer_dir`)."""
        path = Path(tokenizer_dir(path))
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {path} (expected {path / 'tiktoken.model'})")
        ranks = load_ranks(path / "tiktoken.model")
        cfg_path = path / "tokenizer_config.json"
        kwargs = {}
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
                names = {int(k): v["content"] for k, v in cfg.get("added_tokens_decoder", {}).items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"malformed {cfg_path}: {e}") from e
            lo, hi = len(ranks), len(ranks) + NUM_RESERVED_SPECIAL
            bad = [i for i in names if not lo <= i < hi]
            if bad:
                raise ValueError(f"{cfg_path}: added token ids {bad[:5]} outside the special range [{lo}, {hi})")
            kwargs["special_names"] = names
            for key in ("bos_token", "eos_token"):
                if cfg.get(key) is not None:
                    kwargs[key] = _token_content(cfg[key])
        return cls(ranks, name=path.name or "kimi", **kwargs)

    @property
    def vocab_size(self) -> int:
        """Regular tokens plus the 256 specials."""
        return self._enc.n_vocab

    @property
    def mergeable_ranks(self) -> dict[bytes, int]:
        """The regular tokens' bytes -> id (the tiktoken ranks); do not modify."""
        return self._ranks

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end a generated assistant turn."""
        return [self.special_tokens["<|im_end|>"], self.eos_id]

    def id_of(self, token: str) -> int:
        """Id of a special token name or of a regular token given as its UTF-8 text."""
        if token in self.special_tokens:
            return self.special_tokens[token]
        try:
            return self._ranks[token.encode("utf-8")]
        except KeyError:
            raise KeyError(f"not a single token: {token!r}") from None

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Encode text. Special-token text is encoded as plain text unless
        `allow_special`, so user content cannot inject control tokens."""
        if allow_special:
            return self._enc.encode(text, allowed_special="all")
        return self._enc.encode(text, allowed_special=set(), disallowed_special=())

    def decode_bytes(self, ids) -> bytes:
        """Raw bytes of a token sequence (specials decode to their names)."""
        return self._enc.decode_bytes([int(i) for i in ids])

    def decode(self, ids) -> str:
        """Decode to text; partial UTF-8 sequences become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")
