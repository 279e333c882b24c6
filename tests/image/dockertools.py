"""Helpers of the image tests: the docker CLI, one container of the image started as the
Dockerfile documents, and a host process joined to that container's IPC namespace,
/dev/shm and socket volume the way an engine container started with
`--ipc=container:radixkv -v radixkv-run:/run/radixkv --user 10001` is."""

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.support.daemon import wait_for

REPO = Path(__file__).resolve().parents[2]
SOCKET_DIR = "/run/radixkv"
METRICS_PORT = 9464
HEALTHY_TIMEOUT_S = 90.0   # the HEALTHCHECK's first probe runs after its 10 s interval
STOP_GRACE_S = 20          # `docker stop --time`: SIGKILL after this; the daemon needs < 10


def docker(*args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
    """Run the docker CLI; with `check`, fail the test (with its output) unless it exits 0."""
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        pytest.fail(f"docker {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}",
                    pytrace=False)
    return done


def inspect(ref: str) -> dict:
    """`docker inspect` of a container or image, as a dict."""
    return json.loads(docker("inspect", ref).stdout)[0]


def poll(condition, timeout: float, what: str, interval: float = 0.5):
    """`wait_for` at docker's pace: containers change state in seconds, not milliseconds."""
    return wait_for(condition, timeout, what, interval)


class DaemonContainer:
    """The image run as the Dockerfile's header documents: a named socket volume, a
    shareable IPC namespace, /metrics published on a free loopback port."""

    def __init__(self, image: str, *daemon_flags: str):
        self.image = image
        self.name = f"radixkv-test-{uuid.uuid4().hex[:8]}"
        self.volume = f"{self.name}-run"
        self.flags = daemon_flags or ("--host-pool-size", "256MiB")
        self.host_mountpoint = f"/tmp/{self.name}"  # the socket volume, seen by a host engine

    def start(self) -> "DaemonContainer":
        docker("volume", "create", self.volume)
        docker("run", "-d", "--name", self.name, "--ipc=shareable", "--shm-size=1g",
               "-v", f"{self.volume}:{SOCKET_DIR}", "-p", f"127.0.0.1::{METRICS_PORT}",
               self.image, *self.flags)
        return self

    def state(self) -> dict:
        return inspect(self.name)["State"]

    def health(self) -> str:
        return self.state().get("Health", {}).get("Status", "none")

    def wait_healthy(self, timeout: float = HEALTHY_TIMEOUT_S) -> None:
        def healthy():
            state = self.state()
            if not state["Running"]:
                pytest.fail(f"container exited {state['ExitCode']}:\n{self.logs()}", pytrace=False)
            return state["Health"]["Status"] == "healthy"
        poll(healthy, timeout, f"{self.name} to turn healthy")

    @property
    def pid(self) -> int:
        return self.state()["Pid"]

    def metrics_url(self) -> str:
        host_port = docker("port", self.name, f"{METRICS_PORT}/tcp").stdout.split()[0]
        return f"http://{host_port}/metrics"

    def logs(self) -> str:
        done = docker("logs", "--tail", "60", self.name, check=False)
        return (done.stdout + done.stderr)[-6000:]

    def remove(self) -> None:
        docker("rm", "-f", "-v", self.name, check=False)
        docker("volume", "rm", "-f", self.volume, check=False)
        if os.path.isdir(self.host_mountpoint):
            os.rmdir(self.host_mountpoint)


def as_engine_of(container: DaemonContainer, uid: int, argv: list[str]) -> list[str]:
    """A command line that runs `argv` on the host the way an engine container shares
    the daemon's: in the container's IPC namespace, with the container's /dev/shm (where
    the shm backend's segments live) on /dev/shm, its socket volume on
    `container.host_mountpoint` (write `{socket_dir}` in argv for it), as `uid` (the
    daemon maps the segments the engine creates, mode 0600). The mounts are made in a
    private mount namespace, so the host's stay as they are; CAP_DAC_READ_SEARCH lets
    `uid` read this checkout's virtualenv wherever it lies. Needs root."""
    pid = container.pid
    # --ipc=shareable: docker keeps the container's /dev/shm tmpfs here, and bind-mounts
    # it into each --ipc=container: peer (paths under /proc/<pid>/root do not bind).
    root_dir = docker("info", "-f", "{{.DockerRootDir}}").stdout.strip()
    shm = f"{root_dir}/containers/{inspect(container.name)['Id']}/mounts/shm"
    if not os.path.isdir(shm):
        pytest.fail(f"no shareable /dev/shm of {container.name} at {shm}", pytrace=False)
    volume = docker("volume", "inspect", "-f", "{{.Mountpoint}}", container.volume).stdout.strip()
    os.makedirs(container.host_mountpoint, exist_ok=True)
    join = 'mount --bind "$1" /dev/shm && mount --bind "$2" "$3" && shift 3 && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", join, "sh",
            shm, volume, container.host_mountpoint,
            "nsenter", f"--ipc=/proc/{pid}/ns/ipc",
            "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
            "env", "PYTHONDONTWRITEBYTECODE=1",
            *[a.replace("{socket_dir}", container.host_mountpoint) for a in argv]]
