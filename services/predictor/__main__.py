"""``python -m prefixmesh.services.predictor``: run the output-length predictor."""

from prefixmesh.services.predictor.service import PredictorConfig, PredictorService
from prefixmesh.shared.runtime.config import parse
from prefixmesh.shared.runtime.lifecycle import main
from prefixmesh.shared.runtime.log import setup_logging

if __name__ == "__main__":
    cfg = parse(PredictorConfig, None, "python -m prefixmesh.services.predictor",
                "Output-length prediction over NATS (request/reply, queue group).")
    setup_logging("predictor", cfg.log_level, cfg.log_json)
    main(lambda: PredictorService(cfg), cfg.drain_timeout_s)
