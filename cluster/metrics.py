"""Prometheus metrics for GET /metrics, rendered as the text exposition format.

Kept in-process per scheduler replica: each replica's /metrics is its own
counts. Names are prefixed `tandem_`. Counters and histograms also go to an
`export` (cluster/metrics_export.py: through Ray, where every replica's are
scraped, which the Serve proxy's one replica a scrape cannot give).
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

# (to 600 s: a request may run `limits.request_timeout_s`, 300 s by default, and an e2e p99 past the last
# bucket read as that bucket's bound, 60 s, whatever it was)
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def _escaped(text: str) -> str:
    """A label value or HELP text as the exposition format writes it: backslash and newline escaped."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escaped(str(v)).replace(chr(34), chr(92) + chr(34))}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


class Metrics:
    def __init__(self, export=None) -> None:
        self.export = export  # counters and histograms also go there (cluster/metrics_export.py RayExport)
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self._gauges: dict[str, dict[tuple, float]] = defaultdict(dict)
        self._histograms: dict[str, dict[tuple, list]] = defaultdict(dict)
        self._help: dict[str, tuple[str, str]] = {}

    def _key(self, labels: dict[str, str]) -> tuple:
        return tuple(sorted(labels.items()))

    def inc(self, name: str, help_text: str, value: float = 1.0, **labels) -> None:
        with self._lock:
            self._help[name] = ("counter", help_text)
            self._counters[name][self._key(labels)] += value
        if self.export is not None:
            self.export.inc(name, help_text, value, labels)

    def set(self, name: str, help_text: str, value: float, **labels) -> None:
        with self._lock:
            self._help[name] = ("gauge", help_text)
            self._gauges[name][self._key(labels)] = value

    def set_total(self, name: str, help_text: str, value: float, **labels) -> None:
        """A counter that another process counts (a worker's, since it started),
        set to its latest reading: typed a counter, so that `rate` and `increase`
        read it as one, where a gauge's `delta` took a restart's drop for a
        fall. Not exported through Ray (every replica reads the same figure)."""
        with self._lock:
            self._help[name] = ("counter", help_text)
            self._counters[name][self._key(labels)] = value

    def forget(self, **labels) -> None:
        """Drop every gauge series, and every counter `set_total` keeps, carrying
        these labels (a worker that is gone: its last values would otherwise be
        reported beside its replacement's forever)."""
        wanted = set(labels.items())
        with self._lock:
            for series in [*self._gauges.values(), *self._counters.values()]:
                for key in [key for key in series if wanted <= set(key)]:
                    del series[key]

    def observe(self, name: str, help_text: str, value: float, count: int = 1, **labels) -> None:
        """`count` observations of `value` (an event of several tokens: as many gaps)."""
        with self._lock:
            self._help[name] = ("histogram", help_text)
            series = self._histograms[name].setdefault(self._key(labels), [[0] * len(LATENCY_BUCKETS_S), 0.0, 0])
            index = bisect.bisect_left(LATENCY_BUCKETS_S, value)
            if index < len(LATENCY_BUCKETS_S):
                series[0][index] += count
            series[1] += value * count
            series[2] += count
        if self.export is not None:
            for _ in range(count):
                self.export.observe(name, help_text, value, labels)

    def value(self, name: str, **labels) -> float:
        """A counter's or gauge's current value (0 when never set)."""
        key = self._key(labels)
        with self._lock:
            if name in self._counters:
                return self._counters[name].get(key, 0.0)
            return self._gauges.get(name, {}).get(key, 0.0)

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            for name, (kind, help_text) in sorted(self._help.items()):
                full = f"tandem_{name}"
                lines.append(f"# HELP {full} {_escaped(help_text)}")
                lines.append(f"# TYPE {full} {kind}")
                if kind == "counter":
                    for key, value in self._counters[name].items():
                        lines.append(f"{full}{_labels(dict(key))} {value}")
                elif kind == "gauge":
                    for key, value in self._gauges[name].items():
                        lines.append(f"{full}{_labels(dict(key))} {value}")
                else:
                    for key, (buckets, total, count) in self._histograms[name].items():
                        labels = dict(key)
                        cumulative = 0
                        for bound, n in zip(LATENCY_BUCKETS_S, buckets):
                            cumulative += n
                            lines.append(f"{full}_bucket{_labels({**labels, 'le': str(bound)})} {cumulative}")
                        lines.append(f"{full}_bucket{_labels({**labels, 'le': '+Inf'})} {count}")
                        lines.append(f"{full}_sum{_labels(labels)} {total}")
                        lines.append(f"{full}_count{_labels(labels)} {count}")
        return "\n".join(lines) + "\n"
