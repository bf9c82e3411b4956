from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FetchRequest(_message.Message):
    __slots__ = ("fingerprint", "node", "ids", "down")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    DOWN_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    node: int
    ids: _containers.RepeatedScalarFieldContainer[int]
    down: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, fingerprint: _Optional[str] = ..., node: _Optional[int] = ..., ids: _Optional[_Iterable[int]] = ..., down: _Optional[_Iterable[int]] = ...) -> None: ...

class SampleBatch(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("id", "missing", "data", "xxh3")
    ID_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    id: int
    missing: bool
    data: bytes
    xxh3: int
    def __init__(self, id: _Optional[int] = ..., missing: _Optional[bool] = ..., data: _Optional[bytes] = ..., xxh3: _Optional[int] = ...) -> None: ...

class SizesRequest(_message.Message):
    __slots__ = ("listing", "node")
    LISTING_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    listing: bytes
    node: int
    def __init__(self, listing: _Optional[bytes] = ..., node: _Optional[int] = ...) -> None: ...

class SizesReply(_message.Message):
    __slots__ = ("first", "sizes")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    first: int
    sizes: bytes
    def __init__(self, first: _Optional[int] = ..., sizes: _Optional[bytes] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("fingerprint", "node")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    node: int
    def __init__(self, fingerprint: _Optional[str] = ..., node: _Optional[int] = ...) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("fingerprint", "node", "same_plan")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SAME_PLAN_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    node: int
    same_plan: bool
    def __init__(self, fingerprint: _Optional[str] = ..., node: _Optional[int] = ..., same_plan: _Optional[bool] = ...) -> None: ...

class ReplicaPut(_message.Message):
    __slots__ = ("src", "id", "offset", "data", "xxh3")
    SRC_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    src: int
    id: int
    offset: int
    data: bytes
    xxh3: int
    def __init__(self, src: _Optional[int] = ..., id: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., xxh3: _Optional[int] = ...) -> None: ...

class ReplicaTruncate(_message.Message):
    __slots__ = ("src", "id", "size", "reset", "epoch")
    SRC_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    src: int
    id: int
    size: int
    reset: bool
    epoch: int
    def __init__(self, src: _Optional[int] = ..., id: _Optional[int] = ..., size: _Optional[int] = ..., reset: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class ReplicaCommit(_message.Message):
    __slots__ = ("src", "id", "manifest", "incarnation", "calls", "epoch")
    SRC_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    src: int
    id: int
    manifest: bytes
    incarnation: str
    calls: int
    epoch: int
    def __init__(self, src: _Optional[int] = ..., id: _Optional[int] = ..., manifest: _Optional[bytes] = ..., incarnation: _Optional[str] = ..., calls: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class ReplicaDrop(_message.Message):
    __slots__ = ("src", "id", "data_seq")
    SRC_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    DATA_SEQ_FIELD_NUMBER: _ClassVar[int]
    src: int
    id: int
    data_seq: int
    def __init__(self, src: _Optional[int] = ..., id: _Optional[int] = ..., data_seq: _Optional[int] = ...) -> None: ...

class ReplicaAck(_message.Message):
    __slots__ = ("incarnation", "stale")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    stale: bool
    def __init__(self, incarnation: _Optional[str] = ..., stale: _Optional[bool] = ...) -> None: ...

class ReplicaListRequest(_message.Message):
    __slots__ = ("src",)
    SRC_FIELD_NUMBER: _ClassVar[int]
    src: int
    def __init__(self, src: _Optional[int] = ...) -> None: ...

class ReplicaListing(_message.Message):
    __slots__ = ("manifests", "incarnation")
    MANIFESTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    manifests: _containers.RepeatedScalarFieldContainer[bytes]
    incarnation: str
    def __init__(self, manifests: _Optional[_Iterable[bytes]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class ReplicaRead(_message.Message):
    __slots__ = ("src", "id", "offset", "length")
    SRC_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    src: int
    id: int
    offset: int
    length: int
    def __init__(self, src: _Optional[int] = ..., id: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ReplicaPiece(_message.Message):
    __slots__ = ("offset", "data", "xxh3")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    xxh3: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., xxh3: _Optional[int] = ...) -> None: ...
