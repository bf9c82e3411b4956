"""The cluster configuration: who the nodes are, which one this is, the secret, timeouts.

One TOML file (``fsd mount --cluster FILE``) or the ``[data.cluster]`` table of
``fsd up``, the same keys either way::

    node = 0                                   # this node's index into `nodes`
    nodes = ["10.1.0.1:7070", "10.1.0.2:7070"] # every node's host:port, same list on every node
    secret_file = "/etc/fsd/cluster.secret"    # shared secret: non-empty, not world-readable
    # optional
    listen = "10.1.0.1:7070"      # bind address (default: nodes[node]; never 0.0.0.0 unless written here)
    fetch_timeout = 10.0          # seconds a batch fetch may take before it falls back to the PFS
    connect_timeout = 5.0         # seconds a connection attempt may take
    listing_wait = 3.0            # seconds a node waits for a peer's slice of the listing's sizes (one applying
                                  #   the plan later); a slice not there by then is stat-ed by the node itself
    backoff_max = 30.0            # longest wait between reconnect attempts to a peer that is down
    max_batch = 256               # ids per fetch request
    capacity = "16G"              # tier bytes of every node, or a list with one size per node
    node_ranks = [[0, 1], [2, 3]] # ranks per node (default: contiguous blocks of num_replicas / nodes)
    metrics = "10.1.0.1:9100"     # Prometheus exporter address (off when absent)
    tls_cert = "node.pem"         # mutual TLS (all three, or none): this node's certificate (PEM), naming
    tls_key = "node.key"          #   its address of `nodes` (an IP SAN for an IP), its key (mode 600),
    tls_ca = "ca.pem"             #   and the CA that signed every node's certificate
    # checkpoint mounts (fsd mount --checkpoints ... --cluster FILE; docs/CLUSTER.md#checkpoint-replicas)
    replicas = 1                  # buddy nodes that keep a copy of each checkpoint file (0: none, the default)
    fsync = "replicated"          # "local" (default): fsync = durable here; "replicated": and on the buddies
    replica_timeout = 30.0        # seconds a "replicated" fsync waits for its buddies before failing with EIO
    replica_room = "200G"         # most device bytes kept for other nodes' copies (default: half the devices)
    ckpt_port_offset = 1          # a checkpoint daemon listens on its node's port + this

Inside a Slurm job, ``nodes = "slurm"`` with ``port = 7070`` derives the list from
``SLURM_JOB_NODELIST`` (expanded with the ``hostlist`` module, or ``scontrol show
hostnames``) and the index from ``SLURM_NODEID``.

Every error is a :class:`ClusterConfigError`, one line naming the file and the key.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import stat
import subprocess
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .compat import FsdError, parse_size

log = logging.getLogger(__name__)

MAX_NODES = 1 << 16
MAX_SECRET_BYTES = 4096
KEYS = ("node", "nodes", "port", "listen", "secret_file", "fetch_timeout", "connect_timeout", "listing_wait",
        "backoff_max", "max_batch", "capacity", "node_ranks", "metrics", "tls_cert", "tls_key", "tls_ca", "replicas",
        "fsync", "replica_timeout", "replica_room", "ckpt_port_offset")
FSYNC_LEVELS = ("local", "replicated")
TLS_KEYS = ("tls_cert", "tls_key", "tls_ca")
MAX_PEM_BYTES = 1 << 20


class ClusterConfigError(FsdError):
    """A bad cluster configuration; the message is one line for the user."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes of mutual TLS between the nodes: this node's certificate and key, and the CA."""

    cert: bytes
    key: bytes = field(repr=False)
    ca: bytes


@dataclass(frozen=True)
class ClusterConfig:
    """A validated cluster configuration (identical on every node except ``index`` and ``listen``)."""

    index: int
    nodes: tuple[str, ...]
    secret_file: Path
    secret: bytes = field(repr=False)
    listen: str
    fetch_timeout: float = 10.0
    connect_timeout: float = 5.0
    listing_wait: float = 3.0
    backoff_max: float = 30.0
    max_batch: int = 256
    capacities: tuple[int, ...] | None = None
    node_ranks: tuple[tuple[int, ...], ...] | None = None
    metrics: str | None = None
    tls: TlsFiles | None = None
    replicas: int = 0
    fsync: str = "local"
    replica_timeout: float = 30.0
    replica_room: int | None = None  # None: half the devices' size
    ckpt_port_offset: int = 1

    @property
    def size(self) -> int:
        """Number of nodes."""
        return len(self.nodes)

    @property
    def peers(self) -> dict[int, str]:
        """Every other node's index -> address."""
        return {i: a for i, a in enumerate(self.nodes) if i != self.index}

    def summary(self) -> dict[str, Any]:
        """JSON-able view for ``.fsd/status`` (no secret)."""
        return {"node": self.index, "nodes": list(self.nodes), "listen": self.listen,
                "fetch_timeout": self.fetch_timeout, "connect_timeout": self.connect_timeout,
                "listing_wait": self.listing_wait,
                "backoff_max": self.backoff_max, "max_batch": self.max_batch,
                "capacities": list(self.capacities) if self.capacities else None,
                "node_ranks": [list(r) for r in self.node_ranks] if self.node_ranks else None,
                "metrics": self.metrics, "replicas": self.replicas, "fsync": self.fsync}

    def ckpt_address(self, k: int) -> str:
        """Where node *k*'s checkpoint daemon listens: its node address, port + ``ckpt_port_offset``."""
        host, port = split_address(self.nodes[k], "")
        return join_address(host, port + self.ckpt_port_offset)

    def ckpt_listen(self) -> str:
        """This node's checkpoint daemon's bind address (``listen`` moved by ``ckpt_port_offset``)."""
        host, port = split_address(self.listen, "")
        return join_address(host, port + self.ckpt_port_offset)

    def buddies(self) -> list[int]:
        """The nodes that keep this node's checkpoint replicas: the next ``replicas`` on the ring."""
        return [(self.index + j) % self.size for j in range(1, self.replicas + 1)]


# --------------------------------------------------------------------------- pieces


def split_address(text: Any, what: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``; port 1..65535."""
    if not isinstance(text, str) or not text.strip():
        raise ClusterConfigError(f"{what} must be a \"host:port\" string, got {text!r}")
    t = text.strip()
    if t.startswith("["):
        host, sep, port = t[1:].partition("]:")
        if not sep:
            raise ClusterConfigError(f"{what}: {t!r} is not \"[ipv6]:port\"")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ClusterConfigError(f"{what}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port = t.rpartition(":")
        if not sep or not host:
            raise ClusterConfigError(f"{what}: {t!r} has no port (write \"host:port\")")
        if ":" in host:
            raise ClusterConfigError(f"{what}: write an IPv6 address in brackets, \"[{host}]:{port}\"")
        if any(c.isspace() for c in host) or "/" in host:
            raise ClusterConfigError(f"{what}: {host!r} is not a host name or address")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ClusterConfigError(f"{what}: port {port!r} is not a number in 1..65535")
    return host, int(port)


def join_address(host: str, port: int) -> str:
    """Inverse of :func:`split_address` (brackets for IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def read_secret(path: Path | str) -> bytes:
    """The shared secret: a regular file, non-empty, not readable by others (one-line errors)."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise ClusterConfigError(f"secret_file {p} does not exist") from None
    except OSError as e:
        raise ClusterConfigError(f"secret_file {p}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ClusterConfigError(f"secret_file {p} is not a regular file")
    if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
        raise ClusterConfigError(f"secret_file {p} is readable or writable by everyone "
                                 f"(mode {stat.S_IMODE(st.st_mode):o}); run: chmod 600 {p}")
    if st.st_size > MAX_SECRET_BYTES:
        raise ClusterConfigError(f"secret_file {p} is larger than {MAX_SECRET_BYTES} bytes; "
                                 "it should hold one line, e.g. from: openssl rand -hex 32")
    try:
        data = p.read_bytes().strip()
    except OSError as e:
        raise ClusterConfigError(f"secret_file {p}: {e.strerror}") from None
    if not data:
        raise ClusterConfigError(f"secret_file {p} is empty; put a random line in it, e.g. openssl rand -hex 32")
    return data


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist (``"n[01-03],gpu7"``): the ``hostlist`` module, else ``scontrol``."""
    try:
        import hostlist  # python-hostlist, optional
    except ImportError:
        hostlist = None
    if hostlist is not None:
        try:
            return list(hostlist.expand_hostlist(text))
        except hostlist.BadHostlist as e:
            raise ClusterConfigError(f"SLURM_JOB_NODELIST {text!r} is not a valid hostlist: {e}") from None
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise ClusterConfigError("cannot expand SLURM_JOB_NODELIST: install python-hostlist "
                                 "(pip install python-hostlist) or run where scontrol is on PATH")
    p = subprocess.run([scontrol, "show", "hostnames", text], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise ClusterConfigError(f"scontrol show hostnames {text!r} failed: {p.stderr.strip()}")
    return p.stdout.split()


def slurm_nodes(env: Mapping[str, str], port: int) -> tuple[int, list[str]]:
    """``(SLURM_NODEID, ["host:port", ...])`` from a Slurm job's environment."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ClusterConfigError("nodes = \"slurm\" but SLURM_JOB_NODELIST is not set (not inside a Slurm job?)")
    nodeid = env.get("SLURM_NODEID")
    if nodeid is None or not nodeid.strip().isdigit():
        raise ClusterConfigError(f"nodes = \"slurm\" but SLURM_NODEID is {nodeid!r}, not a node index")
    hosts = expand_hostlist(nodelist)
    if not hosts:
        raise ClusterConfigError(f"SLURM_JOB_NODELIST {nodelist!r} names no host")
    return int(nodeid), [join_address(h, port) for h in hosts]


def resolve_node_ranks(num_replicas: int, n_nodes: int,
                       node_ranks: Sequence[Sequence[int]] | None = None) -> tuple[tuple[int, ...], ...]:
    """Which ranks run on which node: *node_ranks* validated, or contiguous blocks.

    The default is torchrun's layout (global rank = node * nproc_per_node + local rank),
    which needs ``num_replicas`` divisible by the node count. An explicit list must have
    one non-empty list per node, and its ranks must be disjoint and cover ``0..num_replicas-1``.
    """
    if type(num_replicas) is not int or num_replicas < 1:
        raise ClusterConfigError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
    if node_ranks is None:
        if num_replicas % n_nodes:
            raise ClusterConfigError(f"num_replicas {num_replicas} is not a multiple of the {n_nodes} nodes; "
                                     "give node_ranks = [[...], ...] explicitly")
        k = num_replicas // n_nodes
        return tuple(tuple(range(i * k, (i + 1) * k)) for i in range(n_nodes))
    if not isinstance(node_ranks, (list, tuple)) or len(node_ranks) != n_nodes:
        got = len(node_ranks) if isinstance(node_ranks, (list, tuple)) else type(node_ranks).__name__
        raise ClusterConfigError(f"node_ranks must be a list of {n_nodes} lists (one per node), got {got}")
    owner: dict[int, int] = {}
    out = []
    for i, ranks in enumerate(node_ranks):
        if not isinstance(ranks, (list, tuple)) or not ranks:
            raise ClusterConfigError(f"node_ranks[{i}] must be a non-empty list of ranks, got {ranks!r}")
        for r in ranks:
            if type(r) is not int or not 0 <= r < num_replicas:
                raise ClusterConfigError(f"node_ranks[{i}]: rank {r!r} is not in 0..{num_replicas - 1}")
            if r in owner:
                where = "twice on node" if owner[r] == i else "on nodes"
                nodes = f"{i}" if owner[r] == i else f"{owner[r]} and {i}"
                raise ClusterConfigError(f"node_ranks: rank {r} is listed {where} {nodes}")
            owner[r] = i
        out.append(tuple(sorted(ranks)))
    missing = sorted(set(range(num_replicas)) - set(owner))
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        raise ClusterConfigError(f"node_ranks: rank(s) {shown} of 0..{num_replicas - 1} run on no node")
    return tuple(out)


def node_of_rank(node_ranks: Sequence[Sequence[int]], num_replicas: int) -> list[int]:
    """Inverse map: rank -> node index."""
    out = [-1] * num_replicas
    for i, ranks in enumerate(node_ranks):
        for r in ranks:
            out[r] = i
    return out


# --------------------------------------------------------------------------- the table


def _number(t: Mapping[str, Any], key: str, default: float, where: str) -> float:
    v = t.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 86400:
        raise ClusterConfigError(f"{where}: `{key}` must be a number of seconds in (0, 86400], got {v!r}")
    return float(v)


def _capacities(v: Any, n: int, where: str) -> tuple[int, ...] | None:
    if v is None:
        return None
    items = v if isinstance(v, list) else [v] * n
    if len(items) != n:
        raise ClusterConfigError(f"{where}: `capacity` lists {len(items)} sizes for {n} nodes")
    out = []
    for x in items:
        try:
            out.append(parse_size(x))
        except ValueError as e:
            raise ClusterConfigError(f"{where}: `capacity`: {e}") from None
    return tuple(out)


def parse_cluster(table: Mapping[str, Any], where: str = "cluster config", base: Path | None = None,
                  env: Mapping[str, str] | None = None) -> ClusterConfig:
    """Validate a cluster table (parsed TOML). *base* resolves a relative ``secret_file``."""
    env = os.environ if env is None else env
    if not isinstance(table, Mapping):
        raise ClusterConfigError(f"{where} must be a table of keys")
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise ClusterConfigError(f"{where}: unknown key(s) {unknown}; valid: {list(KEYS)}")
    nodes_v = table.get("nodes")
    if nodes_v == "slurm":
        port = table.get("port")
        if type(port) is not int or not 1 <= port <= 65535:
            raise ClusterConfigError(f"{where}: nodes = \"slurm\" needs `port` = a number in 1..65535, got {port!r}")
        slurm_index, nodes = slurm_nodes(env, port)
        index_v = table.get("node", slurm_index)
    else:
        if "port" in table:
            raise ClusterConfigError(f"{where}: `port` applies only to nodes = \"slurm\" "
                                     "(otherwise each entry of `nodes` has its own port)")
        if not isinstance(nodes_v, list) or not nodes_v:
            raise ClusterConfigError(f"{where}: `nodes` must be a non-empty list of \"host:port\" strings "
                                     f"(the same on every node) or \"slurm\", got {nodes_v!r}")
        nodes = list(nodes_v)
        if "node" not in table:
            raise ClusterConfigError(f"{where}: `node` (this node's index into `nodes`) is required")
        index_v = table["node"]
    if len(nodes) > MAX_NODES:
        raise ClusterConfigError(f"{where}: {len(nodes)} nodes is more than {MAX_NODES}")
    seen: dict[tuple[str, int], int] = {}
    for i, a in enumerate(nodes):
        hp = split_address(a, f"{where}: nodes[{i}]")
        if hp in seen:
            raise ClusterConfigError(f"{where}: nodes[{seen[hp]}] and nodes[{i}] are both {a!r}")
        seen[hp] = i
    nodes = [join_address(*split_address(a, "")) for a in nodes]
    if type(index_v) is not int or not 0 <= index_v < len(nodes):
        raise ClusterConfigError(f"{where}: `node` must be an index in 0..{len(nodes) - 1}, got {index_v!r}")
    listen = table.get("listen", nodes[index_v])
    listen = join_address(*split_address(listen, f"{where}: `listen`"))
    if "secret_file" not in table:
        raise ClusterConfigError(f"{where}: `secret_file` is required (a file with one random line, mode 600)")
    sf = table["secret_file"]
    if not isinstance(sf, str) or not sf:
        raise ClusterConfigError(f"{where}: `secret_file` must be a path string, got {sf!r}")
    secret_file = Path(sf) if base is None else base / sf
    try:
        secret = read_secret(secret_file)
    except ClusterConfigError as e:
        raise ClusterConfigError(f"{where}: {e}") from None
    max_batch = table.get("max_batch", 256)
    if type(max_batch) is not int or not 1 <= max_batch <= 65536:
        raise ClusterConfigError(f"{where}: `max_batch` must be an integer in 1..65536, got {max_batch!r}")
    node_ranks = table.get("node_ranks")
    if node_ranks is not None:
        if not isinstance(node_ranks, list) or not all(isinstance(r, list) for r in node_ranks):
            raise ClusterConfigError(f"{where}: `node_ranks` must be a list of lists of ranks")
        n_ranks = sum(len(r) for r in node_ranks)
        try:
            node_ranks = resolve_node_ranks(max(1, n_ranks), len(nodes), node_ranks)
        except ClusterConfigError as e:
            raise ClusterConfigError(f"{where}: {e}") from None
    metrics = table.get("metrics")
    if metrics is not None:
        metrics = join_address(*split_address(metrics, f"{where}: `metrics`"))
    replicas = table.get("replicas", 0)
    if type(replicas) is not int or not 0 <= replicas < len(nodes):
        raise ClusterConfigError(f"{where}: `replicas` must be an integer in 0..{len(nodes) - 1} (fewer than "
                                 f"the nodes), got {replicas!r}")
    fsync = table.get("fsync", "local")
    if fsync not in FSYNC_LEVELS:
        raise ClusterConfigError(f"{where}: `fsync` must be one of {list(FSYNC_LEVELS)}, got {fsync!r}")
    if fsync == "replicated" and not replicas:
        raise ClusterConfigError(f"{where}: fsync = \"replicated\" needs `replicas` >= 1")
    room = table.get("replica_room")
    if room is not None:
        try:
            room = parse_size(room)
        except (ValueError, TypeError) as e:
            raise ClusterConfigError(f"{where}: `replica_room`: {e}") from None
    offset = table.get("ckpt_port_offset", 1)
    if type(offset) is not int or not 1 <= offset < 65535:
        raise ClusterConfigError(f"{where}: `ckpt_port_offset` must be an integer in 1..65534, got {offset!r}")
    for i, a in enumerate(nodes):
        if split_address(a, "")[1] + offset > 65535:
            raise ClusterConfigError(f"{where}: nodes[{i}] {a!r} + ckpt_port_offset {offset} is past port 65535")
    return ClusterConfig(
        tls=_tls(table, where, base),
        replicas=replicas, fsync=fsync, replica_timeout=_number(table, "replica_timeout", 30.0, where),
        replica_room=room, ckpt_port_offset=offset,
        index=index_v, nodes=tuple(nodes), secret_file=secret_file, secret=secret, listen=listen,
        fetch_timeout=_number(table, "fetch_timeout", 10.0, where),
        connect_timeout=_number(table, "connect_timeout", 5.0, where),
        listing_wait=_number(table, "listing_wait", 3.0, where),
        backoff_max=_number(table, "backoff_max", 30.0, where),
        max_batch=max_batch, capacities=_capacities(table.get("capacity"), len(nodes), where),
        node_ranks=node_ranks, metrics=metrics,
    )


def _tls(table: Mapping[str, Any], where: str, base: Path | None) -> TlsFiles | None:
    """The TLS files named by the table (all three or none), read and checked."""
    given = [k for k in TLS_KEYS if k in table]
    if not given:
        return None
    if len(given) != len(TLS_KEYS):
        missing = [k for k in TLS_KEYS if k not in table]
        raise ClusterConfigError(f"{where}: mutual TLS needs all of {list(TLS_KEYS)}; missing {missing}")
    pem: dict[str, bytes] = {}
    for k in TLS_KEYS:
        v = table[k]
        if not isinstance(v, str) or not v:
            raise ClusterConfigError(f"{where}: `{k}` must be a path string, got {v!r}")
        p = Path(v) if base is None else base / v
        try:
            st = p.stat()
            if st.st_size > MAX_PEM_BYTES:
                raise ClusterConfigError(f"{where}: `{k}` {p} is larger than {MAX_PEM_BYTES} bytes: not a PEM file")
            if k == "tls_key" and st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
                raise ClusterConfigError(f"{where}: `tls_key` {p} is readable or writable by everyone; "
                                         f"run: chmod 600 {p}")
            data = p.read_bytes()
        except FileNotFoundError:
            raise ClusterConfigError(f"{where}: `{k}` {p} does not exist") from None
        except OSError as e:
            raise ClusterConfigError(f"{where}: `{k}` {p}: {e.strerror}") from None
        if b"-----BEGIN " not in data:
            raise ClusterConfigError(f"{where}: `{k}` {p} holds no PEM block (-----BEGIN ...)")
        pem[k] = data
    return TlsFiles(cert=pem["tls_cert"], key=pem["tls_key"], ca=pem["tls_ca"])


def load_cluster(path: Path | str, env: Mapping[str, str] | None = None) -> ClusterConfig:
    """Read ``--cluster FILE`` (TOML, the keys at top level or in a ``[cluster]`` table)."""
    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ClusterConfigError(f"cluster config {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ClusterConfigError(f"cluster config {p}: {getattr(e, 'strerror', None) or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ClusterConfigError(f"cluster config {p}: {e}") from None
    if set(doc) == {"cluster"} and isinstance(doc["cluster"], dict):
        doc = doc["cluster"]
    return parse_cluster(doc, f"cluster config {p}", base=p.parent, env=env)


def check_node_ranks(cfg: ClusterConfig, num_replicas: int, ranks: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """The job's node->ranks map for a plan, and a check that this node's plan ``ranks`` agree with it."""
    layout = resolve_node_ranks(num_replicas, cfg.size, cfg.node_ranks)
    mine = layout[cfg.index]
    if tuple(sorted(ranks)) != mine:
        raise ClusterConfigError(f"this node (node {cfg.index}) runs ranks {sorted(ranks)} but the cluster layout "
                                 f"puts ranks {list(mine)} on it")
    return layout


__all__ = ["KEYS", "ClusterConfig", "ClusterConfigError", "TlsFiles", "check_node_ranks", "expand_hostlist", "join_address",
           "load_cluster", "node_of_rank", "parse_cluster", "read_secret", "resolve_node_ranks", "slurm_nodes",
           "split_address"]
