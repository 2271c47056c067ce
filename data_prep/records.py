"""What reading one input record yields: a `Document` or a `Reject` naming why.

Every record read produces exactly one of the two, which is what lets the pipeline prove
read = written + duplicates + rejected.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, Optional, Union

from data_prep.doc_hash import normalize_for_dedup

REJECT_REASONS = (
    "blank_line",          # an empty line between JSON records
    "malformed_json",      # the line is not valid JSON
    "not_a_json_object",   # valid JSON, but a list/number/string rather than an object
    "invalid_utf8",        # bytes that are not UTF-8, or text with lone surrogates (\ud800 escapes)
    "missing_text_field",  # the object has no `--text-field` key (or the parquet file no such column)
    "non_string_text",     # the text field is null, a number, a list, ...
    "empty_document",      # the text is empty or whitespace only
    "truncated_stream",    # a compressed stream ends early or is corrupt; once per file, holding the
                           # unreadable tail (possibly empty); the readable prefix is kept
)

RAW_KEEP_BYTES = 4096
"""Raw bytes of a rejected record kept in rejects.jsonl (enough to see what went wrong)."""

DOMAIN_KEYS = ("pile_set_name", "redpajama_set_name", "red_pajama_subset", "source")
"""Where a record's domain label is looked up, in `meta` first, then at top level."""


@dataclass
class Document:
    number: int
    """1-based record number in its shard: line (JSON lines), row (parquet), file index (txt)."""
    text: str
    domain: str
    """Source label, e.g. the Pile's `pile_set_name` ("Github"); "" when the record has none."""


@dataclass
class Reject:
    number: int
    reason: str
    detail: str
    raw: bytes
    member: Optional[str] = None
    """For `txt` shards: the file (relative to the directory) the record came from."""

    def to_json(self, shard_path: str) -> dict:
        return {
            "shard": shard_path,
            "line": self.number,
            "member": self.member,
            "reason": self.reason,
            "detail": self.detail,
            "raw_bytes": len(self.raw),
            "raw_base64": base64.b64encode(self.raw[:RAW_KEEP_BYTES]).decode("ascii"),
        }


Outcome = Union[Document, Reject]


def domain_of(record: dict) -> str:
    meta = record.get("meta")
    if isinstance(meta, str):  # some RedPajama dumps store meta as a JSON string
        try:
            meta = json.loads(meta)
        except ValueError:
            meta = None
    for source in (meta, record):
        if isinstance(source, dict):
            for key in DOMAIN_KEYS:
                value = source.get(key)
                if isinstance(value, str) and value:
                    return value
    return ""


def check_text(number: int, text: Any, raw: bytes, domain: str, member: Optional[str] = None) -> Outcome:
    """The checks every format shares once it has a candidate text value."""
    if not isinstance(text, str):
        kind = "null" if text is None else type(text).__name__
        return Reject(number, "non_string_text", f"text is {kind}, not a string", raw, member)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return Reject(number, "invalid_utf8", f"text holds a lone surrogate at {err.start}", raw, member)
    if not normalize_for_dedup(text):
        return Reject(number, "empty_document", "text is empty or whitespace only", raw, member)
    return Document(number, text, domain)


def parse_json_line(number: int, raw: bytes, text_field: str) -> Outcome:
    """One JSON-lines record (without its newline)."""
    if not raw.strip():
        return Reject(number, "blank_line", "empty line", raw)
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return Reject(number, "invalid_utf8", f"byte {err.start}: {err.reason}", raw)
    try:
        record = json.loads(line)
    except ValueError as err:
        return Reject(number, "malformed_json", str(err), raw)
    if not isinstance(record, dict):
        return Reject(number, "not_a_json_object", f"a JSON {type(record).__name__}", raw)
    if text_field not in record:
        keys = ", ".join(sorted(record)[:8])
        return Reject(number, "missing_text_field", f"no {text_field!r} key (keys: {keys})", raw)
    return check_text(number, record[text_field], raw, domain_of(record))
