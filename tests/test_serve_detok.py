"""The engine's incremental detokenizer (k2jax.runtime.detok) against whole-sequence decoding: the same text,
multi-byte characters held back until complete, stop strings cut where they begin (also across tokens),
special tokens skipped unless asked for, and every byte decoded once (a flat cost per token)."""

import codecs
import random

import pytest

from k2jax.runtime import detok as D
from k2jax.tokenizer import KimiTokenizer
from tests.bpe import write_test_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return KimiTokenizer.from_dir(write_test_tokenizer(tmp_path_factory.mktemp("tok"), num_merges=500))


def whole(tok, ids, skip_special=True):
    """The reference: every kept token's bytes joined, decoded at once."""
    keep = [i for i in ids if i < tok.vocab_size and not (skip_special and i >= tok.num_base)]
    return tok.decode_bytes(keep).decode("utf-8", errors="replace")


def run(d, ids):
    """-> (the text pieces add() returned, one per token, and flush()'s)."""
    return [d.add(i) for i in ids], d.flush()


def streams(tok, n=40, length=60, seed=0):
    """Token streams over the whole id range: text tokens, pieces of multi-byte characters, specials and ids
    past the tokenizer (a model's padded vocabulary)."""
    r = random.Random(seed)
    cjk = tok.encode("人工智能是计算机科学的一个分支。月之暗面开发了Kimi模型")
    return [[r.choice(cjk) if r.random() < 0.4 else r.randrange(0, tok.vocab_size + 12) for _ in range(length)]
            for _ in range(n)]


def test_incremental_text_equals_whole_decoding(tok):
    for ids in streams(tok):
        for skip in (True, False):
            pieces, tail = run(D.TokenText(tok).stream(skip_special_tokens=skip), ids)
            assert "".join(pieces) + tail == whole(tok, ids, skip)


def test_a_multibyte_character_is_held_until_complete(tok):
    table = D.TokenText(tok)
    ch = "智"  # 3 bytes: one token per byte
    ids = [tok._ranks[bytes([b])] for b in ch.encode()]
    d = table.stream()
    assert [d.add(i) for i in ids] == ["", "", ch]
    d = table.stream()
    assert d.add(ids[0]) == "" and d.flush() == "\ufffd"  # cut short: U+FFFD, as whole decoding gives


def test_special_tokens_are_skipped_unless_asked_for(tok):
    text = tok.encode("Kimi")
    end = tok.special_tokens["<|im_end|>"]
    ids = text + [end, tok.vocab_size + 3] + text
    assert "".join(run(D.TokenText(tok).stream(), ids)[0]) == "KimiKimi"
    assert "".join(run(D.TokenText(tok).stream(skip_special_tokens=False), ids)[0]) == "Kimi<|im_end|>Kimi"


def cut_at_stop(text, stops):
    hits = [text.find(s) for s in stops if s in text]
    return (text[:min(hits)], True) if hits else (text, False)


def test_stop_strings_cut_the_text_where_they_begin_also_across_tokens(tok):
    r = random.Random(1)
    stopped_cases = 0
    for ids in streams(tok, n=60, length=40, seed=2):
        full = whole(tok, ids)
        if len(full) < 12:
            continue
        a = r.randrange(0, len(full) - 4)
        stops = (full[a:a + r.randrange(1, 5)], "never-there")
        d = D.TokenText(tok).stream(stop=stops)
        pieces = []
        for i in ids:
            pieces.append(d.add(i))
            if d.stopped:
                break
        else:
            pieces.append(d.flush())
        want, stopped = cut_at_stop(full, stops)
        assert "".join(pieces) == want and d.stopped == stopped
        stopped_cases += stopped
    assert stopped_cases >= 30  # most streams hit their stop string


def test_a_stop_string_spanning_tokens_is_held_back_then_released(tok):
    ids = tok.encode("The quick brown fox")
    pieces = [tok.decode([i]) for i in ids]
    assert len(pieces) >= 3
    stop = pieces[1][-1] + pieces[2][0]  # the last character of one token and the first of the next
    d = D.TokenText(tok).stream(stop=(stop + "#",))  # never completes: all text comes out, late
    out = [d.add(i) for i in ids]
    assert not out[1].endswith(pieces[1][-1])  # held: it may begin the stop string
    assert "".join(out) + d.flush() == "The quick brown fox"
    d = D.TokenText(tok).stream(stop=(stop,))
    out = [d.add(i) for i in ids[:3]]
    assert d.stopped and "".join(out) == "".join(pieces)[:"".join(pieces).find(stop)]


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode("The quick brown fox")
    d = D.TokenText(tok).stream(stop=("quick",))
    out = [d.add(i, check_stop=k >= 3) for k, i in enumerate(ids)]
    assert not d.stopped and "".join(out) + d.flush() == "The quick brown fox"


UTF8 = codecs.getincrementaldecoder("utf-8")


class CountingDecoder(codecs.IncrementalDecoder):
    """UTF-8, counting the bytes it is given."""

    seen = 0

    def __init__(self, errors="strict"):
        super().__init__(errors)
        self.inner = UTF8(errors)

    def decode(self, data, final=False):
        CountingDecoder.seen += len(data)
        return self.inner.decode(data, final)


def test_each_byte_is_decoded_once_and_the_stop_window_stays_bounded(tok, monkeypatch):
    monkeypatch.setattr(D.codecs, "getincrementaldecoder", lambda name: CountingDecoder)
    ids = streams(tok, n=1, length=3000, seed=5)[0]
    table = D.TokenText(tok)
    d = table.stream(stop=("zzzq", "a long stop string that never comes"))
    windows = []
    for i in ids:
        d.add(i)
        windows.append(len(d._window))
    d.flush()
    assert CountingDecoder.seen == sum(len(table.bytes_of(i)) for i in ids if not table.is_special(i))
    assert max(windows) <= d.keep == len("a long stop string that never comes") - 1


def test_a_long_stop_string_prefix_at_the_start_is_held_then_released_or_cut(tok):
    """The output begins with most of a long stop string: held back whole while it may still match."""
    ids = tok.encode("The quick brown cat sat")
    d = D.TokenText(tok).stream(stop=("The quick brown fox", "zz"))
    out = [d.add(i) for i in ids]
    assert "".join(out[:len(tok.encode("The quick brown"))]) == ""
    assert "".join(out) + d.flush() == "The quick brown cat sat"
    d = D.TokenText(tok).stream(stop=("quick brown cat", "zz"))
    out = [d.add(i) for i in ids]
    assert d.stopped and "".join(out) == "The "
