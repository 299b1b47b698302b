"""``python -m prefixmesh.services.edge``: run the HTTP edge."""

from prefixmesh.services.edge.config import EdgeConfig
from prefixmesh.services.edge.service import EdgeService
from prefixmesh.shared.runtime.config import parse
from prefixmesh.shared.runtime.lifecycle import main
from prefixmesh.shared.runtime.log import setup_logging

if __name__ == "__main__":
    cfg = parse(EdgeConfig, None, "python -m prefixmesh.services.edge",
                "OpenAI-compatible HTTP API in front of the prefixmesh mesh.")
    setup_logging("edge", cfg.log_level, cfg.log_json)
    main(lambda: EdgeService(cfg), cfg.drain_timeout_s)
