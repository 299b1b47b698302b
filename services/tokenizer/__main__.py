"""``python -m prefixmesh.services.tokenizer``: run a tokenizer replica."""

from prefixmesh.services.tokenizer.service import TokenizerConfig, TokenizerService
from prefixmesh.shared.runtime.config import parse
from prefixmesh.shared.runtime.lifecycle import main
from prefixmesh.shared.runtime.log import setup_logging

if __name__ == "__main__":
    cfg = parse(TokenizerConfig, None, "python -m prefixmesh.services.tokenizer",
                "Text and chat messages to token ids over NATS (queue group).")
    setup_logging("tokenizer", cfg.log_level, cfg.log_json)
    main(lambda: TokenizerService(cfg), cfg.drain_timeout_s)
