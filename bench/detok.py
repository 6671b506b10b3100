"""Detokenization cost per token on the engine thread, at output lengths 128 and 8192 (goal: ratio <= 1.5).

The engine turns each request's tokens into text as they come (k2jax.runtime.detok.Detokenizer.add, called
once per token by the engine, with the request's stop strings). This times exactly that call, token by
token, for the same 128 probe tokens placed at the end of an output of each length (so the same text is
measured at both lengths), and prints the median time per probe token (best of the repeats: medians and
minima keep a busy machine's preemptions out) and the ratio; for comparison, the same for decoding the
whole output again at every token (what the engine did before), whose cost per token grows with the output.

The token stream is text of the kind a model writes (English, code, Chinese: multi-byte characters split
across tokens) encoded with a tokenizer: the small synthetic one k2jax's tests use (default), or a real one
with --tokenizer DIR (tiktoken.model and tokenizer_config.json, e.g. Kimi K2's).

    python bench/detok.py [--tokenizer DIR] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TEXT = """\
The answer depends on how the cache is laid out. Let me work through it step by step.
def attention(query, key, value, mask=None):
    scores = query @ key.transpose(-2, -1) / math.sqrt(key.shape[-1])
    return softmax(scores, axis=-1) @ value
人工智能是计算机科学的一个分支。大语言模型可以理解和生成自然语言。月之暗面开发了Kimi模型。
for i in range(10):
    print(f"step {i}: loss = {loss:.4f}")
"""
STOPS = ("</answer>", "\n\nUser:")  # typical stop strings: matched on every token, never found here


def token_stream(tok, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(TEXT)
    return ids[:n]


PROBE = 128  # tokens timed at the end of each output


def output(ids, n: int) -> list[int]:
    """n tokens ending with the probe (the stream's first PROBE tokens), so every length times the same text."""
    filler = ids[PROBE:PROBE + n - PROBE] if n > PROBE else []
    return filler + ids[:min(n, PROBE)]


def per_token_incremental(table, out) -> float:
    """Median seconds of Detokenizer.add over the output's last PROBE tokens."""
    d = table.stream(skip_special_tokens=True, stop=STOPS)
    clock, times = time.perf_counter, []
    for k, i in enumerate(out):
        t0 = clock()
        d.add(i)
        if k >= len(out) - PROBE:
            times.append(clock() - t0)
    d.flush()
    return statistics.median(times)


def per_token_redecode(tok, out) -> float:
    """The former engine: the whole output decoded again at each token, stop strings searched near its end;
    median seconds over the last PROBE tokens."""
    times = []
    for k in range(max(1, len(out) - PROBE + 1), len(out) + 1):
        t0 = time.perf_counter()
        text = tok.decode(out[:k])
        for s in STOPS:
            text.find(s, max(0, len(text) - 64))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", metavar="DIR", help="a tokenizer directory (default: the synthetic test one)")
    ap.add_argument("--lengths", default="128,8192", help="output lengths (default 128,8192)")
    ap.add_argument("--repeats", type=int, default=5, help="runs per length; the best is reported (default 5)")
    ap.add_argument("--no-redecode", action="store_true", help="skip the whole-output re-decode comparison")
    args = ap.parse_args()

    from k2jax.runtime.detok import TokenText
    from k2jax.tokenizer import KimiTokenizer
    from tests.bpe import write_test_tokenizer

    with tempfile.TemporaryDirectory() as d:
        tok = KimiTokenizer.from_dir(args.tokenizer or write_test_tokenizer(d, num_merges=2000))
    lengths = [int(x) for x in args.lengths.split(",")]
    ids = token_stream(tok, max(lengths) + PROBE)
    table = TokenText(tok)
    per_token_incremental(table, ids)  # warm: every token's bytes looked up once, as a running server has them
    print(f"tokenizer: {args.tokenizer or 'synthetic (2000 merges)'}, vocabulary {tok.vocab_size}; stop strings "
          f"{list(STOPS)}; best of {args.repeats}")
    rows = []
    for n in lengths:
        out = output(ids, n)
        inc = min(per_token_incremental(table, out) for _ in range(args.repeats))
        red = None if args.no_redecode else min(per_token_redecode(tok, out) for _ in range(args.repeats))
        rows.append((n, inc, red))
        print(f"output {n:>6} tokens: incremental {inc * 1e6:8.2f} us/token"
              + ("" if red is None else f" | whole re-decode {red * 1e6:10.2f} us/token"), flush=True)
    (n0, a, ra), (n1, b, rb) = rows[0], rows[-1]
    print(f"ratio {n1} / {n0}: incremental {b / a:.2f} (goal <= 1.5)"
          + ("" if ra is None else f", whole re-decode {rb / ra:.1f}"))


if __name__ == "__main__":
    main()
