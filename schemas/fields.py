"""Field building blocks shared by every record.

A field is ``Annotated[<python type>, doc("..."), <constraints>, <storage kind>]``. ``doc`` is the
field's docstring (msgspec keeps it as the JSON-schema description); the storage kind tells the
Arrow and ClickHouse derivations in :mod:`schemas.types` which physical type to use where the
Python type alone is ambiguous (int32 vs int64, timestamps, low-cardinality strings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta


def doc(text: str) -> Meta:
    """The docstring of a field."""
    return Meta(description=text)


@dataclass(frozen=True)
class Kind:
    """Physical storage of a field in Arrow and ClickHouse (see schemas.types)."""

    name: str


# Python types with their storage kind and range checks.
Int32 = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1), Kind("int32")]
UInt8 = Annotated[int, Meta(ge=0, le=255), Kind("uint8")]
UInt32 = Annotated[int, Meta(ge=0, le=2**32 - 1), Kind("uint32")]
UInt64 = Annotated[int, Meta(ge=0, le=2**63 - 1), Kind("uint64")]
Float32 = Annotated[float, Kind("float32")]
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
# Versions and counters that must fit ClickHouse Int64.
Version = Annotated[int, Meta(ge=0, le=2**63 - 1)]
# Milliseconds since the Unix epoch (UTC); DateTime64(3, 'UTC') in ClickHouse, which ends in 2299.
Millis = Annotated[int, Meta(ge=0, le=10413791999999), Kind("millis")]
# Short identifiers repeated across many rows (org, arm, tool, version names).
Label = Annotated[str, Meta(min_length=1, max_length=128), Kind("lowcard")]
# Opaque ids (trajectory, event, edit); bounded so hostile input cannot bloat state.
Id = Annotated[str, Meta(min_length=1, max_length=128)]
# Salted hash of a user id: 32 lower-case hex characters, never a raw id.
UserHash = Annotated[str, Meta(pattern=r"^[0-9a-f]{32}$")]
