"""gRPC transport of checkpoint replicas: the ``Replica`` service of ``peer.proto``.

A checkpoint daemon that keeps copies for other nodes runs a :class:`ReplicaServer` over a
:class:`ReplicaHandler` (the store, :mod:`fsd.ckpt.replica_store`); a daemon whose files are copied
holds one :class:`ReplicaClient` per buddy. The same cluster file, secret, request signatures
(:mod:`fsd.cluster.auth`), TLS credentials and channel settings as the dataset peers
(:mod:`fsd.cluster.transport`): no second transport. A ``Put`` is signed over its header with the data
cleared and carries the XXH3-64 of its data, which the server checks (hashing a 1 GiB checkpoint with
SHA-256 for its signature would cost seconds of CPU; XXH3 costs a tenth of that). A server serves only
the source nodes it is a buddy of; handler errors become gRPC status codes, never a crash.

Client calls block (worker threads, never the trio loop) and raise :class:`ReplicaError` for anything
the buddy does or does not do: the caller counts the buddy as behind and sends again later.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, Protocol

import grpc
import pybreaker

from . import auth, peer_pb2, peer_pb2_grpc
from . import stats as st
from .compat import FsdError, name_os_thread
from .config import ClusterConfig
from .transport import BREAKER_FAILS, bind, channel_options, checksum, open_channel

log = logging.getLogger(__name__)

SERVICE = "fsd.cluster.v1.Replica"
MAX_PUT = 64 << 20
"""Largest Put the server accepts (a flush job is at most one stripe)."""
READ_PIECE = 4 << 20
"""Bytes per message of a Read stream."""


class ReplicaError(FsdError):
    """A replica call that did not succeed (the buddy is down, slow, refused it or failed)."""


class ReplicaHandler(Protocol):
    """What a buddy does with the calls (thread-safe: grpc serves calls on several threads)."""

    incarnation: str

    def put(self, src: int, nid: int, offset: int, data: bytes) -> None: ...
    def truncate(self, src: int, nid: int, size: int, reset: bool, epoch: int) -> None: ...
    def commit(self, src: int, nid: int, manifest: bytes, incarnation: str, calls: int, epoch: int) -> bool: ...
    def drop(self, src: int, nid: int, data_seq: int) -> None: ...
    def listing(self, src: int) -> list[bytes]: ...
    def read(self, src: int, nid: int, offset: int, length: int) -> Iterator[tuple[int, bytes]]: ...


def _put_body(req: peer_pb2.ReplicaPut) -> bytes:
    """What a Put's signature covers: the request with its data cleared (the xxh3 stands for it)."""
    head = peer_pb2.ReplicaPut()
    head.CopyFrom(req)
    head.data = b""
    return head.SerializeToString(deterministic=True)


def _body(method: str, req: Any) -> bytes:
    return _put_body(req) if method == "Put" else req.SerializeToString(deterministic=True)


def _no_room(e: BaseException) -> bool:
    return isinstance(e, grpc.RpcError) and hasattr(e, "code") and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


class _Servicer(peer_pb2_grpc.ReplicaServicer):
    def __init__(self, server: ReplicaServer) -> None:
        self.s = server

    def _enter(self, context: grpc.ServicerContext, method: str, req: Any) -> None:
        """Abort unless the call is signed, new, and from a node this one keeps copies for."""
        s = self.s
        why = s.verifier.check(dict(context.invocation_metadata()), method, _body(method, req))
        code = grpc.StatusCode.UNAUTHENTICATED  # every reason the verifier gives: unsigned, forged, stale, replayed
        if why is None and req.src not in s.sources:
            why, code = f"node {req.src} does not replicate to this node", grpc.StatusCode.PERMISSION_DENIED
        if why is not None:
            with s.lock:
                s.refused += 1
                n = s.refused
            if st.log_worthy(n):
                log.warning("replicas: refused a %s from %s: %s (%d so far)", method, context.peer(), why, n)
            context.abort(code, why)

    def _run(self, context: grpc.ServicerContext, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except OSError as e:
            if e.errno == errno.ENOSPC:  # the room kept for copies, or the devices themselves, are full
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no room: {e.strerror or e}")
            log.error("replicas: %s", e)
            context.abort(grpc.StatusCode.INTERNAL, f"{e.strerror or e}")

    def _ack(self, stale: bool = False) -> peer_pb2.ReplicaAck:
        return peer_pb2.ReplicaAck(incarnation=self.s.handler.incarnation, stale=stale)

    def Put(self, req: peer_pb2.ReplicaPut, context: grpc.ServicerContext) -> peer_pb2.ReplicaAck:
        self._enter(context, "Put", req)
        if checksum(req.data) != req.xxh3:
            context.abort(grpc.StatusCode.DATA_LOSS, "data fails its checksum")
        self._run(context, lambda: self.s.handler.put(req.src, req.id, req.offset, req.data))
        with self.s.lock:
            self.s.put_bytes += len(req.data)
        return self._ack()

    def Truncate(self, req: peer_pb2.ReplicaTruncate, context: grpc.ServicerContext) -> peer_pb2.ReplicaAck:
        self._enter(context, "Truncate", req)
        self._run(context, lambda: self.s.handler.truncate(req.src, req.id, req.size, req.reset, req.epoch))
        return self._ack()

    def Commit(self, req: peer_pb2.ReplicaCommit, context: grpc.ServicerContext) -> peer_pb2.ReplicaAck:
        self._enter(context, "Commit", req)
        ok = self._run(context, lambda: self.s.handler.commit(req.src, req.id, req.manifest, req.incarnation,
                                                             req.calls, req.epoch))
        return self._ack(stale=not ok)

    def Drop(self, req: peer_pb2.ReplicaDrop, context: grpc.ServicerContext) -> peer_pb2.ReplicaAck:
        self._enter(context, "Drop", req)
        self._run(context, lambda: self.s.handler.drop(req.src, req.id, req.data_seq))
        return self._ack()

    def List(self, req: peer_pb2.ReplicaListRequest, context: grpc.ServicerContext) -> peer_pb2.ReplicaListing:
        self._enter(context, "List", req)
        found = self._run(context, lambda: self.s.handler.listing(req.src))
        return peer_pb2.ReplicaListing(manifests=found, incarnation=self.s.handler.incarnation)

    def Read(self, req: peer_pb2.ReplicaRead, context: grpc.ServicerContext) -> Iterator[peer_pb2.ReplicaPiece]:
        self._enter(context, "Read", req)
        pieces = self._run(context, lambda: self.s.handler.read(req.src, req.id, req.offset, req.length))
        try:
            for off, data in pieces:
                if not context.is_active():
                    return
                yield peer_pb2.ReplicaPiece(offset=off, data=data, xxh3=checksum(data))
        except (OSError, ValueError) as e:
            context.abort(grpc.StatusCode.INTERNAL, str(e))


class ReplicaServer:
    """The listener of a checkpoint daemon that keeps copies for the nodes *sources*."""

    def __init__(self, listen: str, secret: bytes, handler: ReplicaHandler, sources: set[int], *,
                 tls: Any = None, threads: int = 8) -> None:
        self.listen = listen
        self.handler = handler
        self.sources = frozenset(sources)
        self.tls = tls
        self.verifier = auth.Verifier(auth.derive_key(secret))
        self.lock = threading.Lock()
        self.refused = 0
        self.put_bytes = 0
        self.port: int | None = None
        self._pool = futures.ThreadPoolExecutor(threads, thread_name_prefix="fsd-replica-serve",
                                                initializer=name_os_thread)
        self._server = grpc.server(self._pool, maximum_concurrent_rpcs=4 * threads, options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_send_message_length", READ_PIECE + (1 << 20)),
            ("grpc.max_receive_message_length", MAX_PUT + (1 << 20)),
        ])
        peer_pb2_grpc.add_ReplicaServicer_to_server(_Servicer(self), self._server)

    def start(self) -> int:
        """Bind and serve; the port."""
        try:
            self.port = bind(self._server, self.listen, self.tls)
        except FsdError:
            self._pool.shutdown(wait=False)
            raise
        self._server.start()
        log.info("replicas: keeping copies for node(s) %s on %s", sorted(self.sources), self.listen)
        return self.port

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving (running calls get *grace* seconds)."""
        self._server.stop(grace).wait()
        self._pool.shutdown(wait=True)

    def status(self) -> dict[str, Any]:
        """For ``.fsd/status``."""
        with self.lock:
            return {"listen": self.listen, "sources": sorted(self.sources), "received_bytes": self.put_bytes,
                    "refused": self.refused}


class ReplicaClient:
    """Calls to one buddy's :class:`ReplicaServer`. Blocking; every failure is a :class:`ReplicaError`."""

    def __init__(self, node: int, address: str, cfg: ClusterConfig) -> None:
        self.node = node
        self.address = address
        self.src = cfg.index
        self.timeout = cfg.replica_timeout
        self._key = auth.derive_key(cfg.secret)
        opts = channel_options(cfg.connect_timeout, cfg.backoff_max, SERVICE)
        opts = [o for o in opts if o[0] != "grpc.max_receive_message_length"]
        opts += [("grpc.max_send_message_length", MAX_PUT + (1 << 20)),
                 ("grpc.max_receive_message_length", READ_PIECE + (1 << 20))]
        self._channel = open_channel(address, cfg.tls, opts)
        self._stub = peer_pb2_grpc.ReplicaStub(self._channel)
        # a buddy without room is up (it answers at once, and the drops that make room must get through)
        self.breaker = pybreaker.CircuitBreaker(fail_max=BREAKER_FAILS, reset_timeout=cfg.backoff_max,
                                                name=f"replica-{node}", throw_new_error_on_trip=False,
                                                exclude=[_no_room])
        self.last_error = ""
        self.last_ok = 0.0
        self._opened_at = 0.0  # when a failure last found the breaker open

    def _call(self, method: str, req: Any, timeout: float | None = None) -> Any:
        try:
            with self.breaker.calling():
                r = getattr(self._stub, method)(req, timeout=timeout or self.timeout,
                                                metadata=auth.sign(self._key, method, _body(method, req)))
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
            self.last_error = f"{code.name}: {e.details() if hasattr(e, 'details') else e}"
            if self.breaker.current_state == pybreaker.STATE_OPEN:
                self._opened_at = time.monotonic()
            raise ReplicaError(f"node {self.node} ({self.address}): {method}: {self.last_error}") from None
        except pybreaker.CircuitBreakerError:
            raise ReplicaError(f"node {self.node} ({self.address}): backing off after failures "
                               f"({self.last_error})") from None
        self.last_ok = time.time()
        return r

    @property
    def down(self) -> bool:
        """The breaker opened less than its reset timeout ago: calls would fail at once (after that, the
        next call is its trial)."""
        return (self.breaker.current_state == pybreaker.STATE_OPEN
                and time.monotonic() - self._opened_at < self.breaker.reset_timeout)

    def put(self, nid: int, offset: int, data: bytes | memoryview) -> str:
        """Send bytes of file *nid* at *offset*; the buddy's incarnation."""
        data = bytes(data)
        req = peer_pb2.ReplicaPut(src=self.src, id=nid, offset=offset, data=data, xxh3=checksum(data))
        return self._call("Put", req).incarnation

    def truncate(self, nid: int, size: int, reset: bool = False, epoch: int = 0) -> str:
        """File *nid* is now *size* bytes long (*reset*: empty, its call count restarted, named *epoch*);
        the buddy's incarnation."""
        req = peer_pb2.ReplicaTruncate(src=self.src, id=nid, size=size, reset=reset, epoch=epoch)
        return self._call("Truncate", req).incarnation

    def commit(self, nid: int, manifest: bytes, incarnation: str, calls: int, epoch: int = 0) -> bool:
        """Make the copy of *nid* durable under *manifest* if the buddy applied exactly *calls* Puts and
        Truncates since the last commit or the reset named *epoch*, in *incarnation*; False: it did not,
        send the file again."""
        req = peer_pb2.ReplicaCommit(src=self.src, id=nid, manifest=manifest, incarnation=incarnation, calls=calls,
                                     epoch=epoch)
        return not self._call("Commit", req).stale

    def drop(self, nid: int, data_seq: int = 0) -> None:
        """Forget the copy of *nid* (only one of content *data_seq* or older, unless 0)."""
        self._call("Drop", peer_pb2.ReplicaDrop(src=self.src, id=nid, data_seq=data_seq))

    def listing(self, src: int | None = None) -> tuple[list[bytes], str]:
        """The sealed manifests of every committed copy of *src* (default: this node), and the incarnation."""
        r = self._call("List", peer_pb2.ReplicaListRequest(src=self.src if src is None else src))
        return list(r.manifests), r.incarnation

    def read(self, nid: int, offset: int, length: int, src: int | None = None) -> Iterator[tuple[int, bytes]]:
        """The committed copy's bytes [offset, offset+length) as ``(offset, bytes)`` pieces, each checked."""
        req = peer_pb2.ReplicaRead(src=self.src if src is None else src, id=nid, offset=offset, length=length)
        try:
            for piece in self._call("Read", req, timeout=max(self.timeout, length / (50 << 20))):
                if checksum(piece.data) != piece.xxh3:
                    raise ReplicaError(f"node {self.node}: a piece of file {nid} fails its checksum")
                yield piece.offset, piece.data
        except grpc.RpcError as e:
            raise ReplicaError(f"node {self.node} ({self.address}): Read: {e.details()}") from None

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()


__all__ = ["ReplicaClient", "ReplicaError", "ReplicaHandler", "ReplicaServer"]
