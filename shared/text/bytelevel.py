"""Byte-level BPE encoding in Python with a word cache: the same ids as the ``tokenizers``
library for tokenizers of GPT-2's shape (SmolLM2's among them), several times faster
(docs/benchmarks.md, "The tokenizer's word cache").

A byte-level BPE tokenizer encodes a text in three steps: it cuts out the added tokens
(``<|im_end|>``), splits the rest into words with one regular expression (GPT-2's; with a
``Digits`` pre-tokenizer first, every numeral on its own), and runs BPE merges on each
word's bytes (mapped to printable characters). The library's regular expression engine
costs most of a short prompt's encoding; the merges it caches per word itself. Here the
splitting runs on the ``regex`` module and each word's ids come from a dict, filled on a
miss from the library's own BPE model (``Tokenizer.model.tokenize``), so the merges and
the vocabulary stay the library's.

``ByteLevelEncoder.of`` accepts a tokenizer only when its configuration is one this module
reproduces exactly (no normalizer, that pre-tokenizer shape, deterministic BPE, added
tokens matched verbatim, no truncation or padding, a post-processor that adds no tokens);
for any other it returns None and the caller keeps the library's ``encode``. Text holding
a letter or numeral of a Unicode version newer than 14.0 goes to the library too
(``NEWER_UNICODE``). ``tests/unit/test_bytelevel.py`` compares both on real conversations,
documents and every character of the Basic Multilingual Plane.
"""

from __future__ import annotations

import json
from typing import Any

import regex
from tokenizers import Tokenizer

# GPT-2's split: contractions, letters, numbers, other symbols (each with one leading
# space), then runs of spaces (a last space is left to start the next word).
WORDS = regex.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
# The same after a ``Digits(individual_digits=True)`` pre-tokenizer, in one pass: that one
# cuts the text before and after every numeral and GPT-2's split runs on each piece, so a
# numeral stands alone (never after a space) and spaces before one end their piece.
WORDS_DIGITS = regex.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+")
# Letters, numerals and spaces of the Unicode versions after 14.0 (code point ranges):
# each character the ``regex`` module (the newest Unicode) puts in \p{L}, \p{N} or \s and
# Python 3.11's ``unicodedata`` (Unicode 14.0) in none of them. The library's engines may
# know an older Unicode and take such a character for a symbol (U+12576: a numeral to
# ``regex``, unassigned to the library), so text holding one is left to the library.
# Every other character splits alike (tests/unit/test_bytelevel.py).
NEWER_UNICODE = (
    "0558 058B-058C 088F 0C5C 0CDC 1C89-1C8A 208F 209D-209F A7CB-A7CF A7D2 A7D4 A7DA-A7DD "
    "A7E2 A7F1 AB6C-AB6D 105C0-105F3 107BB-107BF 10940-10959 10D40-10D65 10D6F-10D85 "
    "10EC2-10EC7 10ED9-10EEE 1123F-11240 11380-11389 1138B 1138E 11390-113B5 113B7 113D1 "
    "113D3 116D0-116E3 11B0A 11BC0-11BE0 11BF0-11BF9 11DB0-11DDB 11DE0-11DE9 11DF1 11F02 "
    "11F04-11F10 11F12-11F33 11F50-11F59 1246F 12475-1247F 12550-12686 1342F 13441-13446 "
    "13460-143FA 16100-1611D 16130-16139 16D40-16D6C 16D70-16D79 16EA0-16EB8 16EBB-16ED3 "
    "16FF2-16FF6 187F8-187FF 18CD6-18CDA 18CFF 18D09-18D20 18D80-18DF2 18E00-19191 "
    "191A0-191D2 1B123-1B128 1B132 1B155 1B168 1CCF0-1CCF9 1D2C0-1D2D3 1D6A6 1DF1F-1DF81 "
    "1DF90-1DF96 1DFCD-1DFFF 1E030-1E06D 1E4D0-1E4EB 1E4F0-1E4F9 1E5D0-1E5ED 1E5F0-1E5FA "
    "1E6C0-1E6DE 1E6E0-1E6E2 1E6E4-1E6E5 1E6E7-1E6ED 1E6F0-1E6F4 1E6FE-1E6FF 2B739-2B73F "
    "2B81E 2CEA2-2CEAD 2EBF0-2EE5D 31350-33479 3D000-3FC3F"
)
UNVOUCHED = regex.compile("[" + "".join(
    "-".join(chr(int(cp, 16)) for cp in span.split("-")) for span in NEWER_UNICODE.split()
) + "]")
# Distinct words cached at most; the cache starts over past it (bounds memory under
# adversarial input, while ordinary text repeats a few thousand words).
CACHE_WORDS = 1 << 16


def byte_chars() -> list[str]:
    """The character GPT-2's byte-level alphabet writes for each byte value: printable
    Latin-1 characters stand for themselves, the others for characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0x100
    for b in range(256):
        if b not in chars:
            chars[b] = chr(extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _state(component: Any) -> dict[str, Any] | None:
    """A tokenizer component's configuration as its tokenizer.json entry (None: none)."""
    return None if component is None else json.loads(component.__getstate__())


def _supported(tokenizer: Tokenizer) -> tuple[bool, bool]:
    """Whether ``tokenizer``'s configuration is one ``ByteLevelEncoder`` reproduces, and
    whether its pre-tokenizer puts every numeral alone first."""

    def byte_level(p: dict[str, Any]) -> bool:
        return (p.get("type") == "ByteLevel" and p.get("use_regex", True)
                and not p.get("add_prefix_space", True))

    pre = _state(tokenizer.pre_tokenizer) or {}
    steps = pre.get("pretokenizers", [])
    digits = (pre.get("type") == "Sequence" and len(steps) == 2
              and steps[0].get("type") == "Digits" and steps[0].get("individual_digits") is True
              and byte_level(steps[1]))
    model = tokenizer.model
    ok_model = (type(model).__name__ == "BPE" and not model.dropout
                and not model.continuing_subword_prefix and not model.end_of_word_suffix
                and not model.byte_fallback)
    post = _state(tokenizer.post_processor)
    ok_added = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized)
                   for t in tokenizer.get_added_tokens_decoder().values())
    ok = ((digits or byte_level(pre)) and ok_model and ok_added
          and tokenizer.normalizer is None and tokenizer.truncation is None
          and tokenizer.padding is None and (post is None or post.get("type") == "ByteLevel"))
    return ok, digits


class ByteLevelEncoder:
    """Text -> ids for one supported byte-level BPE tokenizer (``of``)."""

    def __init__(self, tokenizer: Tokenizer, added: dict[str, int], digits: bool) -> None:
        self._model = tokenizer.model
        self._added = added
        # Added tokens, longest first: at one position the longest one matches.
        self._added_re = regex.compile("|".join(
            regex.escape(t) for t in sorted(added, key=len, reverse=True))) if added else None
        self._words_re = WORDS_DIGITS if digits else WORDS
        self._chars = byte_chars()
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ByteLevelEncoder | None:
        """The encoder for ``tokenizer``, or None when its configuration is not one this
        module reproduces exactly."""
        ok, digits = _supported(tokenizer)
        if not ok:
            return None
        added = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
        return cls(tokenizer, added, digits)

    def encode(self, text: str) -> list[int] | None:
        """Token ids of ``text``, added tokens in it matched as the library matches them;
        None when ``text`` holds a character of ``NEWER_UNICODE`` (the library's
        ``encode`` then answers)."""
        if not text.isascii() and UNVOUCHED.search(text):
            return None
        if self._added_re is None:
            return self._words(text)
        out: list[int] = []
        pos = 0
        for m in self._added_re.finditer(text):
            if m.start() > pos:
                out += self._words(text[pos:m.start()])
            out.append(self._added[m.group()])
            pos = m.end()
        if pos == 0:
            return self._words(text)
        if pos < len(text):
            out += self._words(text[pos:])
        return out

    def _words(self, text: str) -> list[int]:
        """Ids of text without added tokens."""
        cache = self._cache
        out: list[int] = []
        for word in self._words_re.findall(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._merge(word)
            out += ids
        return out

    def _merge(self, word: str) -> list[int]:
        """One word's ids from the library's BPE model, cached."""
        if len(self._cache) >= CACHE_WORDS:
            self._cache.clear()
        chars = self._chars
        ids = [t.id for t in self._model.tokenize("".join([chars[b] for b in word.encode()]))]
        self._cache[word] = ids
        return ids
