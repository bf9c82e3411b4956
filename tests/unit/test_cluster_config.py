"""Cluster config: one-line errors for bad files, Slurm derivation, node -> ranks layout."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from fsd.cluster.config import (
    ClusterConfigError,
    check_node_ranks,
    expand_hostlist,
    load_cluster,
    parse_cluster,
    read_secret,
    resolve_node_ranks,
    split_address,
)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    p = tmp_path / "secret"
    p.write_text("0123456789abcdef\n")
    p.chmod(0o600)
    return p


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cluster.toml"
    p.write_text(text)
    return p


def _err(fn, *a, **kw) -> str:
    with pytest.raises(ClusterConfigError) as ei:
        fn(*a, **kw)
    msg = str(ei.value)
    assert "\n" not in msg and msg
    return msg


def test_full_file(tmp_path: Path, secret: Path) -> None:
    p = _write(tmp_path, f"""
node = 1
nodes = ["10.9.0.1:7070", "node-b:7071", "[fd00::3]:7070"]
secret_file = "{secret.name}"
fetch_timeout = 2.5
capacity = ["1G", "512M", 1000]
node_ranks = [[0, 3], [1], [2]]
metrics = "127.0.0.1:9100"
""")
    c = load_cluster(p)
    assert c.index == 1 and c.size == 3
    assert c.nodes == ("10.9.0.1:7070", "node-b:7071", "[fd00::3]:7070")
    assert c.listen == "node-b:7071"  # binds where the others reach it, never 0.0.0.0 by default
    assert c.secret == b"0123456789abcdef" and "0123456789" not in repr(c)
    assert c.fetch_timeout == 2.5 and c.connect_timeout == 5.0
    assert c.capacities == (1 << 30, 512 << 20, 1000)
    assert c.node_ranks == ((0, 3), (1,), (2,))
    assert c.peers == {0: "10.9.0.1:7070", 2: "[fd00::3]:7070"}
    assert c.summary()["nodes"] == list(c.nodes) and "secret" not in str(c.summary())


def test_cluster_table_and_up_section(tmp_path: Path, secret: Path) -> None:
    p = _write(tmp_path, f'[cluster]\nnode = 0\nnodes = ["127.0.0.1:7001", "127.0.0.1:7002"]\n'
                         f'secret_file = "{secret}"\ncapacity = "2G"\n')
    c = load_cluster(p)
    assert c.capacities == (2 << 30, 2 << 30)
    # fsd up's [data.cluster] table goes through the same parser
    c2 = parse_cluster({"node": 1, "nodes": ["127.0.0.1:7001", "127.0.0.1:7002"], "secret_file": str(secret),
                        "listen": "0.0.0.0:7002"}, "config up.toml [data.cluster]")
    assert c2.listen == "0.0.0.0:7002" and c2.index == 1


@pytest.mark.parametrize("body, expect", [
    ('nodes = ["a:1"]\nsecret_file = "S"', "`node`"),
    ('node = 2\nnodes = ["a:1", "b:1"]\nsecret_file = "S"', "0..1, got 2"),
    ('node = 0\nnodes = []\nsecret_file = "S"', "`nodes` must be a non-empty list"),
    ('node = 0\nnodes = ["a"]\nsecret_file = "S"', "has no port"),
    ('node = 0\nnodes = ["a:99999"]\nsecret_file = "S"', "1..65535"),
    ('node = 0\nnodes = ["a:1", "a:1"]\nsecret_file = "S"', "both 'a:1'"),
    ('node = 0\nnodes = ["fd00::1:7070"]\nsecret_file = "S"', "in brackets"),
    ('node = 0\nnodes = ["a:1"]', "`secret_file` is required"),
    ('node = 0\nnodes = ["a:1"]\nsecret_file = "S"\nfetch_timeout = 0', "`fetch_timeout`"),
    ('node = 0\nnodes = ["a:1"]\nsecret_file = "S"\nbogus = 1', "unknown key(s) ['bogus']"),
    ('node = 0\nnodes = ["a:1"]\nsecret_file = "S"\nport = 7', "`port` applies only"),
    ('node = 0\nnodes = ["a:1", "b:1"]\nsecret_file = "S"\ncapacity = ["1G"]', "1 sizes for 2 nodes"),
    ('node = 0\nnodes = ["a:1"]\nsecret_file = "S"\ncapacity = "lots"', "not a size"),
    ('node = 0\nnodes = ["a:1", "b:1"]\nsecret_file = "S"\nnode_ranks = [[0, 1], [1]]',
     "rank 1 is listed on nodes 0 and 1"),
    ('node = 0\nnodes = ["a:1"]\nsecret_file = "S"\nmax_batch = 0', "`max_batch`"),
    ('node = 0\nnodes = ["a:1"]\nsecret_file = "S"\nlisten = "x"', "`listen`"),
    ('node = 0\nnodes = "a:1"\nsecret_file = "S"', "`nodes` must be"),
    ('node = [0\n', "cluster.toml"),
])
def test_bad_config_one_line(tmp_path: Path, secret: Path, body: str, expect: str) -> None:
    p = _write(tmp_path, body.replace('"S"', f'"{secret}"'))
    msg = _err(load_cluster, p)
    assert expect in msg, msg
    assert str(p) in msg


def test_missing_file(tmp_path: Path) -> None:
    assert "does not exist" in _err(load_cluster, tmp_path / "nope.toml")


def test_secret_file_checks(tmp_path: Path) -> None:
    p = tmp_path / "s"
    assert "does not exist" in _err(read_secret, p)
    p.write_text("  \n")
    p.chmod(0o600)
    assert "is empty" in _err(read_secret, p)
    p.write_text("hunter2-but-longer\n")
    p.chmod(0o644)
    msg = _err(read_secret, p)
    assert "readable or writable by everyone" in msg and "chmod 600" in msg
    p.chmod(0o640)
    assert read_secret(p) == b"hunter2-but-longer"
    assert "not a regular file" in _err(read_secret, tmp_path)
    # via the config: the error names the config file
    cfg = _write(tmp_path, f'node = 0\nnodes = ["a:1"]\nsecret_file = "{tmp_path / "gone"}"\n')
    assert "secret_file" in _err(load_cluster, cfg)


def test_split_address() -> None:
    assert split_address("h:1", "x") == ("h", 1)
    assert split_address("[::1]:80", "x") == ("::1", 80)
    assert "IPv6" in _err(split_address, "[zz]:80", "x")


def test_slurm(tmp_path: Path, secret: Path) -> None:
    env = {"SLURM_JOB_NODELIST": "gpu[01-03,07],login", "SLURM_NODEID": "2"}
    c = parse_cluster({"nodes": "slurm", "port": 7070, "secret_file": str(secret)}, env=env)
    assert c.nodes == ("gpu01:7070", "gpu02:7070", "gpu03:7070", "gpu07:7070", "login:7070")
    assert c.index == 2 and c.listen == "gpu03:7070"
    assert "SLURM_JOB_NODELIST is not set" in _err(parse_cluster, {"nodes": "slurm", "port": 7070,
                                                                    "secret_file": str(secret)}, env={})
    assert "SLURM_NODEID" in _err(parse_cluster, {"nodes": "slurm", "port": 7070, "secret_file": str(secret)},
                                  env={"SLURM_JOB_NODELIST": "a[1-2]"})
    assert "needs `port`" in _err(parse_cluster, {"nodes": "slurm", "secret_file": str(secret)}, env=env)
    assert "not a valid hostlist" in _err(expand_hostlist, "a[3-1")


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="no scontrol here")
def test_slurm_scontrol_agrees() -> None:  # pragma: no cover - only on a Slurm machine
    import subprocess
    out = subprocess.run(["scontrol", "show", "hostnames", "n[1-3]"], capture_output=True, text=True).stdout.split()
    assert expand_hostlist("n[1-3]") == out


def test_node_ranks_default_and_explicit() -> None:
    assert resolve_node_ranks(8, 4) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert resolve_node_ranks(3, 1) == ((0, 1, 2),)
    assert "not a multiple" in _err(resolve_node_ranks, 6, 4)
    assert resolve_node_ranks(4, 2, [[3, 0], [1, 2]]) == ((0, 3), (1, 2))
    assert "run on no node" in _err(resolve_node_ranks, 4, 2, [[0], [1, 2]])
    assert "twice on node 0" in _err(resolve_node_ranks, 4, 2, [[0, 0], [1, 2, 3]])
    assert "not in 0..3" in _err(resolve_node_ranks, 4, 2, [[0, 4], [1, 2, 3]])
    assert "2 lists" in _err(resolve_node_ranks, 4, 2, [[0, 1, 2, 3]])
    assert "non-empty" in _err(resolve_node_ranks, 4, 2, [[0, 1, 2, 3], []])


def test_check_node_ranks(secret: Path) -> None:
    c = parse_cluster({"node": 1, "nodes": ["a:1", "b:1"], "secret_file": str(secret)})
    assert check_node_ranks(c, 4, [3, 2]) == ((0, 1), (2, 3))
    assert "puts ranks [2, 3] on it" in _err(check_node_ranks, c, 4, [0, 1])
    assert "not a multiple" in _err(check_node_ranks, c, 3, [2])


def test_root_can_still_be_refused_by_mode(tmp_path: Path) -> None:
    """The mode check does not depend on who reads (root reads anything)."""
    p = tmp_path / "s"
    p.write_text("x" * 32)
    os.chmod(p, 0o604)
    assert "everyone" in _err(read_secret, p)


def test_fsd_up_passes_the_cluster_file_and_metrics_port(tmp_path: Path) -> None:
    from fsd import config
    from fsd.errors import FsdError

    p = tmp_path / "up.toml"
    p.write_text('[data]\nsource = "/d"\ncluster = "/etc/fsd/cluster.toml"\nmetrics_port = 9100\n')
    argv = config.mount_argv("data", config.load(p)["data"])
    assert argv[argv.index("--cluster") + 1] == "/etc/fsd/cluster.toml"
    assert argv[argv.index("--metrics-port") + 1] == "9100"
    p.write_text('[data]\nsource = "/d"\n[data.cluster]\nnode = 0\n')
    with pytest.raises(FsdError, match="path of a cluster file"):
        config.load(p)


def test_checkpoint_replica_keys(tmp_path: Path, secret: Path) -> None:
    from fsd import config

    head = f'node = 1\nnodes = ["127.0.0.1:7070", "127.0.0.1:7080", "127.0.0.1:7090"]\nsecret_file = "{secret.name}"\n'
    cfg = load_cluster(_write(tmp_path, head))
    assert cfg.replicas == 0 and cfg.fsync == "local" and cfg.buddies() == []
    cfg = load_cluster(_write(tmp_path, head + 'replicas = 2\nfsync = "replicated"\nckpt_port_offset = 5\n'))
    assert cfg.buddies() == [2, 0] and cfg.ckpt_address(2) == "127.0.0.1:7095" and cfg.ckpt_listen() == "127.0.0.1:7085"
    assert "`replicas` must be an integer in 0..2" in _err(load_cluster, _write(tmp_path, head + "replicas = 3\n"))
    assert "`fsync` must be one of" in _err(load_cluster, _write(tmp_path, head + 'replicas = 1\nfsync = "always"\n'))
    assert "needs `replicas` >= 1" in _err(load_cluster, _write(tmp_path, head + 'fsync = "replicated"\n'))
    assert "past port 65535" in _err(load_cluster, _write(tmp_path, head + "ckpt_port_offset = 60000\n"))
    p = tmp_path / "up.toml"
    p.write_text('[checkpoints]\ndir = "/c"\ndevices = ["/n0"]\ncluster = "/etc/fsd/cluster.toml"\n')
    argv = config.mount_argv("checkpoints", config.load(p)["checkpoints"])
    assert argv[argv.index("--cluster") + 1] == "/etc/fsd/cluster.toml"


def test_tls_files_all_three_or_none(tmp_path: Path, secret: Path) -> None:
    head = f'node = 0\nnodes = ["127.0.0.1:7070", "127.0.0.1:7071"]\nsecret_file = "{secret.name}"\n'
    assert load_cluster(_write(tmp_path, head)).tls is None
    pem = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
    for name in ("node.pem", "ca.pem", "node.key"):
        (tmp_path / name).write_text(pem)
    (tmp_path / "node.key").chmod(0o600)
    full = head + 'tls_cert = "node.pem"\ntls_key = "node.key"\ntls_ca = "ca.pem"\n'
    tls = load_cluster(_write(tmp_path, full)).tls
    assert tls is not None and tls.cert == tls.ca == tls.key == pem.encode() and "key=" not in repr(tls)
    two = head + 'tls_cert = "node.pem"\ntls_key = "node.key"\n'
    assert "missing ['tls_ca']" in _err(load_cluster, _write(tmp_path, two))
    (tmp_path / "node.key").chmod(0o644)
    assert "chmod 600" in _err(load_cluster, _write(tmp_path, full))
    (tmp_path / "node.key").chmod(0o600)
    (tmp_path / "ca.pem").write_text("not a certificate")
    assert "no PEM block" in _err(load_cluster, _write(tmp_path, full))
    (tmp_path / "ca.pem").unlink()
    assert "does not exist" in _err(load_cluster, _write(tmp_path, full))
