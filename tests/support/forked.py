"""Test daemons forked from a process that imported torch already (multiprocessing's
forkserver), instead of a fresh interpreter each: the suite starts some 300 daemons,
and importing torch is most of a start (a daemon is ready in ~0.5 s instead of ~2 s).

The child runs `python -m radixkv_server` as the interpreter would (runpy, with the
same arguments, environment, working directory and log files); only the imports
preloaded here are shared; the exit runs the atexit handlers but not the interpreter's
teardown. Tests whose subject is the process itself (tests/ops: start, signals, exit
codes, shutdown; a cgroup joined before exec) use a real interpreter:
`DaemonProcess(fork=False)`, or any `launcher`. RADIXKV_TEST_FORK=0 turns forking off
for a whole run.

`ForkedProcess` is the part of subprocess.Popen that DaemonProcess uses. Its exit code
reads as Popen's does: the code the daemon exited with, or -N for signal N."""

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys

# What the forkserver imports once: torch and what does not bring gRPC in (the daemon
# picks gRPC's I/O before importing it, grpc_io.py).
PRELOAD = ["torch", "numpy", "uvloop", "prometheus_client"]
# Off with RADIXKV_TEST_FORK=0, and where the main program is a script rather than a
# module's __main__ (`python -m pytest`, `python -m tests.soak`): multiprocessing would
# run a script again in every child.
ENABLED = (os.environ.get("RADIXKV_TEST_FORK", "1") != "0"
           and getattr(sys.modules["__main__"], "__file__", "").endswith("__main__.py"))


def usable(env: dict | None) -> bool:
    """Whether a daemon with environment `env` (None: this process's) can be forked: the
    module search path is the forkserver's, fixed when it started."""
    return ENABLED and (env is None or env.get("PYTHONPATH") == os.environ.get("PYTHONPATH"))


_context = None


def _forkserver():
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _context = context
    return _context


def _run_daemon(args: list[str], cwd: str, env: dict, out_path: str, err_path: str) -> None:
    """In the forked child: become `python -m radixkv_server ARGS` (its SystemExit is the
    process's exit code)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    err = os.open(err_path, flags, 0o644)
    out = os.open(out_path, flags, 0o644) if out_path != err_path else err
    os.dup2(out, 1)
    os.dup2(err, 2)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)  # as a fresh interpreter starts
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = ["radixkv_server", *args]  # run_module puts the module's path first, as `-m` does
    try:
        runpy.run_module("radixkv_server", run_name="__main__", alter_sys=True)
    finally:  # multiprocessing ends the child with os._exit: run what an interpreter's exit would
        atexit._run_exitfuncs()


class ForkedProcess:
    """`python -m radixkv_server ARGS`, forked; see the module's text."""

    def __init__(self, args: list[str], cwd: str, env: dict | None, out_path: str, err_path: str):
        self.args = ["radixkv_server", *args]
        env = dict(os.environ) if env is None else dict(env)
        self._process = _forkserver().Process(target=_run_daemon, args=(list(args), cwd, env, out_path, err_path),
                                              daemon=True, name="radixkv-test-daemon")
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
