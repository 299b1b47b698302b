"""``python -m services.tokenizer``: run a tokenizer replica."""

from services.tokenizer.service import TokenizerConfig, TokenizerService
from shared.config import parse
from shared.lifecycle import main
from shared.log import setup_logging

if __name__ == "__main__":
    cfg = parse(TokenizerConfig, None, "python -m services.tokenizer",
                "Text and chat messages to token ids over NATS (queue group).")
    setup_logging("tokenizer", cfg.log_level, cfg.log_json)
    main(lambda: TokenizerService(cfg), cfg.drain_timeout_s)
