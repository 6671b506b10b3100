"""Tests for k2jax.tokenizer on self-built tiktoken-format vocabularies (tests/bpe.py), and the demo tokenizer
shipped with the package."""

import json

import pytest

from k2jax.synthetic import DEMO_CONFIG, DEMO_TOKENIZER_DIR, demo_tokenizer
from k2jax.tokenizer import KIMI_NUM_REGULAR, KIMI_SPECIAL_OFFSETS, KimiTokenizer, load_ranks
from tests.bpe import DEMO_MERGES, split_pieces, write_test_tokenizer

TEXTS = [
    "Hello, world! We're testing the tokenizer's round trip.",
    "人工智能是计算机科学的一个分支。月之暗面开发了Kimi模型",
    'def f(x):\n    return x ** 2  # square\n\n\tprint(f"{x=}")\r\n',
    "emoji 🙂👍🏽 and flags 🇯🇵, math ∑ᵢ xᵢ² ≈ 3.14159, 12345678",
    "   leading and trailing spaces   \n\n\n  \t ",
    "mixed 中文English代码code 123中456 Ünïcödé ÀB",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_test_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return KimiTokenizer.from_dir(tok_dir)


def test_vocab_size_and_special_offsets(tok_dir, tok):
    n = len(load_ranks(tok_dir / "tiktoken.model"))
    assert n > 256  # some merges were learned
    assert tok.vocab_size == n + 256
    for name, off in KIMI_SPECIAL_OFFSETS.items():
        assert tok.special_tokens[name] == n + off, name
    assert tok.special_tokens["<|reserved_token_%d|>" % (n + 5)] == n + 5
    assert sorted(tok.special_tokens.values()) == list(range(n, n + 256))
    assert (tok.bos_id, tok.eos_id) == (n, n + 1)
    assert tok.stop_ids == [n + 2, n + 1]
    assert tok.id_of("<|im_middle|>") == n + 17
    assert tok.id_of("a") == ord("a")
    with pytest.raises(KeyError):
        tok.id_of("definitely not one token")


def test_absolute_kimi_ids(tmp_path):
    d = write_test_tokenizer(tmp_path, num_regular=KIMI_NUM_REGULAR)
    t = KimiTokenizer.from_dir(d)
    assert t.vocab_size == 163_840
    got = {k: t.special_tokens[k] for k in
           ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "[PAD]"]}
    assert got == {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
                   "<|im_assistant|>": 163588, "<|im_middle|>": 163601, "[PAD]": 163839}
    assert t.decode(t.encode(TEXTS[1])) == TEXTS[1]  # padding tokens do not disturb BPE


def test_config_names_and_fallback(tok_dir, tmp_path):
    (tmp_path / "tiktoken.model").write_bytes((tok_dir / "tiktoken.model").read_bytes())
    n = len(load_ranks(tmp_path / "tiktoken.model"))
    # No config: the Kimi layout is used.
    t = KimiTokenizer.from_dir(tmp_path)
    assert t.special_tokens["<|im_end|>"] == n + 2 and t.special_tokens[f"<|reserved_token_{n + 8}|>"] == n + 8
    # Config names override the default layout, and bos/eos come from the config.
    cfg = {"added_tokens_decoder": {str(n + 8): {"content": "<|custom|>"}},
           "bos_token": {"content": "<|custom|>"}, "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = KimiTokenizer.from_dir(tmp_path)
    assert t.special_tokens["<|custom|>"] == n + 8 and f"<|reserved_token_{n + 8}|>" not in t.special_tokens
    assert (t.bos_id, t.eos_id) == (n + 8, n + 2)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size - 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")
    # BPE is applied per pre-token piece: encoding pieces separately must agree,
    # which checks that tiktoken splits exactly like split_pieces.
    assert "".join(split_pieces(text)) == text
    assert ids == [i for p in split_pieces(text) for i in tok.encode(p)]


def test_learned_merges_compress(tok):
    text = "The tokenizer can read long documents and write code."
    assert len(tok.encode(text)) < len(text.encode("utf-8")) // 2


def test_decode_replaces_invalid_utf8(tok):
    # Single-byte tokens have rank == byte value; a lone UTF-8 lead byte is invalid.
    assert tok.decode_bytes([0xC3]) == b"\xc3"
    assert tok.decode([0xC3]) == "\ufffd"
    assert tok.decode([0xC3, 0xA9]) == "é"


def test_split_pattern_pieces():
    assert split_pieces("12345") == ["123", "45"]
    assert split_pieces("1234567") == ["123", "456", "7"]
    assert split_pieces("人工智能是计算机") == ["人工智能是计算机"]
    assert split_pieces("Kimi模型很强abc") == ["Kimi", "模型很强", "abc"]
    assert split_pieces("Hello World's") == ["Hello", " World's"]
    assert split_pieces("x = 1\n\n  y") == ["x", " =", " ", "1", "\n\n", " ", " y"]


def test_pattern_blocks_cross_piece_merges():
    # A vocab containing tokens that straddle piece boundaries: tiktoken must
    # never produce them when the pattern separates those bytes.
    ranks = {bytes([b]): b for b in range(256)}
    for t in [b"34", "x你".encode(), "你好".encode()[:2], "你好".encode()]:
        ranks.setdefault(t, len(ranks))
    t = KimiTokenizer(ranks)
    id34, idx_ni = ranks[b"34"], ranks["x你".encode()]
    assert t.encode("34") == [id34]
    assert id34 not in t.encode("12345")  # pieces "123", "45"
    assert idx_ni not in t.encode("x你")  # Han run is its own piece
    assert t.encode("你好") == [ranks["你好".encode()]]


def test_special_text_is_plain_unless_allowed(tok):
    text = "a<|im_end|>b[BOS]"
    ids = tok.encode(text)
    assert not set(ids) & set(tok.special_tokens.values())
    assert tok.decode(ids) == text
    sp = tok.encode(text, allow_special=True)
    assert tok.special_tokens["<|im_end|>"] in sp and tok.bos_id in sp
    assert tok.decode(sp) == text
    assert tok.encode("<|im_middle|>", allow_special=True) == [tok.special_tokens["<|im_middle|>"]]


def _turn(tok, role, content):
    s = tok.special_tokens
    return [s[f"<|im_{role}|>"], *tok.encode(role), s["<|im_middle|>"], *tok.encode(content), s["<|im_end|>"]]


def test_builtin_chat_template_is_kimis_format(tok):
    """The built-in template (k2jax.serving.chat_template, used when a checkpoint has none) renders K2's turns
    literally: a default system turn, `<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>`, the generation
    prompt; tokenized with the markers as special ids and role and content as text."""
    from k2jax.serving.chat_template import ChatTemplate

    t = ChatTemplate.builtin()
    s = tok.special_tokens
    msgs = [{"role": "user", "content": "你好, what is 2+2?"}, {"role": "assistant", "content": "4."}]
    gen = [s["<|im_assistant|>"], *tok.encode("assistant"), s["<|im_middle|>"]]
    ids = lambda m, **kw: tok.encode(t.render(m, **kw), allow_special=True)  # noqa: E731
    default_sys = _turn(tok, "system", "You are Kimi, an AI assistant created by Moonshot AI.")
    body = _turn(tok, "user", msgs[0]["content"]) + _turn(tok, "assistant", "4.")
    assert ids(msgs) == default_sys + body + gen
    assert ids(msgs, add_generation_prompt=False) == default_sys + body
    sys_msgs = [{"role": "system", "content": "Be brief."}, msgs[0]]
    assert ids(sys_msgs) == _turn(tok, "system", "Be brief.") + _turn(tok, "user", msgs[0]["content"]) + gen
    assert ids(sys_msgs)[:1] == [tok.vocab_size - 256 + 10]  # the first id literally: <|im_system|>
    assert t.render(sys_msgs) == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
                                  "<|im_user|>user<|im_middle|>你好, what is 2+2?<|im_end|>"
                                  "<|im_assistant|>assistant<|im_middle|>")

def test_errors(tmp_path, tok_dir):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        KimiTokenizer.from_dir(missing)
    with pytest.raises(FileNotFoundError, match="tiktoken.model"):
        KimiTokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("QQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=r"line 2 .*tiktoken\.model"):
        KimiTokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("QQ== 0\nQg== 5\n")
    with pytest.raises(ValueError, match="tiktoken.model"):
        KimiTokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_bytes((tok_dir / "tiktoken.model").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        KimiTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"5": {"content": "x"}}}))
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        KimiTokenizer.from_dir(tmp_path)


def test_shipped_demo_tokenizer_is_the_trainers_output(tmp_path):
    """k2jax/data/demo_tokenizer holds exactly what tests/bpe.py writes (`python -m tests.bpe` regenerates it),
    and loads as the demo's vocabulary: 1024 ids, exactly the demo config's vocab_size."""
    made = write_test_tokenizer(tmp_path / "tok", num_merges=DEMO_MERGES)
    shipped = sorted(p.name for p in DEMO_TOKENIZER_DIR.iterdir())
    assert shipped == sorted(p.name for p in made.iterdir()) == ["tiktoken.model", "tokenizer_config.json"]
    for name in shipped:
        assert (DEMO_TOKENIZER_DIR / name).read_bytes() == (made / name).read_bytes(), name
    tok = demo_tokenizer()
    assert tok.vocab_size == DEMO_CONFIG["vocab_size"] == 1024 and tok.decode(tok.encode(TEXTS[0])) == TEXTS[0]
