"""The one jsonl reader and the strict-JSON writer convention."""

import json
import math

import pytest

from openrlhf_geo.jsonl import read_jsonl, strict_json


def test_reader_returns_line_numbers_skips_blank_lines_and_accepts_a_bom(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n\n{"a": 2}\r\n')
    assert read_jsonl(path) == [(1, {"a": 1}), (3, {"a": 2})]


@pytest.mark.parametrize(
    "data, message",
    [
        (b'{"a": 1}\n{"a": \n', "rows.jsonl:2: not JSON (Expecting value at column 7)"),
        (b'{"a": 1}\n[1, 2]\n', "rows.jsonl:2: expected a JSON object (got list)"),
        (b'{"a": "\xff"}\n', "rows.jsonl:1: not UTF-8 (byte 0xff at column 8)"),
    ],
)
def test_reader_errors_name_the_flag_file_and_line(tmp_path, data, message):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(data)
    with pytest.raises(ValueError) as error:
        read_jsonl(path, "--data.prompt_dataset")
    assert str(error.value).startswith("--data.prompt_dataset ") and str(error.value).endswith(message)


def test_a_missing_file_is_a_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="none.jsonl: No such file"):
        read_jsonl(tmp_path / "none.jsonl")


def test_strict_json_turns_non_finite_floats_into_null_at_any_depth():
    value = {1: [math.nan, (math.inf, 2.0)], "x": {"y": -math.inf, "z": "s"}}
    assert strict_json(value) == {"1": [None, [None, 2.0]], "x": {"y": None, "z": "s"}}
    json.dumps(strict_json(value), allow_nan=False)  # strict: no NaN literals
