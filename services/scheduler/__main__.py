"""``python -m services.scheduler``: run the global scheduler."""

from services.scheduler.service import SchedulerConfig, SchedulerService
from shared.config import parse
from shared.lifecycle import main
from shared.log import setup_logging

if __name__ == "__main__":
    cfg = parse(SchedulerConfig, None, "python -m services.scheduler",
                "Global E2 scheduler: routes requests to workers by prefix cache and load.")
    setup_logging("scheduler", cfg.log_level, cfg.log_json)
    main(lambda: SchedulerService(cfg), cfg.drain_timeout_s)
