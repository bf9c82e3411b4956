"""Prometheus exporter: the cluster counters, bound to the given address only."""

from __future__ import annotations

import socket
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from fsd.cluster.compat import FsdError
from fsd.cluster.config import parse_cluster
from fsd.cluster.metrics import MetricsServer
from fsd.cluster.transport import ClusterNode

pytestmark = pytest.mark.timeout(120)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_show_the_peer_counters(tmp_path: Path) -> None:
    sf = tmp_path / "secret"
    sf.write_text("metrics-secret\n")
    sf.chmod(0o600)
    ports = [_port(), _port()]
    nodes = [ClusterNode(parse_cluster({"node": k, "nodes": [f"127.0.0.1:{p}" for p in ports],
                                        "secret_file": str(sf)}), lambda i, down: b"x" * (i + 1), n_files=10,
                         fingerprint="a" * 64) for k in range(2)]
    m = None
    try:
        for n in nodes:
            n.start()
        assert dict(nodes[0].fetch_many([1, 2, 3], np.ones(10, dtype=int))) == {1: b"xx", 2: b"xxx", 3: b"xxxx"}
        m = MetricsServer("127.0.0.1:0", nodes[0].status)
        text = urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=10).read().decode()
        peer = f'address="127.0.0.1:{ports[1]}",peer="1"'
        assert f"fsd_cluster_peer_up{{{peer}}} 1.0" in text
        assert f"fsd_cluster_peer_fetched_bytes_total{{{peer}}} 9.0" in text
        assert f"fsd_cluster_peer_fetched_samples_total{{{peer}}} 3.0" in text
        assert f'fsd_cluster_peer_batch_seconds_count{{{peer}}} 1.0' in text
        assert "fsd_cluster_unauthenticated_total 0.0" in text
        out = subprocess.run(["ss", "-Hltn", f"sport = :{m.port}"], capture_output=True, text=True).stdout
        assert {line.split()[3] for line in out.splitlines()} == {f"127.0.0.1:{m.port}"}
        with pytest.raises(FsdError, match="cannot listen"):
            MetricsServer(f"127.0.0.1:{m.port}", nodes[0].status)
    finally:
        if m is not None:
            m.close()
        for n in nodes:
            n.close()
