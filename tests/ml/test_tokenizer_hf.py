"""Our GGUF-built SmolLM2 tokenizer against transformers' own GGUF conversion ([ml] extra).

transformers rebuilds a ``tokenizer.ggml.model = gpt2`` vocabulary as a plain GPT-2 byte-level
BPE (4.x: ``GGUFLlamaConverter``'s llama-3 path; 5.x: ``byte_level_tokenizer``, with no split
regex for ``tokenizer.ggml.pre = smollm``). Both omit SmolLM2's ``Digits(individual_digits=
True)`` pre-tokenizer, which changes ids only where a run of whitespace meets a digit ("x  42",
"\\n\\n1."). Where transformers lacks that step, ids are compared with it removed from ours
too (everything else must agree exactly) and the gap is checked to be exactly the known one;
the unit tests pin the digit behaviour to the ids of SmolLM2's real Hugging Face tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

# transformers reads GGUF files only with torch installed.
from tests.helpers import need  # noqa: E402

need("ml", "torch", "transformers")
import transformers  # noqa: E402
from tokenizers import Tokenizer, pre_tokenizers  # noqa: E402

from prefixmesh.shared.text.gguf_vocab import (  # noqa: E402
    ensure_default_tokenizer,
    find_smollm2_gguf,
)
from prefixmesh.shared.text.tokenizer import TextTokenizer  # noqa: E402
from prefixmesh.shared.wire import ChatMessage  # noqa: E402

STRINGS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "In 2026, the weather",
    "Order #12345 shipped 2024-06-01 at 09:30, total $1,234.56",
    "x  42 and\n\n1. first\n2. second",
    "naïve café déjà vu — “quotes” ‘single’ …",
    "中文字符 日本語のテキスト 한국어 텍스트 العربية עברית",
    "emoji 🎉🚀 family 👩‍👩‍👧 flag 🇫🇷 skin 👍🏽",
    "  leading, trailing  \n\n\ttabs\r\nCRLF   \u00a0nbsp\u200bzwsp  ",
    "math ∑∫√∞ ≠ ≤ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 x²+y³",
    "def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>prefixmesh<file_sep>README.md",
]


@pytest.fixture(scope="module")
def hf() -> Any:
    gguf = find_smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _splits_digits(backend: Tokenizer) -> bool:
    return '"Digits"' in json.dumps(json.loads(backend.to_str())["pre_tokenizer"])


def _comparable(tok: TextTokenizer, hf: Any) -> Tokenizer:
    """Our backend, minus the Digits step when transformers' conversion lacks it."""
    backend = Tokenizer.from_str(tok.backend.to_str())
    if not _splits_digits(hf.backend_tokenizer):
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return backend


def test_same_vocabulary(tok: TextTokenizer, hf: Any) -> None:
    assert hf.get_vocab() == tok.backend.get_vocab(with_added_tokens=True)


@pytest.mark.parametrize("text", STRINGS)
def test_same_ids(tok: TextTokenizer, hf: Any, text: str) -> None:
    expected = hf.encode(text, add_special_tokens=False)
    assert _comparable(tok, hf).encode(text, add_special_tokens=False).ids == expected


@pytest.mark.parametrize("text", STRINGS)
def test_same_text(tok: TextTokenizer, hf: Any, text: str) -> None:
    ids = tok.encode(text)
    decoded = hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert decoded == tok.decode(ids, skip_special_tokens=False) == text


def test_digit_gap_is_the_known_one(tok: TextTokenizer, hf: Any) -> None:
    ids = hf.encode("x  42", add_special_tokens=False)
    if _splits_digits(hf.backend_tokenizer):
        assert ids == tok.encode("x  42")
    else:
        pieces = ["x", "Ġ", "Ġ", "4", "2"]  # GPT-2 regex alone: [" ", " 42"]
        assert ids == [tok.token_to_id(p) for p in pieces]


def test_same_chat_prompt(tok: TextTokenizer, hf: Any) -> None:
    if not getattr(hf, "chat_template", None):
        pytest.skip("this transformers version drops the GGUF chat template")
    messages = [
        ChatMessage(role="user", content="What is 2+2?"),
        ChatMessage(role="assistant", content="4."),
        ChatMessage(role="user", content="And 3+3?"),
    ]
    as_dicts = [{"role": m.role, "content": m.content} for m in messages]
    for add in (True, False):
        expected = hf.apply_chat_template(as_dicts, tokenize=False, add_generation_prompt=add)
        assert tok.apply_chat_template(messages, add_generation_prompt=add) == expected


def test_our_folder_loads_in_transformers(tok: TextTokenizer, tokenizer_dir: Path) -> None:
    json_path = ensure_default_tokenizer(tokenizer_dir)
    loaded = transformers.AutoTokenizer.from_pretrained(str(json_path.parent))
    assert loaded.eos_token_id == tok.eos_token_id
    for text in STRINGS:
        assert loaded.encode(text, add_special_tokens=True) == tok.encode(text)
