"""Throughput baseline for `trainer prepare`: Python `tokenizers` the nanoGPT way.

    python prepare_bench.py tokenizer OUT_DIR      # BPE on data/tinyshakespeare.txt
    python prepare_bench.py corpus OUT.jsonl MB    # tinyshakespeare paragraphs, repeated
    python prepare_bench.py encode TOKENIZER_DIR CORPUS.jsonl OUT.bin

`tokenizer` trains a byte-level BPE (vocab 8192, <|endoftext|> as EOS) and writes
tokenizer.json + tokenizer_config.json. `corpus` writes one JSON line {"text": paragraph} per
blank-line-separated paragraph of tinyshakespeare, repeated to about MB megabytes. `encode`
reads the JSONL in batches, tokenises each batch with `Tokenizer.encode_batch` (all cores:
the Rust core's rayon pool), appends EOS to each document and appends the ids to OUT.bin as
numpy uint16 (nanoGPT's prepare.py layout), then prints one JSON line of timings.
"""

import json
import os
import sys
import time

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SHAKESPEARE = os.path.join(ROOT, "data", "tinyshakespeare.txt")


def train_tokenizer(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([SHAKESPEARE], trainer)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}, f)


def make_corpus(out, mb):
    with open(SHAKESPEARE, encoding="utf-8") as f:
        paragraphs = [p for p in f.read().split("\n\n") if p.strip()]
    lines = "".join(json.dumps({"text": p}) + "\n" for p in paragraphs)
    reps = max(1, int(mb * 1e6 / len(lines.encode())))
    with open(out, "w", encoding="utf-8") as f:
        for _ in range(reps):
            f.write(lines)


def encode(tok_dir, corpus, out, batch=8192):
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    t0 = time.perf_counter()
    n_tokens = 0
    n_bytes = os.path.getsize(corpus)
    with open(corpus, encoding="utf-8") as f, open(out, "wb") as o:
        docs = []
        def flush():
            nonlocal n_tokens
            ids = []
            for e in tok.encode_batch(docs, add_special_tokens=False):
                ids.extend(e.ids)
                ids.append(eot)
            arr = np.array(ids, dtype=np.uint16)
            arr.tofile(o)
            n_tokens += len(arr)
            docs.clear()
        for line in f:
            if line.strip():
                docs.append(json.loads(line)["text"])
            if len(docs) == batch:
                flush()
        if docs:
            flush()
    dt = time.perf_counter() - t0
    print(json.dumps({"tokens": n_tokens, "bytes": n_bytes, "seconds": round(dt, 3),
                      "tokens_per_s": round(n_tokens / dt), "mb_per_s": round(n_bytes / dt / 1e6, 2)}))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "tokenizer":
        train_tokenizer(sys.argv[2])
    elif cmd == "corpus":
        make_corpus(sys.argv[2], float(sys.argv[3]))
    elif cmd == "encode":
        encode(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(__doc__)
