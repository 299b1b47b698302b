"""``python -m prefixmesh.services.metrics``: run the cluster metrics service."""

from prefixmesh.services.metrics.service import MetricsConfig, MetricsService
from prefixmesh.shared.runtime.config import parse
from prefixmesh.shared.runtime.lifecycle import main
from prefixmesh.shared.runtime.log import setup_logging

if __name__ == "__main__":
    cfg = parse(MetricsConfig, None, "python -m prefixmesh.services.metrics",
                "Cluster view from the bus: Prometheus /metrics and JSON /cluster.")
    setup_logging("metrics", cfg.log_level, cfg.log_json)
    main(lambda: MetricsService(cfg), cfg.drain_timeout_s)
