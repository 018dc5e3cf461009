#!/usr/bin/env bash
# Throughput of `trainer prepare` against Python `tokenizers` (encode_batch, all cores,
# numpy uint16 out: nanoGPT's prepare.py), same tokenizer.json, same JSONL corpus, run back to
# back ROUNDS times. Usage: scripts/bench_prepare.sh [MB] [ROUNDS]   (needs a release build)
set -euo pipefail
cd "$(dirname "$0")/.."
MB=${1:-64}
ROUNDS=${2:-2}
PY=${PY:-/work/main/.venv-py/bin/python}
W=${BENCH_DIR:-target/bench-prepare}
mkdir -p "$W"
[ -f "$W/tok/tokenizer.json" ] || "$PY" scripts/python/prepare_bench.py tokenizer "$W/tok"
[ -f "$W/corpus.jsonl" ] || "$PY" scripts/python/prepare_bench.py corpus "$W/corpus.jsonl" "$MB"
echo "corpus $(stat -c %s "$W/corpus.jsonl") bytes; $(nproc) cores; $(date -u '+%F %H:%M UTC')"
for r in $(seq "$ROUNDS"); do
  echo "round $r: load $(cut -d' ' -f1-3 /proc/loadavg)"
  rm -f "$W/py.bin"
  /usr/bin/time -f "python: %e s wall, %M KiB max RSS" \
    "$PY" scripts/python/prepare_bench.py encode "$W/tok" "$W/corpus.jsonl" "$W/py.bin"
  rm -rf "$W/rs"
  /usr/bin/time -f "trainer: %e s wall, %M KiB max RSS" \
    ./target/release/trainer prepare "$W/corpus.jsonl" --tokenizer "$W/tok/tokenizer.json" \
    --out-dir "$W/rs" --quiet | grep -E "speed|train"
done
# Same token ids as Python's file (the shard's body after its 64-byte header).
cmp -n "$(stat -c %s "$W/py.bin")" "$W/py.bin" <(tail -c +65 "$W/rs/train-00000.tok") \
  && echo "token ids identical to Python's"
