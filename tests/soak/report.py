"""The soak's human-readable report: one line per figure, the verdict's problems, and
the byte-mismatch count last (the line CI and `make soak` readers look for); and the
verdict on the daemon's resident memory over the run."""

import statistics


def rss_verdict(samples: list[dict], name: str, warmup: float, seconds: float) -> dict:
    """Whether daemon `name`'s RSS stayed flat after `warmup` seconds: the median of the
    last fifth of `samples` within max(16 MiB, 10%) of the first fifth's. Judged
    (`checked`) for runs of 2 minutes or more only."""
    points = [(s["t"], s[f"{name}_rss_mib"]) for s in samples if s.get(f"{name}_rss_mib")]
    after = [r for t, r in points if t >= warmup]
    if len(after) < 6:
        return {"daemon": name, "checked": False, "reason": "too few samples after warm-up"}
    k = max(3, len(after) // 5)
    early, late = statistics.median(after[:k]), statistics.median(after[-k:])
    limit = max(16.0, early * 0.10)
    return {"daemon": name, "checked": seconds >= 120, "after_warmup_mib": early,
            "end_mib": late, "growth_mib": round(late - early, 1), "limit_mib": round(limit, 1),
            "peak_mib": max(r for _, r in points), "flat": late - early < limit}


def summary(out: dict) -> list[str]:
    t = out["totals"]
    lines = [
        f"soak: {out['seconds']}s, seed {out['config']['seed']}, "
        f"{len(out['daemon_starts'])} daemons, {out['config']['engines_per_daemon']} engines each",
        f"operations: {t.get('steps', 0)} steps, {t.get('requests', 0)} requests, "
        f"{t.get('load_backs', 0)} load-backs ({t.get('failed_loads', 0)} reported failed)",
        f"faults: {out['faults']} (daemon starts {out['daemon_starts']}); engines saw "
        f"{t.get('session_losses', 0)} lost sessions ({t.get('daemon_restarts', 0)} daemon restarts), "
        f"{t.get('unavailable', 0)} unavailable calls, {t.get('stalls', 0)} stuck-engine missteps, "
        f"{t.get('errors', 0)} unexplained client errors (listed as problems)",
        f"verified: {t.get('prefix_pages_verified', 0)} pages, {t.get('bytes_verified', 0)} bytes "
        f"({t.get('device_hit_pages', 0)} device-hit pages, {t.get('host_loaded_pages', 0)} loaded from host; "
        f"{t.get('prefetches', 0)} prefetches from storage brought {t.get('staged_pages', 0)} pages)",
        f"daemon counters at the end (since each one's last start): {out['daemon_counters']}",
        f"invariant violations: {out['num_violations']}",
        f"rss: {out['rss']}",
    ]
    lines += [f"check failed: {k}" for k, v in out.get("checks", {}).items() if not v]
    lines += [f"problem: {p}" for p in out["problems"]]
    lines.append(f"{t.get('byte_mismatches', 0)} byte mismatches")
    return lines
