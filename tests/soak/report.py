"""The soak's human-readable report: one line per figure, the verdict's problems, and
the byte-mismatch count last (the line CI and `make soak` readers look for)."""


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
