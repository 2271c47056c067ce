"""Read one shard as a stream of `Document` / `Reject` outcomes, hashing the input as it goes.

Bad data never stops a shard: every problem becomes a `Reject`. A compressed stream that ends
early or turns corrupt yields everything readable before that point, then one
`truncated_stream` reject. Only a file that cannot be opened at all raises `PrepError`.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Callable, Iterator, Optional

import zstandard

from data_prep.config import PrepError
from data_prep.inputs import Shard, text_members
from data_prep.records import Outcome, Reject, check_text, domain_of, parse_json_line

CHUNK_BYTES = 1 << 20


class ShardReader:
    """Iterate a shard's outcomes; afterwards `sha256` and `bytes_read` describe the input.

    `on_bytes(n)` is called with each block of input bytes consumed (for progress/ETA).
    """

    def __init__(self, shard: Shard, text_field: str, on_bytes: Optional[Callable[[int], None]] = None):
        self.shard = shard
        self.text_field = text_field
        self.on_bytes = on_bytes or (lambda n: None)
        self._digest = hashlib.sha256()
        self.bytes_read = 0

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()

    def _consume(self, block: bytes) -> None:
        self._digest.update(block)
        self.bytes_read += len(block)
        self.on_bytes(len(block))

    def __iter__(self) -> Iterator[Outcome]:
        fmt = self.shard.format
        if fmt in ("jsonl", "jsonl.zst", "jsonl.gz"):
            return self._json_lines()
        if fmt == "parquet":
            return self._parquet()
        if fmt == "txt":
            return self._text_files()
        raise AssertionError(f"unknown format {fmt!r}")

    # -- JSON lines, plain or compressed ---------------------------------------------------------

    def _raw_blocks(self) -> Iterator[bytes]:
        try:
            handle = open(self.shard.path, "rb")
        except OSError as err:
            raise PrepError(f"input {self.shard.path!r} cannot be opened ({err}). Fix: check it exists "
                            "and is readable.") from err
        with handle:
            while block := handle.read(CHUNK_BYTES):
                self._consume(block)
                yield block

    def _json_lines(self) -> Iterator[Outcome]:
        raw_blocks = self._raw_blocks()
        stream = _DecodedStream(raw_blocks, self.shard.format)
        partial: list[bytes] = []  # pieces of the line still being read (a line may span many blocks)
        number = 0
        for block in stream:
            start = 0
            while (end := block.find(b"\n", start)) >= 0:
                partial.append(block[start:end])
                number += 1
                yield parse_json_line(number, b"".join(partial), self.text_field)
                partial = []
                start = end + 1
            partial.append(block[start:])
        pending = b"".join(partial)
        for _ in raw_blocks:  # a corrupt stream stops decoding early; the checksum covers the whole file
            pass
        if stream.truncation is not None:
            # The partial last line cannot be trusted even if it parses: it is the truncation's
            # one reject (empty when the stream broke exactly at a line end).
            yield Reject(number + 1, "truncated_stream", stream.truncation, pending)
        elif pending:
            yield parse_json_line(number + 1, pending, self.text_field)

    # -- parquet (RedPajama) ---------------------------------------------------------------------

    def _parquet(self) -> Iterator[Outcome]:
        import pyarrow.parquet as pq

        for _ in self._raw_blocks():  # hash the file; pyarrow reads it itself
            pass
        try:
            parquet = pq.ParquetFile(self.shard.path)
        except Exception as err:  # pyarrow raises several types for a bad footer
            raise PrepError(f"input {self.shard.path!r}: not a readable parquet file ({err}). Fix: re-download "
                            "or exclude it.") from err
        names = parquet.schema_arrow.names
        columns = [name for name in names if name in (self.text_field, "meta", "red_pajama_subset", "source")]
        number = 0
        try:
            for batch in parquet.iter_batches(batch_size=1024, columns=columns or None):
                for row in batch.to_pylist():
                    number += 1
                    raw = json.dumps(row, default=str, ensure_ascii=False).encode("utf-8", "replace")
                    if self.text_field not in names:
                        yield Reject(number, "missing_text_field", f"no {self.text_field!r} column "
                                     f"(columns: {', '.join(names[:8])})", raw)
                    else:
                        yield check_text(number, row[self.text_field], raw, domain_of(row))
        except Exception as err:  # a corrupt row group: keep what was read, count the break once
            yield Reject(number + 1, "truncated_stream", f"parquet read failed: {err}", b"")

    # -- directories of .txt files ---------------------------------------------------------------

    def _text_files(self) -> Iterator[Outcome]:
        root = Path(self.shard.path)
        base = root.parent if root.is_file() else root
        for number, member in enumerate(text_members(self.shard.path), start=1):
            relative = str(member.relative_to(base))
            try:
                raw = member.read_bytes()
            except OSError as err:
                raise PrepError(f"input {str(member)!r} cannot be opened ({err}). Fix: check permissions.") from err
            self._consume(_member_header(relative, len(raw)))
            self._consume(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield Reject(number, "invalid_utf8", f"byte {err.start}: {err.reason}", raw, relative)
                continue
            outcome = check_text(number, text, raw, "", relative)
            if isinstance(outcome, Reject):
                outcome.member = relative
            yield outcome


class _DecodedStream:
    """Decompressed blocks of a plain / zstd / gzip stream, across concatenated frames/members.

    After iteration, `truncation` is None for a complete stream, else a description of where and
    why it broke.
    """

    def __init__(self, raw_blocks: Iterator[bytes], fmt: str):
        self.raw_blocks = raw_blocks
        self.fmt = fmt
        self.truncation: Optional[str] = None

    def __iter__(self) -> Iterator[bytes]:
        if self.fmt == "jsonl":
            yield from self.raw_blocks
        elif self.fmt == "jsonl.zst":
            dctx = zstandard.ZstdDecompressor()
            yield from self._frames(lambda: dctx.decompressobj(), zstandard.ZstdError)
        else:
            yield from self._frames(lambda: zlib.decompressobj(wbits=31), zlib.error)

    def _frames(self, new_decoder, error_type) -> Iterator[bytes]:
        decoder = new_decoder()
        started = False  # has the current frame received any input?
        consumed = 0
        for block in self.raw_blocks:
            data = block
            while data:
                try:
                    out = decoder.decompress(data)
                except error_type as err:
                    self.truncation = f"corrupt compressed data near input byte {consumed}: {err}"
                    return
                started = True
                consumed += len(data)
                if out:
                    yield out
                if decoder.eof:  # frame finished; the rest of `data` starts the next frame
                    data = decoder.unused_data
                    consumed -= len(data)
                    decoder, started = new_decoder(), False
                else:
                    data = b""
        if started:
            self.truncation = f"compressed stream ends mid-frame after {consumed} input bytes"


def _member_header(relative: str, size: int) -> bytes:
    # A txt shard's checksum covers each file's name and length too, so renaming or splitting
    # files changes it.
    return relative.encode("utf-8") + b"\0" + size.to_bytes(8, "big")


def input_sha256(shard: Shard) -> str:
    """The checksum `ShardReader` computes while reading, without parsing (for resume checks)."""
    digest = hashlib.sha256()
    if shard.format != "txt":
        with open(shard.path, "rb") as handle:
            while block := handle.read(CHUNK_BYTES):
                digest.update(block)
        return digest.hexdigest()
    root = Path(shard.path)
    base = root.parent if root.is_file() else root
    for member in text_members(shard.path):
        raw = member.read_bytes()
        digest.update(_member_header(str(member.relative_to(base)), len(raw)))
        digest.update(raw)
    return digest.hexdigest()
