"""A parquet file's row count and top-level column names, read from its footer without pyarrow.

The login node checks VeRL's data files before it submits (`offline.py`) and counts their rows for the dry
run's cost (`describe.py`) with pdmctl's core install, which has no pyarrow (VeRL's environment brings it).
The footer is parquet-format's `FileMetaData` in Thrift's compact protocol: its field 2 (the schema, a
depth-first list of `SchemaElement`s whose first is the root) and field 3 (`num_rows`) are read, every other
field is skipped by its type. Every length is checked against the bytes there are, so a hostile footer is a
ParquetError, never a large allocation or a deep recursion.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"PAR1"
MAX_FOOTER = 256 * 1024 * 1024  # a footer this long is no data set's: refused before it is read
_MAX_DEPTH = 64  # nested structs skipped; parquet-format's own nest a few deep

# Thrift compact protocol types
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT, _UUID = range(1, 14)


class ParquetError(ValueError):
    """Not a parquet file, or a footer that cannot be read; the message is one line."""


@dataclass(frozen=True)
class Footer:
    num_rows: int
    names: tuple[str, ...]  # the top-level columns, in the file's order (pyarrow's `schema_arrow.names`)


def read_footer(path: str | os.PathLike[str]) -> Footer:
    """The row count and column names of the parquet file at `path`. ParquetError, OSError."""
    with Path(path).open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 12:
            raise ParquetError(f"{size} bytes, too short for a parquet file")
        head = fh.read(4)
        fh.seek(size - 8)
        tail = fh.read(8)
        if tail[4:] == b"PARE":
            raise ParquetError("its footer is encrypted")
        if head != MAGIC or tail[4:] != MAGIC:
            raise ParquetError("no PAR1 magic at its start and end")
        length = int.from_bytes(tail[:4], "little")
        if not 0 < length <= min(size - 12, MAX_FOOTER):
            raise ParquetError(f"a footer of {length} bytes in a file of {size}")
        fh.seek(size - 8 - length)
        data = fh.read(length)
    return _file_metadata(_Reader(data))


def _file_metadata(reader: _Reader) -> Footer:
    num_rows: int | None = None
    schema: list[tuple[str, int]] = []
    for field, kind in reader.fields():
        if field == 2 and kind == _LIST:
            element, count = reader.list_header()
            if count and element != _STRUCT:
                raise ParquetError("its schema is not a list of elements")
            schema.extend(_schema_element(reader) for _ in range(count))
        elif field == 3 and kind == _I64:
            num_rows = reader.zigzag()
        else:
            reader.skip(kind)
    if num_rows is None or num_rows < 0 or not schema:
        raise ParquetError("its footer has no row count or no schema")
    return Footer(num_rows, _top_level(schema))


def _schema_element(reader: _Reader) -> tuple[str, int]:
    name, children = "", 0
    for field, kind in reader.fields():
        if field == 4 and kind == _BINARY:
            name = reader.binary().decode("utf-8", "replace")
        elif field == 5 and kind == _I32:
            children = reader.zigzag()
        else:
            reader.skip(kind)
    if children < 0:
        raise ParquetError(f"schema element {name[:40]!r} has {children} children")
    return name, children


def _top_level(schema: list[tuple[str, int]]) -> tuple[str, ...]:
    """The root's children: each is followed by its own subtree (depth first), which is passed over."""
    names, i = [], 1
    for _ in range(schema[0][1]):
        if i >= len(schema):
            raise ParquetError("its schema ends before the root's columns do")
        names.append(schema[i][0])
        pending = 1  # the nodes of this column's subtree not yet passed
        while pending:
            if i >= len(schema):
                raise ParquetError("its schema ends inside a column")
            pending += schema[i][1] - 1
            i += 1
    return tuple(names)


class _Reader:
    """Thrift's compact protocol over a footer's bytes."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ParquetError("its footer ends early")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def varint(self) -> int:
        result = shift = 0
        while True:
            byte = self.take(1)[0]
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise ParquetError("its footer holds an integer of more than 64 bits")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def binary(self) -> bytes:
        return self.take(self.varint())

    def fields(self):
        """(field id, type) of each field of a struct, up to its stop byte; the caller reads or skips each."""
        last = 0
        while True:
            header = self.take(1)[0]
            if header == 0:
                return
            delta, kind = header >> 4, header & 0x0F
            last = last + delta if delta else self.zigzag()
            yield last, kind

    def list_header(self) -> tuple[int, int]:
        header = self.take(1)[0]
        count = header >> 4 if header >> 4 != 15 else self.varint()
        if count > len(self.data) - self.pos:  # every element takes a byte at least
            raise ParquetError(f"its footer lists {count} elements in {len(self.data) - self.pos} bytes")
        return header & 0x0F, count

    def skip(self, kind: int, depth: int = 0, element: bool = False) -> None:
        if depth > _MAX_DEPTH:
            raise ParquetError(f"its footer nests more than {_MAX_DEPTH} deep")
        if kind in (_TRUE, _FALSE):
            if element:  # a bool in a list or map is a byte; a bool field's value is its type
                self.take(1)
        elif kind == _BYTE:
            self.take(1)
        elif kind in (_I16, _I32, _I64):
            self.varint()
        elif kind == _DOUBLE:
            self.take(8)
        elif kind == _BINARY:
            self.binary()
        elif kind == _UUID:
            self.take(16)
        elif kind in (_LIST, _SET):
            element_kind, count = self.list_header()
            for _ in range(count):
                self.skip(element_kind, depth + 1, element=True)
        elif kind == _MAP:
            count = self.varint()
            if count:
                left = len(self.data) - self.pos
                if count > left:
                    raise ParquetError(f"its footer maps {count} entries in {left} bytes")
                types = self.take(1)[0]
                for _ in range(count):
                    self.skip(types >> 4, depth + 1, element=True)
                    self.skip(types & 0x0F, depth + 1, element=True)
        elif kind == _STRUCT:
            for _, field_kind in self.fields():
                self.skip(field_kind, depth + 1)
        else:
            raise ParquetError(f"its footer holds an unknown Thrift type {kind}")
