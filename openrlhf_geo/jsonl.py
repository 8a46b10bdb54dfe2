"""JSON(L) I/O: the one reader for the jsonl files the project reads (datasets, eval records, judge inputs, run
logs) and the strict-JSON form of what it writes."""

import json
import math


def read_jsonl(path, label=""):
    """[(line number, object)] for each non-blank line of a jsonl file: `iter_jsonl` as a list."""
    return list(iter_jsonl(path, label))


def iter_jsonl(path, label=""):
    """(line number, object) for each non-blank line of a jsonl file (a UTF-8 BOM on the first line is accepted),
    read one line at a time: memory holds one line, whatever the file's size.

    ValueError "<label> <path>:<line>: ..." (label: the flag that named the file, if any) for a missing file, bad
    UTF-8, malformed JSON or a line that is not a JSON object, raised when reading reaches it; callers check the
    fields they need.
    """
    where = f"{label} {path}" if label else str(path)
    try:
        handle = open(path, "rb")
    except OSError as error:
        raise ValueError(f"{where}: {error.strerror}") from None
    with handle:
        for number, raw in enumerate(handle, 1):
            row = parse_line(raw, number, where)
            if row is not None:
                yield number, row


def parse_line(raw, number, where):
    """The JSON object of one jsonl line (bytes, with or without its newline), None for a blank one; ValueError
    "<where>:<number>: ..." otherwise."""
    raw = raw.removesuffix(b"\n")  # JSON's error columns count on the line as written
    try:
        line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{where}:{number}: not UTF-8 (byte {raw[error.start]:#04x} at column {error.start + 1})"
        ) from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}:{number}: not JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}:{number}: expected a JSON object (got {type(row).__name__})")
    return row


def strict_json(value):
    """`value` (dicts, lists, tuples, scalars) as strict JSON: str keys, NaN/inf -> null (the writers' convention)."""
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def nan_json(value):
    """strict_json read back: every null as NaN, for the written results whose nulls are all non-finite floats (the
    studies' records and summaries; an inf comes back as NaN, which their summaries leave out alike)."""
    if isinstance(value, dict):
        return {k: nan_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [nan_json(v) for v in value]
    return math.nan if value is None else value
