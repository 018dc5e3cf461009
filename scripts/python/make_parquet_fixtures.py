#!/usr/bin/env python3
"""Tiny Parquet files, and the same records as JSON lines, for `trainer prepare`'s Parquet input.

    .venv-py/bin/python scripts/python/make_parquet_fixtures.py [OUT_DIR]
        # OUT_DIR defaults to trainer/tests/fixtures/parquet (the committed fixtures)

Each Parquet file is written by pyarrow (what the Hugging Face hub serves: pyarrow's default
snappy compression, several row groups) beside a JSONL twin holding the same rows, one JSON
object a line with the columns in order (`table.to_pylist()`). trainer/tests/parquet.rs checks
that `trainer prepare` gives the same shards from either.

- `text.parquet` / `.jsonl`: `text` and `body` strings (some non-ASCII) and an `id` integer;
  40 rows in row groups of 6.
- `chat.parquet` / `.jsonl`: `messages`, a list<struct<role: string, content: string>> (TRL's
  conversational format) and a `source` string; 24 rows in row groups of 5.
- `prompt_completion.parquet` / `.jsonl`: `prompt` and `completion` strings; 12 rows in row
  groups of 4.
- `null.parquet`: a `text` column whose row 2 of row group 1 (row 6 of the file) is null.
- `wrong_type.parquet`: a `text` column of int64 and a `body` string column.
- `zstd.parquet`: a `text` column compressed with zstd (a codec this build does not read).

`cargo test` never runs this. Re-running gives the same rows (the bytes may differ with the
pyarrow version, which the file records).
"""
import argparse
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "trainer", "tests", "fixtures", "parquet")

WORDS = ["the", "king", "is", "dead", "long", "live", "queen", "good", "night", "sweet",
         "prince", "café", "naïve", "—", "déjà", "vu"]


def words(i, n):
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))


def write(out, name, table, row_group_size, twin=True, compression="snappy"):
    pq.write_table(table, os.path.join(out, name + ".parquet"), row_group_size=row_group_size,
                   compression=compression)
    meta = pq.ParquetFile(os.path.join(out, name + ".parquet")).metadata
    assert meta.num_row_groups > 1, name
    if twin:
        with open(os.path.join(out, name + ".jsonl"), "w", encoding="utf-8") as f:
            for row in table.to_pylist():
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=DEFAULT_OUT)
    out = ap.parse_args().out
    os.makedirs(out, exist_ok=True)

    n = 40
    text = pa.table({
        "id": pa.array(range(n), pa.int64()),
        "text": pa.array([words(i, 3 + i % 9) for i in range(n)], pa.string()),
        "body": pa.array([words(i + 5, 2 + i % 4) + f" #{i}" for i in range(n)], pa.string()),
    })
    write(out, "text", text, 6)

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    chats = []
    for i in range(24):
        turns = []
        if i % 3 == 0:
            turns.append({"role": "system", "content": words(i, 4)})
        for t in range(1 + i % 2):
            turns.append({"role": "user", "content": words(i + t, 3 + t)})
            turns.append({"role": "assistant", "content": words(i + t + 1, 2 + i % 5)})
        chats.append(turns)
    chat = pa.table({
        "messages": pa.array(chats, pa.list_(message)),
        "source": pa.array([f"set-{i % 4}" for i in range(24)], pa.string()),
    })
    write(out, "chat", chat, 5)

    pc = pa.table({
        "prompt": pa.array([words(i, 3) for i in range(12)], pa.string()),
        "completion": pa.array([" " + words(i + 2, 1 + i % 4) for i in range(12)], pa.string()),
    })
    write(out, "prompt_completion", pc, 4)

    nulls = [words(i, 3) for i in range(10)]
    nulls[6] = None
    write(out, "null", pa.table({"text": pa.array(nulls, pa.string())}), 4, twin=False)

    wrong = pa.table({
        "text": pa.array(range(8), pa.int64()),
        "body": pa.array([words(i, 2) for i in range(8)], pa.string()),
    })
    write(out, "wrong_type", wrong, 4, twin=False)

    zstd = pa.table({"text": pa.array([words(i, 3) for i in range(8)], pa.string())})
    write(out, "zstd", zstd, 4, twin=False, compression="zstd")


if __name__ == "__main__":
    main()
