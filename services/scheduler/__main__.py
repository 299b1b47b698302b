"""``python -m prefixmesh.services.scheduler``: run the global scheduler.

Two config groups share the command line and the ``PM_*`` environment: the service's own
``SchedulerConfig`` and the policy's knobs, ``PolicyConfig`` (e.g. ``--th-bal`` /
``PM_TH_BAL``, ``--window-s``, ``--imbalance-ratio``; units and defaults in its fields).
"""

import argparse

from prefixmesh.services.scheduler.policies.base import PolicyConfig
from prefixmesh.services.scheduler.service import SchedulerConfig, SchedulerService
from prefixmesh.shared.runtime.config import add_arguments, from_sources
from prefixmesh.shared.runtime.lifecycle import main
from prefixmesh.shared.runtime.log import setup_logging


def parse(argv: list[str] | None = None) -> tuple[SchedulerConfig, PolicyConfig]:
    """Both config groups from defaults < env < CLI."""
    parser = argparse.ArgumentParser(
        prog="python -m prefixmesh.services.scheduler",
        description="Global E2 scheduler: routes requests to workers by prefix cache and load.")
    add_arguments(parser, SchedulerConfig)
    add_arguments(parser.add_argument_group("policy knobs (services/scheduler/policies/base.py "
                                            "PolicyConfig)"), PolicyConfig)
    args = parser.parse_args(argv)
    return from_sources(SchedulerConfig, args), from_sources(PolicyConfig, args)


if __name__ == "__main__":
    cfg, policy_cfg = parse()
    setup_logging("scheduler", cfg.log_level, cfg.log_json)
    main(lambda: SchedulerService(cfg, policy_cfg), cfg.drain_timeout_s)
