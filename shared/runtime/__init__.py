"""What every process shares at run time: lifecycle, typed config, logging, metrics, and
starting the NATS and Redis servers."""
