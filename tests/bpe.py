"""A byte-level BPE trainer and its corpus: small tiktoken-format vocabularies in Kimi's layout for the tests,
and the demo tokenizer shipped with k2jax (k2jax/data/demo_tokenizer = write_test_tokenizer(..., DEMO_MERGES);
tests/test_tokenizer.py checks the shipped files are its output)."""

from __future__ import annotations

import base64
import json
import os
from collections import Counter
from pathlib import Path

import regex  # installed with tiktoken

from k2jax.tokenizer import KIMI_SPECIAL_OFFSETS, NUM_RESERVED_SPECIAL, PAT_STR

DEMO_MERGES = 512  # the shipped demo tokenizer: 768 tokens + the 256 reserved specials = 1024 ids, the demo vocab_size


def split_pieces(text: str) -> list[str]:
    """Pre-tokenize `text` with PAT_STR using Python's `regex` (an independent reading of the pattern)."""
    return regex.findall(PAT_STR, text, flags=regex.V1)



TRAIN_CORPUS = """\
The quick brown fox jumps over the lazy dog. Kimi is a large language model
trained by Moonshot AI. It uses a mixture of experts with multi-head latent
attention, and it can read long documents, write code, and answer questions.
We're testing the tokenizer: it's important that the encoder and the decoder
agree on every byte, including spaces, tabs, and newlines.
人工智能是计算机科学的一个分支。大语言模型可以理解和生成自然语言。
月之暗面开发了Kimi模型，它可以阅读长文档、编写代码并回答问题。
我们正在测试分词器，中文和英文混合的文本应该能够正确地编码和解码。
def attention(query, key, value, mask=None):
    scores = query @ key.transpose(-2, -1) / math.sqrt(key.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask == 0, float("-inf"))
    return softmax(scores, axis=-1) @ value

for i in range(10):
    print(f"step {i}: loss = {loss:.4f}")
import jax.numpy as jnp
x = jnp.zeros((2, 3), dtype=jnp.bfloat16)
{"role": "user", "content": "Hello, world!"} 12345 67890 3.14159
"""


def train_bpe(text: str, num_merges: int = 1000) -> dict[bytes, int]:
    """Byte-level BPE over PAT_STR pieces: 256 byte tokens, then merges in
    learned order (rank = merge order, as tiktoken's merge loop expects).
    Pairs seen once are merged too (after all frequent ones), so a small
    corpus still yields whole-word tokens."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(tuple(bytes([b]) for b in p.encode("utf-8")) for p in split_pieces(text))
    for _ in range(num_merges):
        pairs = Counter()
        for w, n in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += n
        if not pairs:
            break
        (a, b), n = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))  # deterministic ties
        new_words = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += c
        words = new_words
        ranks.setdefault(a + b, len(ranks))  # the same bytes can arise from two different pairs
    return ranks


def write_test_tokenizer(path: str | os.PathLike, *, num_merges: int = 1000,
                         num_regular: int | None = None, corpus: str = TRAIN_CORPUS) -> Path:
    """Write `tiktoken.model` + `tokenizer_config.json` for a small BPE vocab.

    `num_regular` pads the vocabulary with unreachable dummy tokens up to that
    many regular tokens (e.g. KIMI_NUM_REGULAR to reproduce Kimi's absolute
    special ids). Returns the directory.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ranks = train_bpe(corpus, num_merges)
    if num_regular is not None:
        if num_regular < len(ranks):
            raise ValueError(f"num_regular={num_regular} < {len(ranks)} trained tokens")
        # \x00\xff never occurs in UTF-8 text, so BPE can never produce these.
        for i in range(num_regular - len(ranks)):
            ranks[b"\x00\xff" + i.to_bytes(3, "big")] = len(ranks)
    with open(path / "tiktoken.model", "wb") as f:
        f.writelines(base64.b64encode(t) + b" %d\n" % r for t, r in ranks.items())
    n = len(ranks)
    names = {n + off: tok for tok, off in KIMI_SPECIAL_OFFSETS.items()}
    decoder = {str(i): {"content": names.get(i, f"<|reserved_token_{i}|>"), "lstrip": False,
                        "normalized": False, "rstrip": False, "single_word": False, "special": True}
               for i in range(n, n + NUM_RESERVED_SPECIAL)}
    cfg = {"added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]",
           "pad_token": "[PAD]", "unk_token": "[UNK]", "tokenizer_class": "TikTokenTokenizer"}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")
    return path


if __name__ == "__main__":  # regenerate the shipped demo tokenizer: python -m tests.bpe
    from k2jax.synthetic import DEMO_TOKENIZER_DIR

    write_test_tokenizer(DEMO_TOKENIZER_DIR, num_merges=DEMO_MERGES)
    print(f"wrote {DEMO_TOKENIZER_DIR}")
