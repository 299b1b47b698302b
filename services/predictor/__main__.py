"""``python -m services.predictor``: run the output-length predictor."""

from services.predictor.service import PredictorConfig, PredictorService
from shared.config import parse
from shared.lifecycle import main
from shared.log import setup_logging

if __name__ == "__main__":
    cfg = parse(PredictorConfig, None, "python -m services.predictor",
                "Output-length prediction over NATS (request/reply, queue group).")
    setup_logging("predictor", cfg.log_level, cfg.log_json)
    main(lambda: PredictorService(cfg), cfg.drain_timeout_s)
