"""/metrics as operators consume it: linted by promtool, scraped by a real Prometheus
and queried with PromQL, and named correctly by the Grafana dashboard."""

import json
import re
import shutil
import socket
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import radixkv
from radixkv.client import Client
from radixkv.v1 import radixkv_pb2 as pb
from tests.support.daemon import free_port, wait_for

from opstools import REPO, run_tool
from rawengine import RawEngine

DASHBOARD = REPO / "deploy" / "grafana" / "radixkv-dashboard.json"
SCRAPE_TIMEOUT_S = 30.0


def exported_names(text: str) -> set[str]:
    """Every series name a scrape can hold: each family's name and its type's suffixes
    (counter _total, histogram _bucket/_sum/_count), whether or not it has samples yet."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("_sum", "_count"), "gauge": ("",), "info": ("_info",)}
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


def small_workload(daemon, namespace: str, cycles: int = 3, tokens: int = 32) -> int:
    """Insert, evict, load back and ack `cycles` times; plus one refused call (so an
    RPC code other than OK is exported). Returns the tokens loaded back."""
    engine = RawEngine(daemon.target, namespace)
    try:
        loaded = sum(engine.cycle(tokens) for _ in range(cycles))
        with pytest.raises(grpc.RpcError) as refused:
            engine.stub.Match(pb.MatchRequest(session="not-a-session"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        engine.close()
    finally:
        engine.release_memory()
    return loaded


def test_promtool_accepts_a_scrape_after_a_workload(daemon_factory, tmp_path):
    daemon = daemon_factory("--storage", str(tmp_path))  # every family, the storage ones too
    loaded = small_workload(daemon, "ops/promtool")
    assert loaded == 3 * 32
    text = daemon.scrape()
    for family in ("radixkv_load_back_tokens_total", "radixkv_copy_duration_seconds_bucket", "radixkv_storage_up",
                   'radixkv_rpc_requests_total{code="UNAUTHENTICATED",method="Match"}'):
        assert family in text
    done = run_tool(["promtool", "check", "metrics"], input=text, check=False)
    assert done.returncode == 0, f"promtool check metrics:\n{done.stdout}{done.stderr}"
    assert not (done.stdout + done.stderr).strip(), done.stdout + done.stderr
    # The same check rejects an exposition that breaks the conventions it enforces.
    bad = "# TYPE radixkv_bad counter\nradixkv_bad 1\n"
    assert run_tool(["promtool", "check", "metrics"], input=bad, check=False).returncode != 0


class Prometheus:
    """A real Prometheus server scraping one target every second, on temporary storage."""

    def __init__(self, target: str):
        self.dir = tempfile.mkdtemp(prefix="rkv-prom-")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = Path(self.dir, "prometheus.yml")
        config.write_text(
            "global:\n  scrape_interval: 2s\n  scrape_timeout: 2s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: radixkv\n    static_configs:\n"
            f"      - targets: ['{target}']\n")
        self.log = open(Path(self.dir, "prometheus.log"), "wb")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={self.dir}/data",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=self.dir)
        wait_for(self._ready, SCRAPE_TIMEOUT_S, "prometheus /-/ready")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited {self.proc.returncode}:\n{Path(self.dir, 'prometheus.log').read_text()}",
                        pytrace=False)
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    def query(self, promql: str) -> dict:
        """The instant query's JSON answer (status success or error)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:  # 400/422: a bad query; the body says why
            return json.load(e)

    def value(self, promql: str) -> float | None:
        """The single sample's value, or None while the query returns no sample."""
        answer = self.query(promql)
        assert answer["status"] == "success", answer
        result = answer["data"]["result"]
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def prometheus_for():
    """start(daemon) -> a Prometheus scraping that daemon; stopped at teardown."""
    started = []

    def start(daemon) -> Prometheus:
        p = Prometheus(f"127.0.0.1:{daemon.metrics_port}")
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash["templating"]["list"]:
        if var.get("type") == "query":
            q = var["query"]
            exprs.append(q["query"] if isinstance(q, dict) else q)
    return exprs


def as_promql(expr: str) -> str:
    """A dashboard expression as Grafana would send it: variables replaced."""
    expr = expr.replace("$__rate_interval", "4s").replace("$__range", "1m")
    expr = re.sub(r"\$\{?(instance|namespace)\}?", ".*", expr)
    m = re.fullmatch(r"label_values\((.*), *(\w+)\)", expr)  # a Grafana function, not PromQL
    if m:
        expr = f"count by ({m.group(2)}) ({m.group(1)})"
    return expr


def test_prometheus_scrapes_the_load_back_tokens_the_workload_moved(daemon, prometheus_for):
    prom = prometheus_for(daemon)  # its first scrape comes ~5 s after start (discovery's pace)
    engine = RawEngine(daemon.target, "ops/prom")
    try:
        loaded = [engine.cycle(n) for n in (16, 32, 48)]
        engine.close()
    finally:
        engine.release_memory()
    assert loaded == [16, 32, 48]
    query = 'radixkv_load_back_tokens_total{namespace="ops/prom"}'
    wait_for(lambda: prom.value(query) == 96.0, SCRAPE_TIMEOUT_S, f"{query} == 96 in Prometheus")
    # Of one scrape that succeeded (one slow scrape on a busy machine marks every series
    # stale until the next): each series' last value over the past minute.
    assert prom.value('max_over_time(up{job="radixkv"}[1m])') == 1.0
    assert prom.value('last_over_time(radixkv_hit_tokens_total{namespace="ops/prom",tier="host"}[1m])') == 96.0
    assert prom.value('last_over_time(radixkv_rpc_requests_total{method="LoadBack",code="OK"}[1m])') == 3.0
    # How far a rolling upgrade got: the daemon's version and its storage record format.
    assert prom.value(f'count by (version) (radixkv_build_info{{version="{radixkv.__version__}",'
                      'record_format="2"})') == 1.0
    # Every dashboard expression is valid PromQL against this server.
    for expr in dashboard_exprs():
        answer = prom.query(as_promql(expr))
        assert answer["status"] == "success", f"{expr}\n-> {answer}"


def test_dashboard_uses_only_exported_metric_names(daemon_factory, tmp_path):
    daemon = daemon_factory("--storage", str(tmp_path))  # so the storage families exist too
    small_workload(daemon, "ops/dash", cycles=1)
    exported = exported_names(daemon.scrape())
    used = {name for expr in dashboard_exprs() for name in re.findall(r"\bradixkv_[A-Za-z0-9_:]+", expr)}
    assert used, "the dashboard queries no radixkv metric"
    assert not used - exported, f"dashboard names metrics the daemon does not export: {sorted(used - exported)}"
    # The panels the operators' runbook refers to are there.
    titles = {p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]}
    for title in ("Hit rate by tier", "Load-back throughput", "Copy latency p50 / p99", "Evictions by reason",
                  "Host pool usage", "Transfers in flight", "RPC latency by method", "Invariant violations",
                  "Expired leases and load-backs", "Storage tier (L3)", "Oldest lease and unacknowledged load-back"):
        assert title in titles


def test_copy_latency_panel_leaves_out_the_storage_tiers_copies():
    """`radixkv_copy_duration_seconds` also times storage stores and fetches, which wait
    for the store: mixed into the page-copy quantiles they would hide a slow PCIe copy."""
    (panel,) = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"] == "Copy latency p50 / p99"]
    for target in panel["targets"]:
        assert 'direction=~"load|backup|write_back"' in target["expr"], target["expr"]


def test_dashboard_panels_are_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24, p["title"]


def test_a_dropped_namespace_leaves_no_series_behind(daemon_factory):
    """After DropNamespace no series is labelled with that namespace (copy histograms
    included), while another namespace's series stay."""
    d = daemon_factory()
    for ns in ("ops/dropped", "ops/kept"):
        small_workload(d, ns)  # load-backs: copy durations observed for each namespace

    def namespaces(text: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if "namespace" in s.labels:
                    out.setdefault(s.labels["namespace"], set()).add(s.name)
        return out

    before = namespaces(d.scrape())
    assert "radixkv_copy_duration_seconds_count" in before["ops/dropped"]
    with Client(d.target, timeout=SCRAPE_TIMEOUT_S) as admin:
        admin.drop_namespace("ops/dropped")
    after = namespaces(d.scrape())
    assert "ops/dropped" not in after
    assert after["ops/kept"] == before["ops/kept"]


def test_the_shipped_alert_rules_load_pass_their_tests_and_name_exported_metrics(daemon_factory, tmp_path):
    """deploy/prometheus: the rules operations.md's conditions call for, which Prometheus
    loads (`promtool check rules`), which fire on trouble and stay quiet on a healthy
    daemon (`promtool test rules`), over series the daemon exports."""
    rules = REPO / "deploy" / "prometheus" / "radixkv-alerts.yml"
    for command in (["promtool", "check", "rules", str(rules)],
                    ["promtool", "test", "rules", str(rules.with_name("radixkv-alerts-test.yml"))]):
        done = run_tool(command, check=False)
        assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout}{done.stderr}"
    # Every rule has a case where it fires and one where it stays silent.
    alerts = {r["alert"] for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"]}
    cases = [c for t in yaml.safe_load(rules.with_name("radixkv-alerts-test.yml").read_text())["tests"]
             for c in t["alert_rule_test"]]
    assert len(alerts) == 12
    assert {c["alertname"] for c in cases if c["exp_alerts"]} == alerts, "an alert never seen firing"
    assert {c["alertname"] for c in cases if not c["exp_alerts"]} == alerts, "an alert never seen silent"
    daemon = daemon_factory("--storage", str(tmp_path), "--kv-events-watch", "true")
    small_workload(daemon, "ops/alerts", cycles=1)
    exported = exported_names(daemon.scrape())
    used = set(re.findall(r"\bradixkv_[A-Za-z0-9_:]+", rules.read_text()))
    token_file = tmp_path / "tokens"  # the reload series is exported where there is something to reload
    token_file.write_text("a-token\n")
    exported |= exported_names(daemon_factory("--auth-token-file", str(token_file)).scrape())
    assert not used - exported, f"alert rules name metrics the daemon does not export: {sorted(used - exported)}"


def test_metrics_on_every_address_answer_over_ipv4_and_ipv6(daemon_factory):
    """`--metrics-host ::` (the image's and the Kubernetes example's): one listener that
    Prometheus reaches over IPv4 and IPv6 alike (0.0.0.0 left an IPv6-only pod IP
    unscraped). Skipped where this machine has no IPv6 loopback (IPv6 disabled, as in
    Docker's default networks): the daemon then serves IPv4 alone."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as e:
        pytest.skip(f"no IPv6 loopback on this machine ({e})")
    d = daemon_factory("--metrics-host", "::")
    over_v4 = d.scrape()
    with urllib.request.urlopen(f"http://[::1]:{d.metrics_port}/metrics", timeout=SCRAPE_TIMEOUT_S) as r:
        over_v6 = r.read().decode()
    for text in (over_v4, over_v6):
        assert "radixkv_namespaces" in exported_names(text), text[:300]
    assert f"address=http://[::]:{d.metrics_port}/metrics" in d.log()
