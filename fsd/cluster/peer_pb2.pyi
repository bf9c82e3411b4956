from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

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
