"""Prometheus metrics: the connectors' statistics (read at each scrape) and the proxy's own."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from trio_pd._connector import Connector
from trio_pd._core._public_values import ConnectorStatistics

BY_CAUSE = "handshake_failures_by_cause"


class ConnectorCollector:
    """The connectors' statistics as Prometheus metrics (summed over the ranks),
    read at each scrape: every numeric field of :class:`ConnectorStatistics`
    as ``trio_pd_<field>`` (a counter, or a gauge for those in ``GAUGES``),
    and the failed handshakes by cause."""

    GAUGES = frozenset(
        {
            "engines_ready",
            "pulls_in_flight",
            "remote_agents_loaded",
            "exposures_pending",
            "transfers_unsettled",
            "blocks_unsettled",
            "holds_active",
        }
    )

    def __init__(self, connectors: Callable[[], list[Connector]]) -> None:
        self._connectors = connectors

    def collect(self) -> list[Metric]:
        connectors = self._connectors()
        if not connectors:
            return []
        return self.families([c.statistics() for c in connectors])

    def describe(self) -> list[Metric]:
        """Every metric this collector exports (what the docs list), with no values."""
        zero: dict[str, Any] = {
            field.name: {} if field.name == BY_CAUSE else 0
            for field in attrs.fields(ConnectorStatistics)
            if field.default is attrs.NOTHING
        }
        return self.families([ConnectorStatistics(**zero)])

    def families(self, statistics: Sequence[ConnectorStatistics]) -> list[Metric]:
        """The metrics of these ranks' statistics, summed."""
        stats = [
            {
                name: value
                for name, value in attrs.asdict(s, recurse=False).items()
                if not isinstance(value, str)  # (backend_stuck_call: /health says it)
            }
            for s in statistics
        ]
        out: list[Metric] = []
        causes = CounterMetricFamily(
            f"trio_pd_{BY_CAUSE}",
            "Failed handshakes by cause.",
            labels=["cause"],
        )
        by_cause: dict[str, int] = {}
        for rank in stats:
            for cause, count in rank.pop(BY_CAUSE).items():
                by_cause[cause] = by_cause.get(cause, 0) + count
        for cause, count in by_cause.items():
            causes.add_metric([cause], count)
        out.append(causes)
        for name in stats[0]:
            value = sum(rank[name] for rank in stats)
            doc = f"trio_pd ConnectorStatistics.{name}, summed over the ranks"
            if name in self.GAUGES:
                out.append(GaugeMetricFamily(f"trio_pd_{name}", doc, value=value))
            else:
                out.append(CounterMetricFamily(f"trio_pd_{name}", doc, value=value))
        return out


class ProxyMetrics:
    """The proxy's Prometheus metrics (its own registry)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "trio_pd_proxy_requests",
            "Completion and chat requests by outcome: ok, client_error (4xx), overloaded (503), "
            "timeout (504), engine_error (other 5xx, and a stream that failed after its 200), "
            "disconnected (the client left), stalled (the client stopped reading: reset after "
            "--send-timeout), server_error (a bug in the proxy: a JSON 500, logged).",
            ["outcome"],
            registry=r,
        )
        self.in_flight = Gauge(
            "trio_pd_proxy_requests_in_flight", "Requests in flight.", registry=r
        )
        buckets = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, math.inf)
        self.first_byte = Histogram(
            "trio_pd_proxy_time_to_first_byte_seconds",
            "From the request to the decode answer's first byte (first token when streaming).",
            registry=r,
            buckets=buckets,
        )
        self.seconds = Histogram(
            "trio_pd_proxy_request_seconds",
            "From the request to the end of its answer.",
            registry=r,
            buckets=buckets,
        )
        self.engine_errors = Counter(
            "trio_pd_proxy_engine_errors",
            "Failed requests to engines, by role, engine and kind: refused (passed over, "
            "retried elsewhere), timeout, transport, status (a 5xx), malformed (a 200 the proxy "
            "cannot use), deployment (a decode engine refused what its prefill engine issued: "
            "the engines disagree), exposure_ended (a decode engine found the prefill's "
            "exposure over, after one more prefill).",
            ["role", "engine", "kind"],
            registry=r,
        )
        self.reprefills = Counter(
            "trio_pd_proxy_reprefills",
            "Requests prefilled a second time, by reason: exposure_ended (a decode engine "
            "found the first prefill's exposure over), lease (too little of its lease was "
            "left to start a decode on the next engine).",
            ["reason"],
            registry=r,
        )
