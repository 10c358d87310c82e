"""Request bodies of the embedded ClickHouse front: decoded per Content-Encoding, inflated a step at a time under a cap.

Request bodies may be compressed with lz4/zstd/gzip/deflate. A body is inflated in steps and refused
(413, code 307) as soon as it passes the cap (``Limits.max_decompressed_bytes``): a small bomb never inflates
further than the limit.
"""

from __future__ import annotations

import io
import zlib
from typing import Any

from devservices.chserver.limits import Limits, RequestError, _too_large

_CHUNK = 1 << 20
#: a request body: as read (bytes) or as inflated (bytearray)
Body = bytes | bytearray


class _Inflate:
    """zlib/deflate as a reader that inflates at most ``n`` bytes per read, across concatenated members
    (as gzip allows); a stream that ends inside a member is an error, not silently shorter data."""

    def __init__(self, data: bytes):
        self.d, self.rest = zlib.decompressobj(zlib.MAX_WBITS | 32), data  # zlib or gzip header
        self.done = not data

    def read(self, n: int) -> bytes:
        for _ in range(len(self.rest) + 2):  # each turn consumes input or ends: bounded by the data
            if self.done:
                return b""
            if self.d.eof:  # the rest of the input is in unused_data (unconsumed_tail repeats it)
                self.rest = self.d.unused_data
                if not self.rest:
                    self.done = True
                    return b""
                self.d = zlib.decompressobj(zlib.MAX_WBITS | 32)  # the next member
            before = len(self.rest)
            try:
                out = self.d.decompress(self.rest, n)
            except zlib.error as e:
                raise RequestError(
                    400, 354, "CANNOT_DECOMPRESS", f"the compressed request body is malformed: {e}"
                ) from None
            self.rest = self.d.unconsumed_tail
            if out:
                return out
            if not self.d.eof and len(self.rest) == before:
                raise RequestError(400, 354, "CANNOT_DECOMPRESS", "the compressed request body ends early")
        raise RequestError(400, 354, "CANNOT_DECOMPRESS", "the compressed request body is malformed")


def decompress(data: bytes, encoding: str, limit: int = Limits.max_decompressed_bytes) -> Body:
    """``data`` decoded per Content-Encoding, inflated a MiB at a time and refused (413, code 307) as
    soon as it passes ``limit`` bytes: a small bomb never inflates further than the limit.
    The inflated bytes come back as they were built (no second copy of them)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return data
    reader: Any
    if encoding == "lz4":
        import lz4.frame

        reader = lz4.frame.LZ4FrameFile(io.BytesIO(data), "rb")
    elif encoding == "zstd":
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True)
    elif encoding in ("gzip", "deflate"):
        reader = _Inflate(data)  # every member, each inflated a step at a time
    else:
        raise ValueError(f"unsupported Content-Encoding {encoding!r} (lz4, zstd, gzip or deflate)")
    out = bytearray()
    for _ in range(limit // _CHUNK + 2):  # each read adds up to a MiB; one more than the limit is refused
        piece = reader.read(min(_CHUNK, limit + 1 - len(out)))
        if not piece:
            return out
        out += piece
        if len(out) > limit:
            break
    raise _too_large("the decompressed request body", limit)
