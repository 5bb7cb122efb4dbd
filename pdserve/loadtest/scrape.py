"""`pdserve bench --metrics-url`: the services' Prometheus /metrics, read before and after each
rate, and what their counters moved by in between, by role.

A service's role is the `service` label of its pdserve_* metrics (one process serves one role,
pdserve/metrics.py). The counters read are the process's CPU seconds (prometheus_client's
process_cpu_seconds_total, on Linux), the prefix-cache lookup and hit tokens, and the tokens
processed (prompt tokens computed on prefill; generated tokens where the service counts them).
They count every client's requests, not only the bench's.
"""

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

TIMEOUT_SECONDS = 5.0
MAX_BYTES = 16 << 20
# (sample name, label that must match or None) -> the name in the deltas
WATCHED = {
    ("process_cpu_seconds_total", None): "cpu_seconds",
    ("pdserve_prefix_cache_lookup_tokens_total", None): "prefix_lookup_tokens",
    ("pdserve_prefix_cache_hit_tokens_total", None): "prefix_hit_tokens",
    ("pdserve_prefix_cache_saved_handoff_bytes_total", None): "prefix_saved_handoff_bytes",
    ("pdserve_tokens_total", ("kind", "prompt")): "prompt_tokens",
    ("pdserve_tokens_total", ("kind", "generated")): "generated_tokens",
}


def parse(text: str) -> dict:
    """{"role": the service label(s) seen, joined by '+'; "values": {name: value}}."""
    services: set[str] = set()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("pdserve_") and "service" in sample.labels:
                services.add(sample.labels["service"])
            for (name, label), key in WATCHED.items():
                if sample.name != name:
                    continue
                if label is not None and sample.labels.get(label[0]) != label[1]:
                    continue
                values[key] = values.get(key, 0.0) + sample.value
    return {"role": "+".join(sorted(services)) or "unknown", "values": values}


def read(url: str, timeout: float = TIMEOUT_SECONDS) -> dict:
    """One scrape: {"url", "role", "values"}, or {"url", "error"}; never raises."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - the user's URL
            text = response.read(MAX_BYTES).decode("utf-8", errors="replace")
        return {"url": url, **parse(text)}
    except Exception as exc:  # noqa: BLE001 - a missing endpoint only costs its figures
        return {"url": url, "error": f"{type(exc).__name__}: {exc}"[:300]}


async def snapshot(urls: tuple[str, ...] | list[str]) -> list[dict]:
    """Every URL read at once, off the event loop."""
    return list(await asyncio.gather(*(asyncio.to_thread(read, u) for u in urls)))


def deltas(before: list[dict], after: list[dict]) -> dict:
    """What each counter moved by between two snapshots of the same URLs, summed by role:
    {"roles": {role: {name: delta}}, "errors": [...]}. A counter missing before counts from 0
    (prometheus_client shows a labelled counter only once it has counted); one that went down
    (the service restarted) is left out."""
    out: dict = {"roles": {}, "errors": []}
    for b, a in zip(before, after):
        if "error" in b or "error" in a:
            out["errors"].append(f"{a['url']}: {a.get('error') or b.get('error')}")
            continue
        role = a["role"]
        moved = out["roles"].setdefault(role, {})
        for key, value in a["values"].items():
            old = b["values"].get(key, 0.0)
            if value >= old:
                moved[key] = moved.get(key, 0.0) + value - old
        moved["instances"] = moved.get("instances", 0) + 1
    return out
