#!/usr/bin/env python3
"""Reference fixture for LoRA on GPT-2 (`Conv1D`, PEFT's `fan_in_fan_out=True`), made with
Hugging Face transformers + PEFT.

    .venv-py/bin/python scripts/python/make_gpt2_lora_fixtures.py [OUT_DIR]
        # OUT_DIR defaults to trainer/tests/fixtures/lora_gpt2 (the committed fixture)

A tiny random GPT2LMHeadModel (`base/`), a PEFT LoRA adapter on its `c_attn`, `c_proj` and `c_fc`
layers (`adapter/`, PEFT's `save_pretrained`, non-zero lora_B), the adapter merged into the base
(`merged/`, `merge_and_unload`), and PEFT's outputs on a fixed batch (`expected.safetensors`):
`input_ids`, `labels`, `logits`, `base_logits`, `merged_logits`, `loss` and `grad.<on-disk name>`
for every adapter tensor. `cargo test` never runs this: the outputs are committed. Re-running
gives identical bytes (fixed seeds, sorted JSON keys, one safetensors metadata key).
"""
import argparse
import copy
import json
import os
import shutil

import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

from fixture_common import ADAPTER_FILES, deterministic, gradients, save_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "trainer", "tests", "fixtures", "lora_gpt2")

VOCAB, B, T = 96, 2, 12
R, ALPHA = 4, 8
TARGETS = ["c_attn", "c_fc", "c_proj"]  # sorted; c_proj: both attn.c_proj and mlp.c_proj
SEED = 23
A_STD, B_STD = 0.1, 0.05


def base_config():
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        activation_function="gelu_new",
        tie_word_embeddings=True,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )


def make_base():
    """Weights N(0, 0.2^2), LayerNorm scales 1 + N(0, 0.3^2), biases N(0, 0.1^2)."""
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(base_config()).to(torch.float32)
    gen = torch.Generator().manual_seed(1000 + SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if ".ln_" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.2 * noise)
    return model.eval()


def make_batch():
    g = torch.Generator().manual_seed(2000 + SEED)
    input_ids = torch.randint(0, VOCAB, (B, T), generator=g)
    labels = input_ids.clone()
    labels[0, [4, 9]] = -100
    labels[1, :3] = -100
    return dict(input_ids=input_ids, labels=labels)


def disk_name(name):
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def meta(what):
    return {
        "made_by": f"scripts/python/make_gpt2_lora_fixtures.py {what} "
        f"transformers={transformers.__version__} peft={peft.__version__} "
        f"torch={torch.__version__.split('+')[0]}"
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", nargs="?", default=DEFAULT_OUT)
    out = ap.parse_args().out_dir
    deterministic()
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)

    base = make_base()
    save_files(base, os.path.join(out, "base"))
    batch = make_batch()
    with torch.no_grad():
        base_logits = base(input_ids=batch["input_ids"], use_cache=False).logits

    cfg = LoraConfig(
        r=R,
        lora_alpha=ALPHA,
        target_modules=list(TARGETS),
        lora_dropout=0.0,
        init_lora_weights=False,
        fan_in_fan_out=True,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(copy.deepcopy(base), cfg)
    gen = torch.Generator().manual_seed(3000 + SEED)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            if ".lora_A." in name or ".lora_B." in name:
                std = A_STD if ".lora_A." in name else B_STD
                params[name].copy_(std * torch.randn(params[name].shape, generator=gen))
    model.eval()

    adapter_dir = os.path.join(out, "adapter")
    save_files(model, adapter_dir, ADAPTER_FILES)
    path = os.path.join(adapter_dir, "adapter_config.json")
    c = json.load(open(path))
    assert c["fan_in_fan_out"] is True
    c["target_modules"] = sorted(c["target_modules"])
    c["base_model_name_or_path"] = "../base"
    with open(path, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")

    model.zero_grad(set_to_none=True)
    o = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
    o.loss.backward()
    grads = gradients(model, lambda n: "grad." + disk_name(n))
    # f64 check of the reference's own rounding (not stored)
    m64 = copy.deepcopy(model).double()
    m64.zero_grad(set_to_none=True)
    o64 = m64(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
    o64.loss.backward()
    g64 = {"grad." + disk_name(n): p.grad for n, p in m64.named_parameters() if p.requires_grad}
    grad_rel = max(
        ((grads[k].double() - g64[k]).abs().max() / g64[k].abs().max()).item() for k in grads
    )
    print(f"loss {o.loss.item():.6f} (f64 {o64.loss.item():.6f}), grads f32 vs f64 {grad_rel:.1e}")

    merged = PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).merge_and_unload()
    with torch.no_grad():
        merged_logits = merged(input_ids=batch["input_ids"], use_cache=False).logits
        reload = PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).eval()
        again = reload(input_ids=batch["input_ids"], use_cache=False).logits
        assert torch.equal(again, o.logits.detach()), "the saved adapter reloads"
    save_files(merged, os.path.join(out, "merged"))

    expected = dict(
        input_ids=batch["input_ids"],
        labels=batch["labels"],
        logits=o.logits.detach(),
        base_logits=base_logits,
        merged_logits=merged_logits,
        loss=o.loss.detach(),
        **grads,
    )
    save_file(dict(sorted(expected.items())), os.path.join(out, "expected.safetensors"), metadata=meta("gpt2"))


if __name__ == "__main__":
    main()
