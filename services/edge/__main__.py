"""``python -m services.edge``: run the HTTP edge."""

from services.edge.config import EdgeConfig
from services.edge.service import EdgeService
from shared.config import parse
from shared.lifecycle import main
from shared.log import setup_logging

if __name__ == "__main__":
    cfg = parse(EdgeConfig, None, "python -m services.edge",
                "OpenAI-compatible HTTP API in front of the prefixmesh mesh.")
    setup_logging("edge", cfg.log_level, cfg.log_json)
    main(lambda: EdgeService(cfg), cfg.drain_timeout_s)
