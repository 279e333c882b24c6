"""Reading /metrics as an operator's tools do: one scrape of a real daemon parsed with
prometheus-client's parser, samples keyed by name and labels (the namespace label taken
off), and bounded waits for a value. Expected values are the tests' own, never read
back from the daemon."""

from prometheus_client.parser import text_string_to_metric_families
from tests.support.daemon import wait_for

DEADLINE_S = 20.0


def series(text: str, namespace: str) -> dict:
    """{(name, ((label, value), ...)): value} for the samples of `namespace` (and the
    daemon-wide samples, which have no namespace label)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("namespace", namespace) == namespace:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "namespace"))
                out[(s.name, labels)] = s.value
    return out


def value(daemon, namespace: str, name: str, **labels) -> float:
    """One sample of a fresh scrape (0 when the series is absent)."""
    return series(daemon.scrape(), namespace).get((name, tuple(sorted(labels.items()))), 0.0)


def counter(name: str) -> tuple:
    """The key of an unlabelled sample (besides its namespace)."""
    return (name, ())


def wait_value(daemon, namespace: str, name: str, want: float, **labels) -> None:
    wait_for(lambda: value(daemon, namespace, name, **labels) == want, DEADLINE_S,
             f"{name}{labels or ''} == {want}")
