#!/usr/bin/env python3
"""Greedy generation past a model's trained positions, by transformers.

    .venv-py/bin/python scripts/python/make_sample_fixture.py [OUT_DIR]
        # OUT_DIR defaults to trainer/tests/fixtures/sample (the committed fixture)

Loads the tiny Llama of trainer/tests/fixtures/llama/llama (max_position_embeddings 128) and
writes `llama_past_positions.safetensors`: `prompt` [1, 120] I64 (seeded random ids) and
`greedy` [1, 140] I64 = `model.generate(prompt, max_new_tokens=20, min_new_tokens=20,
do_sample=False)`: the last 12 tokens lie past the 128 positions, where transformers keeps
extending the rotary positions (it neither crops nor restarts the context). trainer/tests/
conventions.rs checks that `trainer::sample::generate` continues the same way. `cargo test`
never runs this. Re-running gives identical bytes.
"""
import argparse
import os

import torch
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "trainer", "tests", "fixtures", "llama", "llama")
DEFAULT_OUT = os.path.join(ROOT, "trainer", "tests", "fixtures", "sample")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=DEFAULT_OUT)
    out = ap.parse_args().out
    model = LlamaForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    assert model.config.max_position_embeddings == 128
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, model.config.vocab_size, (1, 120), generator=gen)
    with torch.no_grad():
        greedy = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=20,
            min_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
        )
    assert greedy.shape == (1, 140)
    os.makedirs(out, exist_ok=True)
    save_file(
        {"prompt": prompt.contiguous(), "greedy": greedy.contiguous()},
        os.path.join(out, "llama_past_positions.safetensors"),
    )


if __name__ == "__main__":
    main()
