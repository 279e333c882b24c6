"""Deployment files agree with the daemon: Kubernetes manifests (validated against the
Kubernetes API schemas bundled in kubernetes-validate, offline), the Prometheus
Operator monitors, the systemd unit (systemd-analyze), and the Dockerfile (hadolint
and its structure; no Docker daemon runs here, so the image is not built)."""

import copy
import re
import shutil
import sys
import tomllib
import zipfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from radixkv_server.config import DaemonConfig, load_config
from radixkv_server.units import parse_size
from tests.support.daemon import wait_for
from opstools import BIN, REPO, run_tool

DEPLOY = REPO / "deploy"
K8S_VERSION = "1.34"  # the oldest the example needs: DRA resource.k8s.io/v1, native sidecars
SOCKET_DIR = "/run/radixkv"
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def manifests() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        out += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def by_kind(kind: str) -> list[dict]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def pod_spec() -> dict:
    (deployment,) = by_kind("Deployment")
    return deployment["spec"]["template"]


def sidecar() -> dict:
    (c,) = [c for c in pod_spec()["spec"]["initContainers"] if c["name"] == "radixkv"]
    return c


def daemon_config_of(container: dict) -> DaemonConfig:
    """The configuration the daemon would resolve from this container's env and args."""
    env = {e["name"]: str(e["value"]) for e in container.get("env", [])}
    unknown = [k for k in env if k.startswith("RADIXKV_")
               and k[len("RADIXKV_"):].lower() not in DaemonConfig.__dataclass_fields__]
    assert not unknown, f"variables the daemon does not read: {unknown}"
    return load_config(list(container.get("args", [])), environ=env)


def test_every_yaml_under_deploy_parses():
    paths = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(paths) >= 4
    for path in paths:
        if path.parent.name == "prometheus":  # rule files: promtool checks them (test_ops_metrics)
            assert yaml.safe_load(path.read_text()), path
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                assert {"apiVersion", "kind", "metadata"} <= set(doc), path
                assert doc["metadata"].get("name"), path


def test_kubernetes_manifests_validate_against_the_api_schemas():
    kinds = set()
    for path, doc in manifests():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: checked below, structurally
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError
        kinds.add(doc["kind"])
    assert {"Deployment", "Service", "ResourceClaimTemplate"} <= kinds
    # The validator is not vacuous: an unknown field and a wrong type are rejected.
    (deployment,) = by_kind("Deployment")
    for mutate in (lambda d: d["spec"]["template"]["spec"]["initContainers"][0].update(livenesProbe={}),
                   lambda d: d["spec"]["template"]["spec"]["initContainers"][0]["ports"][0].update(containerPort="x")):
        broken = copy.deepcopy(deployment)
        mutate(broken)
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_the_prometheusrule_carries_the_alert_rules_promtool_checks():
    # A `kubectl apply` of deploy/kubernetes/ gave scraping but no alert, RadixKVDown
    # included; the PrometheusRule is generated from the rule file promtool tests.
    (rule,) = by_kind("PrometheusRule")
    rules = yaml.safe_load((DEPLOY / "prometheus" / "radixkv-alerts.yml").read_text())
    assert rule["spec"]["groups"] == rules["groups"], "stale: run `python scripts/gen_prometheusrule.py`"
    (monitor,) = by_kind("ServiceMonitor")
    assert rule["metadata"]["labels"]["release"] == monitor["metadata"]["labels"]["release"]


def test_sidecar_matches_the_daemons_flags():
    pod = pod_spec()
    spec, labels = pod["spec"], pod["metadata"]["labels"]
    side = sidecar()
    assert side["restartPolicy"] == "Always", "radixkv must be a native sidecar"
    config = daemon_config_of(side)
    (metrics_port,) = [p for p in side["ports"] if p["name"] == "metrics"]
    assert metrics_port["containerPort"] == config.metrics_port
    assert config.metrics_host == "::", "Prometheus scrapes the pod IP, IPv4 or IPv6"
    assert config.listen == (f"unix://{SOCKET_DIR}/radixkv.sock",), "gRPC stays on the unix socket"
    # Socket and /dev/shm shared by both containers, from in-memory emptyDirs.
    volumes = {v["name"]: v for v in spec["volumes"]}
    for container in (side, *spec["containers"]):
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        for path in (SOCKET_DIR, "/dev/shm"):
            assert path in mounts, f"{container['name']} does not mount {path}"
            assert volumes[mounts[path]]["emptyDir"]["medium"] == "Memory"
        claims = {c["name"] for c in container["resources"].get("claims", [])}
        assert claims == {c["name"] for c in spec["resourceClaims"]}, "both containers need the same GPU"
    # Probes run the health script over the socket; their services are the daemon's.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = side[probe]["exec"]["command"]
        assert command[0] == "radixkv-health" and "radixkv-health" in SCRIPTS
    assert side["livenessProbe"]["exec"]["command"][-2:] == ["--service", ""]
    # Memory: requested = limit >= host pool x namespaces + the daemon's own ~1 GiB; and
    # the pod Guaranteed as the manifest says: CPU and memory requested = limit in every
    # container (one without a CPU limit made it Burstable, the pool an early OOM victim).
    limits, requests = side["resources"]["limits"], side["resources"]["requests"]
    for container in (side, *spec["containers"]):
        r = container["resources"]
        for resource in ("cpu", "memory"):
            assert r["limits"].get(resource) == r["requests"].get(resource), (container["name"], resource)
    # The critical invariant alert has something to count.
    assert config.invariant_check_interval > 0
    assert parse_size(limits["memory"]) >= config.host_pool_size * config.max_namespaces + 2**30
    # Shutdown: the kubelet waits longer than the daemon's grace and its storing.
    assert spec["terminationGracePeriodSeconds"] > config.shutdown_grace + config.shutdown_store_timeout
    assert spec["securityContext"]["runAsNonRoot"] is True
    # The daemon opens the engine's legacy CUDA IPC handles: not across PID namespaces.
    assert spec.get("shareProcessNamespace") is True
    assert spec["securityContext"]["runAsUser"] == dockerfile_uid()
    assert labels["radixkv/sidecar"] == "true"


def test_probe_commands_pass_against_a_live_daemon(module_daemon):
    env = {"RADIXKV_LISTEN": module_daemon.target, "PATH": str(BIN)}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        run_tool(sidecar()[probe]["exec"]["command"], env=env)


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m)", text)
    assert m, text
    return int(m.group(1)) * {"ms": 1e-3, "s": 1, "m": 60}[m.group(2)]


def test_service_and_monitors_select_the_sidecar_port():
    pod = pod_spec()
    labels = pod["metadata"]["labels"]
    port_names = {p["name"] for p in sidecar()["ports"]}
    (service,) = by_kind("Service")
    assert service["spec"]["clusterIP"] == "None", "the metrics Service is headless"
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    (sm,) = by_kind("ServiceMonitor")
    (pm,) = by_kind("PodMonitor")
    for monitor in (sm, pm):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    endpoints = sm["spec"]["endpoints"] + pm["spec"]["podMetricsEndpoints"]
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= port_names
    for e in endpoints:
        assert e["path"] == "/metrics"
        assert _seconds(e["scrapeTimeout"]) <= _seconds(e["interval"])
        # The Operator's `namespace` target label would rename radixkv's own (the cache
        # namespace every per-namespace panel and alert groups by) to exported_namespace.
        assert {"action": "labeldrop", "regex": "namespace"} in e["relabelings"]
        assert {"sourceLabels": ["__meta_kubernetes_namespace"], "targetLabel": "kubernetes_namespace"} \
            in e["relabelings"]


def test_the_readmes_tcp_listener_keeps_the_socket_the_probes_and_engine_use():
    """deploy/kubernetes/README.md's TCP recipe: a --listen flag replaces RADIXKV_LISTEN,
    so the recipe lists both; followed, the daemon still listens on the socket."""
    text = (DEPLOY / "kubernetes" / "README.md").read_text()
    (value,) = re.findall(r"`RADIXKV_LISTEN=([^`]+)`", text)
    env = {e["name"]: str(e["value"]) for e in sidecar()["env"]}
    env["RADIXKV_LISTEN"] = value
    listen = load_config([], environ=env).listen
    assert f"unix://{SOCKET_DIR}/radixkv.sock" in listen and any(a.startswith("0.0.0.0:") for a in listen)


# -- systemd -------------------------------------------------------------------------

def unit_entries(text: str) -> dict[str, list[str]]:
    """Key -> values (systemd allows repeated keys), across sections."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_systemd_unit_settings():
    unit = unit_entries((DEPLOY / "systemd" / "radixkv.service").read_text())
    assert unit["RuntimeDirectory"] == ["radixkv"]
    assert unit["Restart"] == ["on-failure"]
    assert unit["KillSignal"] == ["SIGTERM"]
    assert unit["EnvironmentFile"][0].lstrip("-") == "/etc/radixkv/radixkv.env"
    assert unit["ExecStart"][0].split()[0].endswith("/radixkv-server")
    for key in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp", "RestrictNamespaces",
                "CapabilityBoundingSet", "SystemCallFilter", "RestrictAddressFamilies", "LockPersonality"):
        assert key in unit, f"hardening option {key} missing"
    assert "PrivateDevices" not in unit, "PrivateDevices hides the GPUs"
    env = dict(line.split("=", 1) for line in (DEPLOY / "systemd" / "radixkv.env").read_text().splitlines()
               if line.strip() and not line.startswith("#"))
    config = load_config([], environ=env)
    assert all(k[len("RADIXKV_"):].lower() in DaemonConfig.__dataclass_fields__ for k in env)
    assert config.listen == (f"unix://{SOCKET_DIR}/radixkv.sock",)
    assert config.invariant_check_interval > 0, "the critical invariant alert would have nothing to count"
    assert float(unit["TimeoutStopSec"][0]) > config.shutdown_grace + config.shutdown_store_timeout


def unit_command(key: str, **substitutions: str) -> str:
    """The unit's one `key=` command line, with this checkout's radixkv-health and the
    given `old=new` substitutions (a dict: keys are the literal text to replace)."""
    (line,) = unit_entries((DEPLOY / "systemd" / "radixkv.service").read_text())[key]
    line = line.replace("/opt/radixkv/bin/radixkv-health", str(BIN / "radixkv-health"))
    for old, new in substitutions.items():
        assert old in line, (old, line)
        line = line.replace(old, new)
    return line


def test_systemd_start_waits_for_readiness_within_its_bound(module_daemon, tmp_path):
    """ExecStartPost= (Type=exec): the unit counts as started, and engines ordered after
    it start, only once the daemon answers ready; with no daemon the wait ends, failed,
    at its bound (shortened from 60 s to 2 s here)."""
    post = unit_command("ExecStartPost", **{"timeout 60 ": "timeout 2 "})
    absent = {"RADIXKV_LISTEN": f"unix://{tmp_path}/none.sock", "PATH": "/usr/bin:/bin"}
    assert run_tool(["/bin/sh", "-c", post], env=absent, check=False).returncode != 0
    run_tool(["/bin/sh", "-c", post], env={"RADIXKV_LISTEN": module_daemon.target, "PATH": "/usr/bin:/bin"})


def test_systemd_reload_reloads_the_daemon_and_keeps_it_serving(daemon_factory):
    """ExecReload= sends SIGHUP: the daemon reloads (tokens, TLS) and serves on."""
    d = daemon_factory()
    run_tool(["/bin/sh", "-c", unit_command("ExecReload", **{"$MAINPID": str(d.pid)})])
    wait_for(lambda: "daemon.reload" in d.log(), 20, "daemon.reload in the log")
    run_tool([str(BIN / "radixkv-health"), "--quiet", "--address", d.target])
    assert d.alive


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    # verify checks that ExecStart exists: point it at this checkout's daemon.
    text = (DEPLOY / "systemd" / "radixkv.service").read_text()
    unit = tmp_path / "radixkv.service"
    unit.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={BIN / 'radixkv-server'}", text, flags=re.M))
    done = run_tool(["systemd-analyze", "verify", str(unit)])
    assert not (done.stdout + done.stderr).strip(), done.stdout + done.stderr
    security = run_tool(["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)])
    exposure = float(re.search(r"Overall exposure level for radixkv\.service: ([\d.]+)", security.stdout).group(1))
    assert exposure <= 3.0, security.stdout[-2000:]


# -- Dockerfile ----------------------------------------------------------------------

def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def dockerfile_uid() -> int:
    users = [args for op, args in dockerfile() if op == "USER"]
    return int(users[-1].split(":")[0])


def test_hadolint_passes_and_can_fail(tmp_path):
    hadolint = str(BIN / "hadolint")
    run_tool([hadolint, str(REPO / "Dockerfile")])
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN cd /tmp && apt-get install -y curl\n")
    assert run_tool([hadolint, str(bad)], check=False).returncode != 0


def test_dockerfile_structure():
    ins = dockerfile()
    froms = [args for op, args in ins if op == "FROM"]
    assert len(froms) == 2 and all(f.startswith("${BASE_IMAGE}") for f in froms), froms
    assert froms[0].endswith(" AS builder")
    (base,) = [args for op, args in ins[:ins.index(("FROM", froms[0]))] if op == "ARG"]
    assert re.fullmatch(r"BASE_IMAGE=python:3\.1[1-9][\w.-]*", base), base
    runtime = ins[ins.index(("FROM", froms[1])):]
    ops = [op for op, _ in runtime]
    assert any(op == "COPY" and args.startswith("--from=builder ") for op, args in runtime)
    assert dockerfile_uid() != 0, "the runtime runs as root"
    assert ops.index("USER") < ops.index("ENTRYPOINT")
    (volume,) = [args for op, args in runtime if op == "VOLUME"]
    assert SOCKET_DIR in volume
    (expose,) = [args for op, args in runtime if op == "EXPOSE"]
    assert int(expose.split("/")[0]) == DaemonConfig().metrics_port
    (health,) = [args for op, args in runtime if op == "HEALTHCHECK"]
    assert '"radixkv-health"' in health.partition("CMD")[2] and "radixkv-health" in SCRIPTS
    (entry,) = [args for op, args in runtime if op == "ENTRYPOINT"]
    assert entry == '["radixkv-server"]' and "radixkv-server" in SCRIPTS
    env_text = " ".join(args for op, args in runtime if op == "ENV")
    env = dict(re.findall(r"(RADIXKV_[A-Z_]+)=(\S+)", env_text))
    config = load_config([], environ=env)
    assert config.listen == (f"unix://{SOCKET_DIR}/radixkv.sock",)
    assert config.metrics_port == int(expose.split("/")[0]) and config.metrics_host == "::"
    # What the builder copies is what .dockerignore lets into the context.
    allowed = [line[1:] for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")]
    for op, args in ins:
        if op == "COPY" and not args.startswith("--from"):
            for src in args.split()[:-1]:
                assert any(src == a or (a.endswith("/") and src.startswith(a)) for a in allowed), \
                    f"{src} is excluded from the build context"


def test_build_context_makes_the_wheels_with_the_image_commands(tmp_path):
    """What the builder stage does with the context .dockerignore lets through: build the
    two packages (the daemon, radixkv-server, and its client, radixkv); the image's
    ENTRYPOINT and HEALTHCHECK commands must be in the daemon's."""
    ignore = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", "the context is an allow-list"
    context = tmp_path / "context"
    context.mkdir()
    for entry in ignore[1:]:
        if entry.startswith("!"):
            src = REPO / entry[1:].rstrip("/")
            (shutil.copytree if src.is_dir() else shutil.copy)(
                src, context / src.name, **({"ignore": shutil.ignore_patterns("__pycache__")} if src.is_dir() else {}))
    run_tool([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
              str(context), str(context / "client"), "-w", str(tmp_path / "wheel")], timeout=120)
    (server,) = (tmp_path / "wheel").glob("radixkv_server-*.whl")
    (client,) = (tmp_path / "wheel").glob("radixkv-*.whl")
    with zipfile.ZipFile(server) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert {"radixkv_server/healthcheck.py", "radixkv_server/server.py"} <= names
    assert not any(n.startswith("radixkv/") for n in names), "the client is a package of its own"
    assert "radixkv-server = radixkv_server.cli:main" in entry_points
    assert "radixkv-health = radixkv_server.healthcheck:main" in entry_points
    with zipfile.ZipFile(client) as z:
        assert {"radixkv/v1/radixkv_pb2.py", "radixkv/v1/radixkv_source.binpb", "radixkv/py.typed"} <= set(z.namelist())


def docker_runs(text: str) -> list[str]:
    """The `docker run` commands of a text (comment markers and continuations joined)."""
    text = re.sub(r"^#\s?", "", text, flags=re.M).replace("\\\n", " ")
    return [" ".join(line.split()) for line in text.splitlines() if line.lstrip().startswith("docker run")]


def test_docker_run_recipes_stop_late_enough_and_share_cuda_namespaces():
    """Every recipe (Dockerfile comment, docs/image.md): the daemon's container waits
    beyond the daemon's grace and storing before Docker's SIGKILL; an engine beside a
    daemon on a GPU joins its PID namespace too (legacy CUDA IPC handles)."""
    config = DaemonConfig()
    for path in (REPO / "Dockerfile", REPO / "docs" / "image.md"):
        runs = docker_runs(path.read_text())
        daemons = [r for r in runs if "--name radixkv" in r]
        engines = [r for r in runs if "--ipc=container:radixkv" in r]
        assert daemons and engines, path
        for run in daemons:
            stop = re.search(r"--stop-timeout (\d+)", run)
            assert stop and int(stop.group(1)) > config.shutdown_grace + config.shutdown_store_timeout, run
        for run in engines:
            assert "--gpus" not in run or "--pid=container:radixkv" in run, run
    assert any("--gpus" in r for r in docker_runs((REPO / "docs" / "image.md").read_text())), "a CUDA recipe"
    assert "--pid=container:radixkv" in (REPO / "Dockerfile").read_text()
