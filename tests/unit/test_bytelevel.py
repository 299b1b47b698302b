"""The Python byte-level encoder gives the tokenizers library's ids, or declines.

``shared/text/bytelevel.py`` replaces the library's ``encode`` for tokenizers of GPT-2's
shape; every id it gives must be the library's. Compared here on real conversations and
documents, on every character of the Basic Multilingual Plane and every 31st above it in
contexts that exercise each branch of the split (spaces before numerals, contractions,
runs of whitespace), on added tokens, with and without the ``Digits`` pre-tokenizer; text
with letters of a newer Unicode and configurations it does not reproduce are left to the
library.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, pre_tokenizers
from tokenizers.models import BPE, WordLevel

from prefixmesh.loadgen.workloads.sources import loogle_documents, sharegpt_conversations
from prefixmesh.shared.text import bytelevel, tokenizer
from prefixmesh.shared.text.bytelevel import ByteLevelEncoder
from prefixmesh.shared.text.tokenizer import TextTokenizer

# Contexts around one character: alone, inside words, beside numerals and whitespace runs
# (every one for the characters below U+0800, the first four for the others).
CONTEXTS = ("a{c}b", "a  {c}5", " {c}{c}x", "x{c}\t\t3y", "{c}", " {c} ", "1{c}2",
            "a {c}  b", "{c}\n\n", "'{c}s", "5 {c}  7", "{c} 5")
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<filename>", "<|im_start|>user\n",
            "<|im_end", "<|im_start|><|im_end|>")


def _library_ids(backend: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in backend.encode_batch_fast(texts)]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Turns of real conversations (English, code, other scripts, numbers, markdown)."""
    return [v for c in sharegpt_conversations(max_bytes=4_000_000) for _, v in c]


@pytest.fixture(scope="module")
def characters() -> list[str]:
    """Every code point of the Basic Multilingual Plane but surrogates, and every 31st
    above it, that the encoder takes (not of ``NEWER_UNICODE``)."""
    cps = [*range(0xD800), *range(0xE000, 0x10000), *range(0x10000, 0x110000, 31)]
    return [chr(c) for c in cps if not bytelevel.UNVOUCHED.match(chr(c))]


def _plain_byte_level(tok: TextTokenizer) -> Tokenizer:
    """SmolLM2's tokenizer without its ``Digits`` step (GPT-2's own pre-tokenizer)."""
    backend = Tokenizer.from_str(tok.backend.to_str())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return backend


def test_default_tokenizer_uses_it(tok: TextTokenizer) -> None:
    encoder = ByteLevelEncoder.of(tok.backend)
    assert encoder is not None
    assert tok._fast is not None
    text = "17: measure the router path with a short prompt that nobody shares."
    assert tok.encode(text) == tok.backend.encode(text).ids == encoder.encode(text)
    assert tok.encode("") == []


@pytest.mark.parametrize("digits", [True, False], ids=["digits", "plain"])
def test_conversations_match_the_library(tok: TextTokenizer, texts: list[str],
                                         digits: bool) -> None:
    backend = tok.backend if digits else _plain_byte_level(tok)
    encoder = ByteLevelEncoder.of(backend)
    assert encoder is not None and (encoder._words_re is bytelevel.WORDS_DIGITS) == digits
    assert len(texts) > 2000
    expected = _library_ids(backend, texts)
    taken = [(t, ids) for t, ids in zip(texts, expected) if encoder.encode(t) is not None]
    assert len(taken) > 0.99 * len(texts)  # the rest hold letters of a newer Unicode
    assert [t[:80] for t, ids in taken if encoder.encode(t) != ids] == []
    # TextTokenizer gives the library's ids for every text, taken or not.
    tokenizer = TextTokenizer(backend)
    assert [t[:80] for t, ids in zip(texts, expected) if tokenizer.encode(t) != ids] == []


@pytest.mark.parametrize("digits", [True, False], ids=["digits", "plain"])
def test_every_character_matches(tok: TextTokenizer, characters: list[str],
                                 digits: bool) -> None:
    backend = tok.backend if digits else _plain_byte_level(tok)
    encoder = ByteLevelEncoder.of(backend)
    assert encoder is not None
    assert len(characters) > 90_000
    for i, context in enumerate(CONTEXTS):
        batch = [context.format(c=c) for c in characters if i < 4 or c < "\u0800"]
        expected = _library_ids(backend, batch)
        mismatched = [t for t, ids in zip(batch, expected) if encoder.encode(t) != ids]
        assert mismatched == [], context


def test_documents_match_the_library(tok: TextTokenizer) -> None:
    """LooGLE's long documents (English with typographic quotes and dashes), whole."""
    encoder = ByteLevelEncoder.of(tok.backend)
    assert encoder is not None
    for doc in loogle_documents():
        text = tok.decode(doc.text)
        ids = encoder.encode(text)
        assert ids is not None and ids == tok.backend.encode(text).ids == doc.text


def test_added_tokens_match_the_library(tok: TextTokenizer, texts: list[str]) -> None:
    encoder = ByteLevelEncoder.of(tok.backend)
    assert encoder is not None
    rng = random.Random(0)
    mixed = []
    for text in texts[:1500]:
        parts = list(text[:400])
        for _ in range(3):
            parts.insert(rng.randrange(len(parts) + 1), rng.choice(SPECIALS))
        mixed.append("".join(parts))
    mixed += list(SPECIALS) + ["".join(SPECIALS), "x<|im_end|>1<|im_end|> 2"]
    expected = _library_ids(tok.backend, mixed)
    got = [encoder.encode(t) for t in mixed]
    assert sum(ids is not None for ids in got) > 0.99 * len(mixed)
    assert [t[:80] for t, ids, want in zip(mixed, got, expected)
            if ids is not None and ids != want] == []
    assert encoder.encode("<|im_start|>user\nhi<|im_end|>")[0] == tok.token_to_id("<|im_start|>")


@pytest.mark.parametrize("text", ["\U00012576", "a \u0558 1", "x\U00012576 5",
                                  "<|im_end|>\U0002ebf0 \u4e2d"])
def test_letters_of_a_newer_unicode_are_left_to_the_library(tok: TextTokenizer,
                                                            text: str) -> None:
    encoder = ByteLevelEncoder.of(tok.backend)
    assert encoder is not None
    assert encoder.encode(text) is None
    assert tok.encode(text) == tok.backend.encode(text).ids
    # Other scripts are taken.
    assert encoder.encode("\u201cquoted\u201d \u2014 \u4e2d\u6587 \u3042 \u0557") is not None


def test_long_text_goes_to_the_library(tok: TextTokenizer,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``PYTHON_ENCODE_CHARS`` the library encodes (it releases the GIL)."""
    fresh = TextTokenizer(tok.backend)
    assert fresh._fast is not None
    calls = []
    monkeypatch.setattr(fresh._fast, "encode", lambda text: calls.append(text) or [7])
    short = "a" * tokenizer.PYTHON_ENCODE_CHARS
    long = short + " b"
    assert fresh.encode(short) == [7]
    assert fresh.encode(long) == tok.backend.encode(long).ids
    assert calls == [short]


def test_cache_is_bounded(tok: TextTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bytelevel, "CACHE_WORDS", 50)
    encoder = ByteLevelEncoder.of(tok.backend)
    assert encoder is not None
    words = [f" w{i:x}q{i * 7919 % 1000:d}zz" for i in range(400)]
    text = "".join(words)
    assert encoder.encode(text) == tok.backend.encode(text).ids
    assert 0 < len(encoder._cache) <= 50


def _toy_bpe(pre: pre_tokenizers.PreTokenizer | None) -> Tokenizer:
    chars = bytelevel.byte_chars()
    vocab = {c: i for i, c in enumerate(chars)}
    backend = Tokenizer(BPE(vocab, []))
    backend.pre_tokenizer = pre
    return backend


@pytest.mark.parametrize("change", ["whitespace", "prefix_space", "lstrip", "dropout",
                                    "word_level", "no_pre_tokenizer"])
def test_other_configurations_are_declined(change: str) -> None:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if change == "whitespace":
        backend = _toy_bpe(pre_tokenizers.Whitespace())
    elif change == "prefix_space":
        backend = _toy_bpe(pre_tokenizers.ByteLevel(add_prefix_space=True))
    elif change == "lstrip":
        backend = _toy_bpe(byte_level)
        backend.add_special_tokens([AddedToken("<x>", lstrip=True)])
    elif change == "dropout":
        chars = bytelevel.byte_chars()
        backend = Tokenizer(BPE({c: i for i, c in enumerate(chars)}, [], dropout=0.5))
        backend.pre_tokenizer = byte_level
    elif change == "word_level":
        backend = Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
        backend.pre_tokenizer = byte_level
    else:
        backend = _toy_bpe(None)
    assert ByteLevelEncoder.of(backend) is None
    # TextTokenizer keeps the library's encode for them.
    tok = TextTokenizer(backend)
    assert tok._fast is None
    assert tok.encode("ab c") == backend.encode("ab c").ids


def test_a_toy_byte_level_tokenizer_is_accepted() -> None:
    backend = _toy_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False))
    encoder = ByteLevelEncoder.of(backend)
    assert encoder is not None
    text = "Hello, wörld 42 's\n\n  x"
    assert encoder.encode(text) == backend.encode(text).ids
