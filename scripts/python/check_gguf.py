#!/usr/bin/env python3
"""Runs a GGUF file written by `trainer export --format gguf` in llama.cpp itself and compares it
with transformers on the Hugging Face model it came from: the logits of every position of a
prompt, and a greedy continuation token for token. Not part of `cargo test` (it needs
llama.cpp: `pip install llama-cpp-python==0.3.36 diskcache`, which builds it in a few minutes).

    .venv-py/bin/python scripts/python/check_gguf.py HF_DIR MODEL.gguf [--tol 1e-4] [--tokens 20]
    .venv-py/bin/python scripts/python/check_gguf.py HF_DIR MODEL.gguf \
        --lora PEFT_ADAPTER_DIR ADAPTER.gguf    # a GGUF LoRA (`export --gguf-lora`) over MODEL.gguf
                                                # against PEFT's adapter over HF_DIR

Tolerances: logits within `--tol` relative to the largest logit of the position (1e-4 for f32
files, with llama.cpp's KV cache in f32: llama.cpp and PyTorch sum in other orders; 1e-2 for
f16/bf16 files, whose weights are rounded); q8_0 and q4_k_m are lossy and get a report of the
difference instead (`--tol 0`; their greedy continuations may then part).
The prompt is tokenized by transformers and given to llama.cpp as ids, so the check is of the
model, not of the two tokenizers; `--text` also checks that llama.cpp tokenizes the prompt to
the same ids.
"""
import argparse
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("gguf")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--prompt", default="First Citizen:\nBefore we proceed any further, hear me speak.")
    ap.add_argument("--text", action="store_true", help="also compare the tokenizations")
    ap.add_argument("--lora", nargs=2, metavar=("PEFT_DIR", "ADAPTER_GGUF"),
                    help="compare PEFT's adapter over HF_DIR with the GGUF LoRA over MODEL.gguf")
    args = ap.parse_args()

    from llama_cpp import Llama
    tok = AutoTokenizer.from_pretrained(args.hf_dir)
    ids = tok(args.prompt)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, torch_dtype=torch.float32).eval()
    lora = {}
    if args.lora:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, args.lora[0]).eval()
        lora = {"lora_path": args.lora[1]}
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
        greedy_ref = model.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False,
                                    pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()

    # The KV cache in f32 (llama.cpp's default is f16, which alone moves logits by ~1e-3).
    llm = Llama(model_path=args.gguf, n_ctx=max(64, len(ids) + args.tokens + 8), logits_all=True,
                verbose=False, n_threads=2, type_k=0, type_v=0, **lora)
    ok = True
    if args.text:
        theirs = llm.tokenize(args.prompt.encode("utf-8"), add_bos=True, special=False)
        print(f"tokenization: {'same' if theirs == ids else 'DIFFERENT'} ({len(ids)} ids)")
        ok &= theirs == ids
    llm.reset()
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)], dtype=np.float32)[:, : ref.shape[1]]
    scale = np.abs(ref).max(axis=1, keepdims=True)
    rel = float((np.abs(got - ref) / scale).max())
    print(f"logits: {len(ids)} positions x {ref.shape[1]}, max |diff| / max |logit| = {rel:.3e}")
    if args.tol > 0 and rel > args.tol:
        print(f"  above the tolerance {args.tol}")
        ok = False
    llm.reset()
    greedy = []
    for t in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        greedy.append(t)
        if len(greedy) == args.tokens or t == tok.eos_token_id:
            break
    greedy_ref = greedy_ref[: len(greedy)]
    same = greedy == greedy_ref
    print(f"greedy: {len(greedy)} tokens, {'same' if same else 'DIFFERENT'}")
    if not same:
        print("  ours  ", greedy)
        print("  theirs", greedy_ref)
    ok &= same or args.tol == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
