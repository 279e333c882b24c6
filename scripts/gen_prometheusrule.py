"""Write deploy/kubernetes/prometheusrule.yaml: the alert rules of
deploy/prometheus/radixkv-alerts.yml as a Prometheus Operator PrometheusRule (committed).

The rule file stays the one to edit (promtool checks and unit-tests it);
tests/ops/test_ops_deploy.py fails when the two disagree: run this again.
"""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "radixkv-alerts.yml"
OUT = ROOT / "deploy" / "kubernetes" / "prometheusrule.yaml"

HEADER = """\
# Prometheus Operator: radixkv's alerts (generated from deploy/prometheus/radixkv-alerts.yml
# by `python scripts/gen_prometheusrule.py`; edit that file, not this one).
# Many Prometheus installs select rules by a release label: set it to yours.
"""


def rule() -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "radixkv", "labels": {"app.kubernetes.io/name": "radixkv", "release": "prometheus"}},
        "spec": {"groups": yaml.safe_load(RULES.read_text())["groups"]},
    }


if __name__ == "__main__":
    OUT.write_text(HEADER + yaml.safe_dump(rule(), sort_keys=False, width=100, allow_unicode=True))
    print(f"wrote {OUT.relative_to(ROOT)}")
