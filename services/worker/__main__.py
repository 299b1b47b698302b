"""``python -m services.worker``: run one engine replica."""

from services.worker.config import WorkerConfig
from services.worker.service import WorkerService
from shared.config import parse
from shared.lifecycle import main
from shared.log import setup_logging

if __name__ == "__main__":
    cfg = parse(WorkerConfig, None, "python -m services.worker",
                "One engine replica (simulated GPU by default) with its local scheduler.")
    setup_logging("worker", cfg.log_level, cfg.log_json)
    main(lambda: WorkerService(cfg), cfg.drain_timeout_s)
