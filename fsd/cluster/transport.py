"""gRPC transport between cluster nodes: batched server-streaming fetches of dataset files.

Server (:class:`PeerServer`): answers ``Fetch(ids)`` from a callback the node supplies,
``serve(file_id) -> bytes | memoryview | None`` (None: not available here, the asking
node reads the PFS). It runs in grpc's own thread pool, never on the node's trio loop;
``serve`` must therefore be thread-safe and must not call into the loop. It binds only
the configured address, with SO_REUSEPORT off (a port in use is an error, not a silent
second listener). Every call is signed with the cluster secret and seen once
(:mod:`fsd.cluster.auth`) and must carry the same plan fingerprint; ids are integers into the
dataset listing, range-checked - no path from a request is ever opened. Every sample carries the
XXH3-64 its owner computed when it read the PFS; the client checks it and drops a sample that
fails (the caller reads the PFS instead). With ``tls_cert``/``tls_key`` (and ``tls_ca``: mutual
TLS) in the cluster file, channels and the listener use grpc's own TLS credentials.

Client (:class:`Peers`, one :class:`PeerClient` per other node): ``fetch`` yields every
requested id exactly once as ``(id, bytes)`` or ``(id, None)`` = fall back to the PFS. A
batch has a bounded deadline; a peer that is down fails at once while grpc reconnects it
with its own exponential back-off (``grpc.initial/max_reconnect_backoff_ms``); a peer that
keeps failing (down, slow, refusing) trips a circuit breaker (``pybreaker``): its fetches
fall back at once until the breaker lets one trial batch through after ``backoff_max``.
Fetches block: call them from worker threads (``Peers.fetch_many`` runs one per owner on
its own pool), never from a trio loop (refused with RuntimeError).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
import grpc.experimental
import numpy as np
import pybreaker
import xxhash

from . import auth, peer_pb2, peer_pb2_grpc
from . import stats as st
from .compat import FsdError, name_os_thread
from .config import ClusterConfig, TlsFiles

log = logging.getLogger(__name__)

ServeFn = Callable[[int, frozenset[int]], "bytes | bytearray | memoryview | tuple[bytes, int] | None"]
"""A file's bytes for a peer that takes the nodes of the set as down, with their XXH3-64 where known
(else computed here); None: not here."""
SERVICE = "fsd.cluster.v1.Peer"
MAX_MESSAGE = 1 << 30
"""Largest sample a peer sends or accepts (grpc's default is 4 MiB)."""
BREAKER_FAILS = 3
"""Consecutive failed batches that open a peer's breaker."""
FETCH_MESSAGE_BYTES = 1 << 20
"""Samples of a fetch that are at hand are sent together, up to this many bytes a message."""
SizesOfFn = Callable[[bytes, float], "tuple[int, bytes] | None"]
"""This node's slice of the listing with this digest, waiting at most so long (:mod:`fsd.cluster.listing`)."""
ReadyFn = Callable[[int, frozenset[int]], bool]
"""Whether ``serve(fid, down)`` would answer at once (from memory, or missing): such samples are sent
together; before any other, what is at hand goes out."""


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The XXH3-64 of a sample (~10 us per 100 kB: a well-kept C library, not hand code)."""
    return xxhash.xxh3_64_intdigest(data)


def _not_on_trio() -> None:
    import trio

    if trio.lowlevel.in_trio_run():
        raise RuntimeError("peer fetches block: run them on a worker thread (trio.to_thread.run_sync), "
                           "never on the trio loop")


# --------------------------------------------------------------------------- server


def bind(server: grpc.Server, listen: str, tls: TlsFiles | None) -> int:
    """Bind *server* to *listen* (mutual TLS with *tls*); the port, or FsdError."""
    try:
        if tls is None:
            port = server.add_insecure_port(listen)
        else:  # mutual TLS: a peer shows a certificate of the cluster's CA, or the handshake fails
            creds = grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca,
                                                require_client_auth=True)
            port = server.add_secure_port(listen, creds)
    except RuntimeError:
        port = 0
    if not port:
        raise FsdError(f"cluster: cannot listen on {listen} (address in use, or not an address of this node?)")
    return port


def open_channel(address: str, tls: TlsFiles | None, options: list[tuple[str, Any]]) -> grpc.Channel:
    """A channel to *address* (mutual TLS with *tls*)."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)
    return grpc.secure_channel(address, creds, options=options)


class _Servicer(peer_pb2_grpc.PeerServicer):
    def __init__(self, server: PeerServer) -> None:
        self.s = server

    def _authenticate(self, context: grpc.ServicerContext, method: str, request: Any) -> None:
        """Abort the call unless it is signed with the cluster secret, recent and new."""
        s = self.s
        why = s.verifier.check(dict(context.invocation_metadata()), method,
                               request.SerializeToString(deterministic=True))
        if why is not None:
            n = s.stats.add(context.peer(), unauthenticated=1, replays=int(why.startswith("replayed")))
            if st.log_worthy(n):
                log.warning("refused a peer request from %s: %s (%d so far)", context.peer(), why, n)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    def _check(self, context: grpc.ServicerContext, request: peer_pb2.FetchRequest) -> st.PeerStats | None:
        """Authenticate, then check the plan; aborts the call when either fails."""
        s = self.s
        self._authenticate(context, "Fetch", request)
        node, fingerprint = request.node, request.fingerprint
        peer = s.peer_stats.get(node)
        if s.fingerprint is None or fingerprint != s.fingerprint:
            n = s.stats.add(context.peer(), plan_refusals=1)
            if peer is not None:
                peer.add(served_refused=1)
                peer.set_state(st.PLAN_DIFFERS, "its plan fingerprint differs from ours")
            if st.log_worthy(n):
                log.warning("refused node %d (%s): plan fingerprint differs (%d so far)", node, context.peer(), n)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "no plan yet" if s.fingerprint is None else "plan differs")
        return peer

    def Hello(self, request: peer_pb2.HelloRequest, context: grpc.ServicerContext) -> peer_pb2.HelloReply:
        s = self.s
        self._authenticate(context, "Hello", request)
        same = s.fingerprint is not None and request.fingerprint == s.fingerprint
        return peer_pb2.HelloReply(fingerprint=s.fingerprint or "", node=s.node, same_plan=same)

    def Sizes(self, request: peer_pb2.SizesRequest, context: grpc.ServicerContext) -> peer_pb2.SizesReply:
        s = self.s
        self._authenticate(context, "Sizes", request)
        left = context.time_remaining()  # answered a little before the asker gives up
        got = None if s.sizes_of is None else s.sizes_of(request.listing,
                                                         float("inf") if left is None else max(0.0, left - 0.1))
        if got is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no slice of that listing here (yet)")
        return peer_pb2.SizesReply(first=got[0], sizes=got[1])

    def Fetch(self, request: peer_pb2.FetchRequest,
              context: grpc.ServicerContext) -> Iterator[peer_pb2.SampleBatch]:
        s = self.s
        peer = self._check(context, request)
        ids = request.ids
        if len(ids) > s.max_batch or (len(ids) and max(ids) >= s.n_files):
            s.stats.add(context.peer(), bad_requests=1)
            if peer is not None:
                peer.add(served_refused=1)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a batch holds at most {s.max_batch} ids, each below {s.n_files}")
        down = frozenset(int(k) for k in request.down)
        # a message costs about the same CPU at each end whatever its size: samples that are here go
        # together, up to FETCH_MESSAGE_BYTES; what is here goes out before a serve that may wait (the PFS)
        batch: list[peer_pb2.Sample] = []
        nbytes = 0
        for fid in ids:
            if not context.is_active():
                return
            fid = int(fid)
            if batch and (nbytes >= FETCH_MESSAGE_BYTES or s.ready is None or not s.ready(fid, down)):
                yield peer_pb2.SampleBatch(samples=batch)
                batch, nbytes = [], 0
            batch.append(self._sample(fid, down, peer))
            nbytes += len(batch[-1].data)
        if batch:
            yield peer_pb2.SampleBatch(samples=batch)

    def _sample(self, fid: int, down: frozenset[int], peer: st.PeerStats | None) -> peer_pb2.Sample:
        """One requested file as a message: its bytes and XXH3-64, or missing (the asker reads the PFS)."""
        s = self.s
        try:
            got = s.serve(fid, down)
            data, digest = got if isinstance(got, tuple) else (got, None)
            if data is not None and not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"serve returned {type(data).__name__}")
            if data is not None and digest is None:
                digest = checksum(data)
        except Exception:
            if st.log_worthy(s.stats.add(serve_errors=1)):
                log.exception("serve(%d) failed; answering missing", fid)
            data = None
        if peer is not None:
            peer.served(None if data is None else len(data))
        if data is None:
            return peer_pb2.Sample(id=fid, missing=True)
        # protobuf takes bytes; bytes objects are passed on as they are
        return peer_pb2.Sample(id=fid, data=data if isinstance(data, bytes) else bytes(data), xxh3=digest)


class PeerServer:
    """This node's listener. ``start()`` binds and serves; ``stop()`` ends it."""

    def __init__(self, listen: str, secret: bytes, node: int, n_files: int, serve: ServeFn, *,
                 fingerprint: str | None = None, peers: Iterable[st.PeerStats] = (), max_batch: int = 4096,
                 threads: int = 8, tls: TlsFiles | None = None, ready: ReadyFn | None = None,
                 sizes_of: SizesOfFn | None = None) -> None:
        self.listen = listen
        self.node = node
        self.n_files = n_files
        self.serve = serve
        self.ready = ready  # None: one sample a message
        self.sizes_of = sizes_of  # None: this node shares no listing sizes
        self.fingerprint = fingerprint
        self.max_batch = max_batch
        self.stats = st.ServerStats()
        self.peer_stats = {p.node: p for p in peers}
        self.tls = tls
        self.verifier = auth.Verifier(auth.derive_key(secret))
        self._pool = futures.ThreadPoolExecutor(threads, thread_name_prefix="fsd-peer-serve",
                                                initializer=name_os_thread)
        self._server = grpc.server(self._pool, maximum_concurrent_rpcs=4 * threads, options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", 1 << 20),  # requests are small
        ])
        peer_pb2_grpc.add_PeerServicer_to_server(_Servicer(self), self._server)
        self.port: int | None = None

    def set_plan(self, fingerprint: str | None, n_files: int) -> None:
        """A new plan: peers with another fingerprint are refused from now on."""
        self.n_files = n_files
        self.fingerprint = fingerprint

    def start(self) -> int:
        """Bind the configured address and serve; returns the port (useful with port 0)."""
        try:
            port = bind(self._server, self.listen, self.tls)
        except FsdError:
            self._pool.shutdown(wait=False)
            raise
        self._server.start()
        self.port = port
        log.info("cluster: node %d serving peers on %s", self.node, self.listen)
        return port

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting, let running streams end for *grace* seconds, then cancel them."""
        self._server.stop(grace).wait()
        self._pool.shutdown(wait=True)

    def status(self) -> dict[str, Any]:
        """Server-side counters."""
        return {"listen": self.listen, "port": self.port, **self.stats.snapshot()}


# --------------------------------------------------------------------------- client


def channel_options(connect_timeout: float, backoff_max: float, service: str = SERVICE) -> list[tuple[str, Any]]:
    """Channel options: retry of calls that never reached a server, reconnect back-off, message size."""
    service_config = {"methodConfig": [{
        "name": [{"service": service}],
        # a call that never reached a server (a restart's GOAWAY, a refused connect) is tried
        # again by grpc itself, within the call's deadline
        "retryPolicy": {"maxAttempts": 2, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
    }]}
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", json.dumps(service_config)),
        ("grpc.initial_reconnect_backoff_ms", int(min(1.0, backoff_max) * 1000)),
        ("grpc.max_reconnect_backoff_ms", int(backoff_max * 1000)),
        ("grpc.min_reconnect_backoff_ms", int(connect_timeout * 1000)),  # = the connect timeout
    ]


_FAILURE_STATES = {
    grpc.StatusCode.UNAUTHENTICATED: st.REFUSED,
    grpc.StatusCode.FAILED_PRECONDITION: st.PLAN_DIFFERS,
    grpc.StatusCode.DEADLINE_EXCEEDED: st.SLOW,
    grpc.StatusCode.UNAVAILABLE: st.DOWN,
}


def _cancelled(e: BaseException) -> bool:
    """Our own cancellation is no failure of the peer."""
    return isinstance(e, grpc.RpcError) and hasattr(e, "code") and e.code() == grpc.StatusCode.CANCELLED


class PeerClient:
    """Fetches from one peer; never raises for anything the peer does."""

    def __init__(self, node: int, address: str, secret: bytes, self_node: int, *, fetch_timeout: float = 10.0,
                 connect_timeout: float = 5.0, backoff_max: float = 30.0, max_batch: int = 256,
                 fingerprint: Callable[[], str | None] = lambda: None, tls: TlsFiles | None = None) -> None:
        self.node = node
        self.address = address
        self.self_node = self_node
        self.fetch_timeout = fetch_timeout
        self.connect_timeout = connect_timeout
        self.max_batch = max_batch
        self.stats = st.PeerStats(node, address)
        self._fingerprint = fingerprint
        self._key = auth.derive_key(secret)
        self._channel = open_channel(address, tls, channel_options(connect_timeout, backoff_max))
        self._stub = peer_pb2_grpc.PeerStub(self._channel)
        self.breaker = pybreaker.CircuitBreaker(
            fail_max=BREAKER_FAILS, reset_timeout=backoff_max, name=f"peer-{node}", throw_new_error_on_trip=False,
            exclude=[GeneratorExit, _cancelled])
        self.closed = False

    def hello(self) -> str:
        """Probe the peer (bounded by the connect timeout); returns and records its state."""
        fp = self._fingerprint()
        req = peer_pb2.HelloRequest(fingerprint=fp or "", node=self.self_node)
        try:
            r = self._stub.Hello(req, timeout=self.connect_timeout, metadata=self._sign("Hello", req))
        except grpc.RpcError as e:
            self._failed(e)
            return self.stats.state
        if fp is None or not r.same_plan:
            self.stats.set_state(st.PLAN_DIFFERS, "no plan yet" if not r.fingerprint or fp is None
                                 else "its plan fingerprint differs from ours")
        else:
            self.stats.set_state(st.UP)
        return self.stats.state

    def sizes(self, digest: bytes, wait_s: float) -> tuple[int, bytes] | None:
        """The peer's slice of the listing *digest* (:mod:`fsd.cluster.listing`), waiting up to *wait_s*
        for it (and the connect timeout); None when it has none by then. Not a fetch: the peer's state
        and breaker are left as they are."""
        req = peer_pb2.SizesRequest(listing=digest, node=self.self_node)
        try:
            r = self._stub.Sizes(req, timeout=wait_s + self.connect_timeout, metadata=self._sign("Sizes", req))
        except grpc.RpcError as e:
            log.info("cluster: node %d sent no listing slice: %s", self.node, e.code() if hasattr(e, "code") else e)
            return None
        return r.first, r.sizes

    def fetch(self, ids: Iterable[int], down: frozenset[int] = frozenset()) -> Iterator[tuple[int, bytes | None]]:
        """Every id of *ids* exactly once, in arrival order, as ``(id, bytes)`` or ``(id, None)``.

        None means: read it from the PFS (the peer lacks it, refused, is down, slow or
        backing off). Batches of ``max_batch`` ids, each bounded by ``fetch_timeout``. *down*: the
        nodes this node takes as down (the peer serves the files it owns without them).
        """
        _not_on_trio()
        want = list(dict.fromkeys(int(i) for i in ids))
        for a in range(0, len(want), self.max_batch):
            yield from self._batch(want[a:a + self.max_batch], down)

    def _batch(self, ids: list[int], down: frozenset[int]) -> Iterator[tuple[int, bytes | None]]:
        pending = dict.fromkeys(ids)
        fp = self._fingerprint()
        if fp is None:
            self.stats.set_state(st.PLAN_DIFFERS, "no plan yet")
        else:
            yield from self._call(ids, pending, fp, down)
        if pending:
            self.stats.add(fallbacks=len(pending))
            for i in pending:
                yield i, None

    def _call(self, ids: list[int], pending: dict[int, None], fp: str,
              down: frozenset[int]) -> Iterator[tuple[int, bytes | None]]:
        t0 = time.monotonic()
        first: float | None = None
        call = None
        try:
            with self.breaker.calling():
                req = peer_pb2.FetchRequest(fingerprint=fp, node=self.self_node, ids=ids, down=sorted(down))
                call = self._stub.Fetch(req, timeout=self.fetch_timeout, metadata=self._sign("Fetch", req))
                for batch in call:
                    for msg in batch.samples:
                        if msg.id not in pending:  # a peer cannot make us yield what we did not ask for
                            continue
                        del pending[msg.id]
                        if first is None:
                            first = time.monotonic() - t0
                        if msg.missing:
                            self.stats.add(missing=1)
                            yield msg.id, None
                        elif checksum(msg.data) != msg.xxh3:  # corrupt on the way or in the owner's memory
                            self.stats.add(bad_samples=1)
                            log.warning("cluster: file %d from node %d fails its checksum; reading the PFS",
                                        msg.id, self.node)
                            yield msg.id, None
                        else:
                            data = msg.data
                            self.stats.fetched(len(data))
                            yield msg.id, data
            self.stats.set_state(st.UP)
        except grpc.RpcError as e:
            self._failed(e)
        except pybreaker.CircuitBreakerError:  # open: fall back at once, keep the state that opened it
            self.stats.add(skipped_batches=1)
            if self.stats.state == st.UP:
                self.stats.set_state(st.BACKOFF)
        except GeneratorExit:
            if call is not None:
                call.cancel()
            raise
        finally:
            self.stats.batch_done(time.monotonic() - t0, first)

    def _sign(self, method: str, req: Any) -> tuple[tuple[str, str], ...]:
        return auth.sign(self._key, method, req.SerializeToString(deterministic=True))

    def _failed(self, e: grpc.RpcError) -> None:
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        if self.closed and code == grpc.StatusCode.CANCELLED:
            return  # our own close() ended the call: not the peer's state
        state = _FAILURE_STATES.get(code, st.ERROR)
        detail = f"{code.name}: {e.details() if hasattr(e, 'details') else e}"
        if state in (st.REFUSED, st.PLAN_DIFFERS):
            self.stats.add(refusals=1)
        elif state == st.SLOW:
            self.stats.add(timeouts=1)
        else:
            self.stats.add(errors=1)
        if self.stats.state != state:
            log.warning("cluster: peer %d (%s) is %s: %s", self.node, self.address, state, detail)
        self.stats.set_state(state, detail)

    def close(self) -> None:
        """Close the channel (running calls are cancelled, and not counted against the peer)."""
        self.closed = True
        self._channel.close()


class Peers:
    """Clients of every other node, and a small pool that fetches from several owners at once."""

    def __init__(self, cfg: ClusterConfig, fingerprint: str | None = None, threads: int | None = None) -> None:
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.clients = {k: PeerClient(k, a, cfg.secret, cfg.index, fetch_timeout=cfg.fetch_timeout,
                                      connect_timeout=cfg.connect_timeout, backoff_max=cfg.backoff_max,
                                      max_batch=cfg.max_batch, fingerprint=lambda: self.fingerprint, tls=cfg.tls)
                        for k, a in cfg.peers.items()}
        self._pool = futures.ThreadPoolExecutor(threads or max(2, min(16, 2 * len(self.clients))),
                                                thread_name_prefix="fsd-peer-fetch", initializer=name_os_thread)

    def set_fingerprint(self, fingerprint: str | None) -> None:
        """The plan changed: fetch only from peers that have the same one."""
        self.fingerprint = fingerprint

    def stats(self) -> list[st.PeerStats]:
        """The per-peer counters (shared with the server, which counts what it serves to each)."""
        return [c.stats for c in self.clients.values()]

    def fetch(self, node: int, ids: Iterable[int]) -> Iterator[tuple[int, bytes | None]]:
        """See :meth:`PeerClient.fetch`. Blocking; call from a worker thread."""
        return self.clients[node].fetch(ids)

    def fetch_many(self, ids: Sequence[int], owner: np.ndarray) -> Iterator[tuple[int, bytes | None]]:
        """Fetch *ids* from their owners (``owner[id]``), one stream per owner at once.

        Yields every id exactly once in arrival order; ids this node owns (or whose owner
        is unknown) come back as None at once. Abandoning the iterator cancels the calls.
        """
        _not_on_trio()
        groups: dict[int, list[int]] = {}
        for i in dict.fromkeys(int(x) for x in ids):
            groups.setdefault(int(owner[i]), []).append(i)
        for k in [k for k in groups if k not in self.clients]:
            for i in groups.pop(k):
                yield i, None
        if not groups:
            return
        q: queue.Queue[tuple[int, bytes | None] | None] = queue.Queue()
        stop = threading.Event()

        def run(node: int, part: list[int]) -> None:
            it = self.clients[node].fetch(part)
            try:
                for item in it:
                    if stop.is_set():
                        break
                    q.put(item)
            finally:
                it.close()
                q.put(None)

        futs = [self._pool.submit(run, k, part) for k, part in groups.items()]
        try:
            done = 0
            while done < len(futs):
                item = q.get()
                if item is None:
                    done += 1
                else:
                    yield item
        finally:
            stop.set()
            for f in futs:
                f.result()

    def probe(self) -> dict[int, str]:
        """Hello every peer now (bounded by the connect timeout); their states."""
        return dict(zip(self.clients, self._pool.map(lambda c: c.hello(), self.clients.values())))

    def status(self) -> dict[str, Any]:
        """For ``.fsd/status``: each peer's state and counters, and the totals."""
        peers = [{**c.stats.snapshot(), "breaker": c.breaker.current_state} for c in self.clients.values()]
        tot = {k: sum(p[k] for p in peers) for k in ("fetched_samples", "fetched_bytes", "served_samples",
                                                     "served_bytes", "batches", "fallbacks", "errors",
                                                     "timeouts", "refusals")}
        return {"node": self.cfg.index, "fingerprint": self.fingerprint, "peers": peers, "totals": tot}

    def close(self) -> None:
        """Close every channel and the pool."""
        for c in self.clients.values():
            c.close()
        self._pool.shutdown(wait=True)


class ClusterNode:
    """This node's side of the cluster: the listener and the clients, sharing per-peer counters.

    The dataset cache holds one; ``start()`` binds (FsdError when it cannot), ``set_plan``
    follows plan changes, ``fetch_many`` runs on worker threads, ``status()`` goes into
    ``.fsd/status``, ``close()`` ends both sides.
    """

    def __init__(self, cfg: ClusterConfig, serve: ServeFn, *, n_files: int = 0, fingerprint: str | None = None,
                 serve_threads: int = 8, ready: ReadyFn | None = None, sizes_of: SizesOfFn | None = None) -> None:
        self.cfg = cfg
        self.peers = Peers(cfg, fingerprint)
        self.server = PeerServer(cfg.listen, cfg.secret, cfg.index, n_files, serve, fingerprint=fingerprint,
                                 peers=self.peers.stats(), max_batch=max(cfg.max_batch, 4096),
                                 threads=serve_threads, tls=cfg.tls, ready=ready, sizes_of=sizes_of)

    def start(self) -> int:
        """Start serving peers; returns the bound port."""
        return self.server.start()

    def set_plan(self, fingerprint: str | None, n_files: int) -> None:
        """Share only with peers whose plan fingerprint is *fingerprint* (None: share nothing)."""
        self.server.set_plan(fingerprint, n_files)
        self.peers.set_fingerprint(fingerprint)

    def fetch_many(self, ids: Sequence[int], owner: np.ndarray) -> Iterator[tuple[int, bytes | None]]:
        """See :meth:`Peers.fetch_many`."""
        return self.peers.fetch_many(ids, owner)

    def status(self) -> dict[str, Any]:
        """``{"node", "fingerprint", "peers": [...], "totals", "server"}``."""
        return {**self.peers.status(), "server": self.server.status()}

    def close(self) -> None:
        """Stop serving and close the clients."""
        try:
            self.server.stop()
        finally:
            self.peers.close()


__all__ = ["ClusterNode", "PeerClient", "PeerServer", "Peers", "ServeFn", "bind", "channel_options", "checksum",
           "open_channel"]
