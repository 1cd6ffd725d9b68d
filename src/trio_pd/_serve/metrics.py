"""The connectors' statistics as Prometheus metrics (read at each scrape)."""

from __future__ import annotations

from collections.abc import Callable

import attrs
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .._connector import Connector


class ConnectorCollector:
    """The connectors' statistics as Prometheus metrics (summed over the ranks),
    read at each scrape."""

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
        stats = [
            {
                name: value
                for name, value in attrs.asdict(c.statistics(), recurse=False).items()
                if not isinstance(value, str)  # (backend_stuck_call: /health says it)
            }
            for c in connectors
        ]
        out: list[Metric] = []
        causes = CounterMetricFamily(
            "trio_pd_handshake_failures_by_cause",
            "Failed handshakes by cause.",
            labels=["cause"],
        )
        by_cause: dict[str, int] = {}
        for rank in stats:
            for cause, count in rank.pop("handshake_failures_by_cause").items():
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
