#!/usr/bin/env bash
# Rebuilds data/chat-base: the tiny Llama-family base of the embedded LoRA default
# (configs/lora_chat.toml), with no download.
#
# 1. `trainer chat-tokenizer` writes the chat tasks' word-level tokenizer (the letters a-z, a
#    few words, ChatML's <|im_start|> / <|im_end|>) and a tokenizer_config.json holding the
#    ChatML chat template.
# 2. `trainer train --data chat-task --chat-task basics` pretrains a fresh 4-layer Llama
#    (0.86M parameters) on generated chats of three skills: copying a string of letters
#    ("Write each letter : c a d b" -> "c a d b") and naming the letter after or before one
#    letter ("Write the letter after c" -> "d"). It never sees the fine-tuning task,
#    the letter after *each* letter of a string.
# 3. `trainer export` writes config.json, model.safetensors (bf16, ~1.7 MB), tokenizer.json
#    and tokenizer_config.json into the output directory.
#
# About 3 minutes on 2 CPU cores. The data and initialisation are fixed by the seed (a rerun on
# the machine that made the committed base reproduced it byte for byte); the
# weights can still differ in the last bits across machines (float sums in another order).
#
# Usage: scripts/make_chat_base.sh [OUT_DIR]   (default: data/chat-base)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-data/chat-base}
work=runs/chat-base-pretrain

cargo build --release -p trainer
trainer=target/release/trainer

"$trainer" chat-tokenizer "$work/tokenizer"
"$trainer" train \
    --data chat-task --chat-task basics --chat-examples 20000 \
    --tokenizer-path "$work/tokenizer/tokenizer.json" \
    --arch llama --n-layer 4 --n-head 4 --n-embd 128 --bias false --tie-embeddings true \
    --block-size 48 --batch-size 32 --max-iters 600 --warmup-iters 100 \
    --lr 3e-3 --min-lr 1e-4 --eval-interval 200 --eval-problems 500 --seed 1337 \
    --out-dir "$work/run" --overwrite
"$trainer" export "$work/run" "$out" --dtype bf16 --force
ls -l "$out"
