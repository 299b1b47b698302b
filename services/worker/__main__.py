"""``python -m prefixmesh.services.worker``: run one engine replica.

``prefixmesh worker`` is the same with two conveniences for a standalone HTTP worker:
``--http PORT`` is short for ``--http-port PORT``, and unless ``--nats-url`` (or
``PM_NATS_URL``) is given the worker does not join a mesh (``--no-mesh``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence

from prefixmesh.services.worker.config import WorkerConfig
from prefixmesh.services.worker.group import WorkerGroup
from prefixmesh.services.worker.http import serve_http
from prefixmesh.services.worker.service import WorkerService
from prefixmesh.shared.runtime.config import ENV_PREFIX, parse
from prefixmesh.shared.runtime.lifecycle import main as run_main
from prefixmesh.shared.runtime.log import setup_logging


def _standalone_argv(argv: list[str]) -> list[str]:
    out = ["--http-port" if a == "--http" else
           a.replace("--http=", "--http-port=", 1) if a.startswith("--http=") else a
           for a in argv]
    wants_mesh = any(a.startswith(("--nats-url", "--mesh")) for a in out) or (
        ENV_PREFIX + "NATS_URL" in os.environ)
    if not wants_mesh and not any(a.startswith("--no-mesh") for a in out):
        out.append("--no-mesh")
    return out


def main(argv: Sequence[str] | None = None, standalone: bool = False) -> int:
    """Parse the worker's config and run it until SIGINT/SIGTERM."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "prefixmesh worker" if standalone else "python -m prefixmesh.services.worker"
    cfg = parse(WorkerConfig, _standalone_argv(argv) if standalone else argv, prog,
                "One engine replica (simulated GPU by default) with its local scheduler.")
    if not cfg.mesh and not cfg.http_port:
        raise SystemExit("a worker outside the mesh needs --http PORT")
    if not cfg.worker_id and cfg.http_port:  # a readable id for logs and /server_info
        cfg = dataclasses.replace(cfg, worker_id=f"http-{cfg.http_port}")
    setup_logging("worker", cfg.log_level, cfg.log_json)
    if cfg.worker_ids:
        run_main(lambda: WorkerGroup(cfg), cfg.drain_timeout_s)
        return 0
    front = serve_http if cfg.http_port else None
    run_main(lambda: WorkerService(cfg, front), cfg.drain_timeout_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
