#!/usr/bin/env bash
# Anonymous memory of `trainer prepare` and of training on memory-mapped shards, on a small
# and a large synthetic corpus: RssAnon (private, non-file memory: heap, stacks, tensors; not
# the page cache that mmap'd shards fill) must not grow with the corpus.
#
#   bench/shards_memory.sh [LARGE_MB] [SMALL_MB] [WORK_DIR]
#
# Defaults: 2048 MB and 20 MB of text, under target/shards-bench (deleted at the end). Needs
# about 3x LARGE_MB of free disk (the text, then byte-vocabulary shards at 2 bytes a token).
# The corpus is JSONL, one document a tinyshakespeare paragraph, repeated, each paragraph
# numbered so no two copies are equal; 1% of the documents are held out (val shards).
# Both runs use the same flags; shards of 1M tokens (2 MB: `prepare` holds about one a split,
# so the small corpus fills some too); training reads random windows from every shard (with
# ~2150 shards and 400 x 128 = 51200 windows drawn, missing one has probability < 1e-6).
set -euo pipefail
LARGE_MB=${1:-2048}
SMALL_MB=${2:-20}
WORK=${3:-target/shards-bench}
BIN=target/release/trainer
cargo build --release -p trainer >/dev/null 2>&1
mkdir -p "$WORK"

# Peak RssAnon (kB) of a command, sampled every 20 ms from /proc/PID/status.
peak_anon() {
  "$@" >"$WORK/last.log" 2>&1 &
  local pid=$! peak=0 v
  while kill -0 "$pid" 2>/dev/null; do
    v=$(awk '/^RssAnon:/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)
    if [ -n "$v" ] && [ "$v" -gt "$peak" ]; then peak=$v; fi
    sleep 0.02
  done
  wait "$pid" || { cat "$WORK/last.log"; exit 1; }
  echo "$peak"
}

make_corpus() { # MB OUT
  python3 - "$1" "$2" <<'EOF'
import json, sys
mb, out = int(sys.argv[1]), sys.argv[2]
paras = open("data/tinyshakespeare.txt", encoding="utf-8").read().split("\n\n")
target, n, copy = mb * 1024 * 1024, 0, 0
with open(out, "w", encoding="utf-8") as f:
    while n < target:
        block = "".join(json.dumps({"text": f"{copy}.{i} {p}"}) + "\n" for i, p in enumerate(paras))
        f.write(block)
        n += len(block.encode())
        copy += 1
EOF
}

row() { # NAME MB
  local name=$1 mb=$2 text="$WORK/$1.jsonl" dir="$WORK/$1-shards" run="$WORK/$1-run"
  make_corpus "$mb" "$text"
  local bytes; bytes=$(stat -c %s "$text")
  local t0; t0=$(date +%s.%N)
  local prep; prep=$(peak_anon "$BIN" prepare "$text" --out-dir "$dir" --vocab byte \
    --shard-tokens 1000000 --val-fraction 0.01 --threads 2 --quiet --overwrite)
  local t1; t1=$(date +%s.%N)
  local shards; shards=$(ls "$dir"/train-*.tok | wc -l)
  local sbytes; sbytes=$(du -sb "$dir" | cut -f1)
  rm -f "$text"
  local train; train=$(peak_anon "$BIN" train --data shards --data-path "$dir" \
    --out-dir "$run" --max-iters 400 --batch-size 128 --block-size 64 --n-layer 2 \
    --n-head 2 --n-embd 64 --eval-interval 100 --eval-iters 2 --peak-flops 1e12)
  local t2; t2=$(date +%s.%N)
  printf '| %s | %s | %s (%s) | %s | %.0f s | %s | %.0f s |\n' "$name" \
    "$(numfmt --to=iec "$bytes")" "$(numfmt --to=iec "$sbytes")" "$shards train shards" \
    "$((prep / 1024)) MiB" "$(echo "$t1 - $t0" | bc)" "$((train / 1024)) MiB" \
    "$(echo "$t2 - $t1" | bc)"
  rm -rf "$dir" "$run"
}

echo "| corpus | text | shards | prepare RssAnon | prepare time | train RssAnon | train time |"
echo "|---|---|---|---|---|---|---|"
row small "$SMALL_MB"
row large "$LARGE_MB"
rm -rf "$WORK"
