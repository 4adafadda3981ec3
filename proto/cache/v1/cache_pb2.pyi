from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("keys", "record_keys")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    RECORD_KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    record_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., record_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_count", "records_found")
    HIT_COUNT_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FOUND_FIELD_NUMBER: _ClassVar[int]
    hit_count: int
    records_found: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, hit_count: _Optional[int] = ..., records_found: _Optional[_Iterable[bool]] = ...) -> None: ...

class PutSlice(_message.Message):
    __slots__ = ("key", "total_bytes", "offset", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    total_bytes: int
    offset: int
    data: bytes
    def __init__(self, key: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("slices", "commit")
    SLICES_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    slices: _containers.RepeatedCompositeFieldContainer[PutSlice]
    commit: bool
    def __init__(self, slices: _Optional[_Iterable[_Union[PutSlice, _Mapping]]] = ..., commit: _Optional[bool] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, committed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetSlice(_message.Message):
    __slots__ = ("index", "total_bytes", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    total_bytes: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("slices",)
    SLICES_FIELD_NUMBER: _ClassVar[int]
    slices: _containers.RepeatedCompositeFieldContainer[GetSlice]
    def __init__(self, slices: _Optional[_Iterable[_Union[GetSlice, _Mapping]]] = ...) -> None: ...

class PutRecordRequest(_message.Message):
    __slots__ = ("keys", "total_bytes", "ttl_s", "lease_s", "data")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    total_bytes: int
    ttl_s: float
    lease_s: float
    data: bytes
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., total_bytes: _Optional[int] = ..., ttl_s: _Optional[float] = ..., lease_s: _Optional[float] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutRecordResponse(_message.Message):
    __slots__ = ("expires_in_s",)
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    expires_in_s: float
    def __init__(self, expires_in_s: _Optional[float] = ...) -> None: ...

class GetRecordRequest(_message.Message):
    __slots__ = ("key", "consume")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CONSUME_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    consume: bool
    def __init__(self, key: _Optional[bytes] = ..., consume: _Optional[bool] = ...) -> None: ...

class GetRecordResponse(_message.Message):
    __slots__ = ("total_bytes", "data")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    data: bytes
    def __init__(self, total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class DeleteRecordsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteRecordsResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("entries", "bytes", "capacity_bytes", "hits", "misses", "evictions")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    entries: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    def __init__(self, entries: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("dram", "ssd", "records", "segments", "dead_bytes", "staged_bytes", "refusals", "corrupt_blocks", "record_expiries", "compactions", "aborted_puts", "retention_hours", "record_deletions", "record_put_bytes")
    DRAM_FIELD_NUMBER: _ClassVar[int]
    SSD_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    DEAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RECORD_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    COMPACTIONS_FIELD_NUMBER: _ClassVar[int]
    ABORTED_PUTS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_HOURS_FIELD_NUMBER: _ClassVar[int]
    RECORD_DELETIONS_FIELD_NUMBER: _ClassVar[int]
    RECORD_PUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    dram: TierStats
    ssd: TierStats
    records: TierStats
    segments: int
    dead_bytes: int
    staged_bytes: int
    refusals: int
    corrupt_blocks: int
    record_expiries: int
    compactions: int
    aborted_puts: int
    retention_hours: float
    record_deletions: int
    record_put_bytes: int
    def __init__(self, dram: _Optional[_Union[TierStats, _Mapping]] = ..., ssd: _Optional[_Union[TierStats, _Mapping]] = ..., records: _Optional[_Union[TierStats, _Mapping]] = ..., segments: _Optional[int] = ..., dead_bytes: _Optional[int] = ..., staged_bytes: _Optional[int] = ..., refusals: _Optional[int] = ..., corrupt_blocks: _Optional[int] = ..., record_expiries: _Optional[int] = ..., compactions: _Optional[int] = ..., aborted_puts: _Optional[int] = ..., retention_hours: _Optional[float] = ..., record_deletions: _Optional[int] = ..., record_put_bytes: _Optional[int] = ...) -> None: ...
