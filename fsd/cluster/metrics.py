"""Prometheus exporter of the cluster counters (``--metrics-port``; off unless configured).

The figures are read from the same status dict as ``.fsd/status`` at scrape time (a
custom collector: nothing is double-counted or kept twice). The exporter binds the
address it is given, like the peer listener: never all interfaces unless written so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from .compat import FsdError
from .config import split_address
from .stats import LATENCY_BUCKETS

log = logging.getLogger(__name__)

_PEER_COUNTERS = {
    "fetched_bytes": "Bytes fetched from the peer",
    "fetched_samples": "Samples fetched from the peer",
    "missing": "Ids the peer answered missing for",
    "fallbacks": "Ids read from the PFS instead of the peer",
    "errors": "Failed batch calls to the peer",
    "timeouts": "Batch calls to the peer past their deadline",
    "hedged": "Samples read from the PFS after the hedge bound instead of waiting for the slow peer",
    "refusals": "Batch calls the peer refused (secret or plan)",
    "skipped_batches": "Batches not tried: the peer's breaker was open",
    "bad_samples": "Samples from the peer that failed their checksum or size (read from the PFS instead)",
    "served_bytes": "Bytes served to the peer",
    "served_samples": "Samples served to the peer",
    "served_missing": "Ids the peer asked for that this node did not have",
    "served_refused": "Calls of the peer this node refused",
}
_SERVER_COUNTERS = {
    "unauthenticated": "Peer requests refused: unsigned, another secret, out of the time window or replayed",
    "replays": "Peer requests refused as replays (a nonce seen already)",
    "plan_refusals": "Peer requests refused because the plan fingerprint differs",
    "bad_requests": "Peer requests refused for ids outside the dataset or too large a batch",
    "serve_errors": "serve() calls that failed (answered missing)",
}


class ClusterCollector(Collector):
    """Turns ``ClusterNode.status()`` into metric families at each scrape."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status

    def collect(self) -> Iterator[Any]:
        s = self.status()
        peers = s.get("peers", [])
        labels = ["peer", "address"]
        up = GaugeMetricFamily("fsd_cluster_peer_up", "1 when the last call to the peer succeeded", labels=labels)
        state = GaugeMetricFamily("fsd_cluster_peer_state", "The peer's state (1 for the current one)",
                                  labels=[*labels, "state"])
        fams = {k: CounterMetricFamily(f"fsd_cluster_peer_{k}", h, labels=labels) for k, h in _PEER_COUNTERS.items()}
        hist = HistogramMetricFamily("fsd_cluster_peer_batch_seconds", "Duration of batch fetches from the peer",
                                     labels=labels)
        for p in peers:
            lv = [str(p["node"]), p["address"]]
            up.add_metric(lv, 1.0 if p["state"] == "up" else 0.0)
            state.add_metric([*lv, p["state"]], 1.0)
            for k, fam in fams.items():
                fam.add_metric(lv, float(p.get(k, 0)))
            cum, buckets = 0, []
            for bound, n in zip([*map(str, LATENCY_BUCKETS), "+Inf"], p["latency_buckets"]):
                cum += n
                buckets.append((bound, float(cum)))
            hist.add_metric(lv, buckets, sum_value=float(p["latency_sum_s"]))
        yield up
        yield state
        yield from fams.values()
        yield hist
        server = s.get("server", {})
        for k, h in _SERVER_COUNTERS.items():
            c = CounterMetricFamily(f"fsd_cluster_{k}", h)
            c.add_metric([], float(server.get(k, 0)))
            yield c


class MetricsServer:
    """A running exporter; ``close()`` stops it."""

    def __init__(self, address: str, status: Callable[[], dict[str, Any]]) -> None:
        host, port = split_address(address, "metrics") if not address.endswith(":0") else (address[:-2], 0)
        host = host.strip("[]")
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ClusterCollector(status))
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise FsdError(f"metrics: cannot listen on {address}: {e.strerror}") from None
        self.port = self._server.server_port
        log.info("cluster metrics on %s port %d", host, self.port)

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


__all__ = ["ClusterCollector", "MetricsServer"]
