#!/usr/bin/env python3
"""Reference fixtures for the trainer's LoRA adapters, made with Hugging Face transformers + PEFT.

    .venv-py/bin/python scripts/python/make_lora_fixtures.py [OUT_DIR]
        # OUT_DIR defaults to trainer/tests/fixtures/lora (the committed fixtures)

A tiny random LlamaForCausalLM (`base/`), three PEFT LoRA adapters on it saved with PEFT's
`save_pretrained` (`adapter_plain/`, `adapter_rslora/`, `adapter_mts/`), the plain adapter merged
into the base (`merged/`), and per adapter the outputs of PEFT on a fixed batch: loss, logits and
the gradient of every adapter tensor under its on-disk name. See
trainer/tests/fixtures/lora/README.md (written by this script) for the layout.
`cargo test` never runs this: the outputs are committed. Re-running gives identical bytes.
"""
import argparse
import copy
import json
import os
import shutil
import sys

import peft
import torch
import torch.nn.functional as F
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from fixture_common import ADAPTER_FILES, deterministic, gradients, load_model, save_files, save_readme

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "trainer", "tests", "fixtures", "lora")

VOCAB = 128
B, T = 2, 16
R, ALPHA = 8, 16
TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]  # sorted
BASE_SEED = 11
# base_model_name_or_path written into every adapter_config.json (PEFT writes the path the base
# was loaded from; an absolute temp path would leak in): the base's directory relative to the
# adapter's.
BASE_NAME = "../base"
A_STD, B_STD = 0.1, 0.05  # lora_A ~ N(0, 0.1^2), lora_B ~ N(0, 0.05^2)
LM_HEAD_NOISE = 0.1  # adapter_mts: saved lm_head = base lm_head + N(0, 0.1^2)

# variant -> (use_rslora, modules_to_save, description)
VARIANTS = {
    "adapter_plain": (
        False,
        None,
        f"r {R}, lora_alpha {ALPHA}, scaling alpha/r = {ALPHA / R:g}",
    ),
    "adapter_rslora": (
        True,
        None,
        f"use_rslora: scaling alpha/sqrt(r) = {ALPHA / R ** 0.5:.6f}; the same lora_A/lora_B values as "
        "adapter_plain (only the scaling differs)",
    ),
    "adapter_mts": (
        False,
        ["lm_head"],
        "adapter_plain's lora_A/lora_B plus modules_to_save [lm_head]: a full trained copy of lm_head "
        f"(= base lm_head + N(0, {LM_HEAD_NOISE}^2)) saved as base_model.model.lm_head.weight",
    ),
}


def base_config():
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    )
    cfg._attn_implementation = "eager"
    cfg.dtype = torch.float32
    return cfg


def make_base():
    """Weights N(0, 0.2^2), RMSNorm weights 1 + N(0, 0.3^2) (make_llama_fixtures.py's scheme)."""
    torch.manual_seed(BASE_SEED)
    model = LlamaForCausalLM(base_config()).to(torch.float32)
    gen = torch.Generator().manual_seed(1000 + BASE_SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1.0 + 0.3 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model.eval()


def make_batch():
    g = torch.Generator().manual_seed(2000 + BASE_SEED)
    input_ids = torch.randint(0, VOCAB, (B, T), generator=g)
    labels = input_ids.clone()
    labels[0, [6, 7, 11]] = -100  # a few in the middle of row 0
    labels[1, :5] = -100  # row 1's first 5 (a prompt)
    return dict(input_ids=input_ids, labels=labels)


def lora_config(use_rslora, modules_to_save):
    return LoraConfig(
        r=R,
        lora_alpha=ALPHA,
        target_modules=list(TARGETS),
        lora_dropout=0.0,
        init_lora_weights=False,
        use_rslora=use_rslora,
        modules_to_save=modules_to_save,
        task_type="CAUSAL_LM",
    )


def make_peft(base, use_rslora, modules_to_save):
    """PEFT model on a copy of `base`; lora_A ~ N(0, A_STD^2), lora_B ~ N(0, B_STD^2) drawn in
    sorted parameter-name order from one seed (so every variant gets the same A/B values)."""
    model = get_peft_model(copy.deepcopy(base), lora_config(use_rslora, modules_to_save))
    gen = torch.Generator().manual_seed(3000 + BASE_SEED)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            if ".lora_A." in name or ".lora_B." in name:
                std = A_STD if ".lora_A." in name else B_STD
                p = params[name]
                p.copy_(std * torch.randn(p.shape, generator=gen, dtype=torch.float32))
        if modules_to_save:
            g2 = torch.Generator().manual_seed(4000 + BASE_SEED)
            w = model.base_model.model.lm_head.modules_to_save["default"].weight
            w.add_(LM_HEAD_NOISE * torch.randn(w.shape, generator=g2, dtype=torch.float32))
    return model.eval()


def disk_name(name):
    """PEFT's on-disk tensor name for an in-memory parameter name (adapter name `default` removed)."""
    return (
        name.replace(".lora_A.default.", ".lora_A.")
        .replace(".lora_B.default.", ".lora_B.")
        .replace(".modules_to_save.default.", ".")
    )


def forward(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)


def manual_loss(logits, labels):
    """transformers' causal-LM loss computed in the logits' dtype (its built-in one casts to f32)."""
    shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    shift_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="mean")


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = forward(model, batch)
    out.loss.backward()
    grads = gradients(model, disk_name)
    model.zero_grad(set_to_none=True)
    return out, grads


def f64_check(model, batch, logits32, loss32, grads32):
    """The same forward/backward in f64 (loss computed by hand: the built-in one casts logits to
    f32; RoPE cos/sin stay f32 in transformers). Returns the largest relative differences."""
    m64 = copy.deepcopy(model).to(torch.float64)
    m64.zero_grad(set_to_none=True)
    logits = m64(input_ids=batch["input_ids"], use_cache=False).logits
    loss = manual_loss(logits, batch["labels"])
    loss.backward()
    g64 = {disk_name(n): p.grad for n, p in m64.named_parameters() if p.requires_grad}
    assert set(g64) == set(grads32)
    logit_rel = ((logits32.double() - logits).abs().max() / logits.abs().max()).item()
    loss_rel = abs(loss32 - loss.item()) / abs(loss.item())
    grad_rel = max(
        ((grads32[k].double() - g64[k]).abs().max() / g64[k].abs().max()).item() for k in g64
    )
    return logit_rel, loss_rel, grad_rel


def sanitize_adapter_config(path):
    """Rewrite adapter_config.json: sorted target_modules (PEFT writes a set), neutral
    base_model_name_or_path, keys sorted."""
    cfg = json.load(open(path))
    cfg["target_modules"] = sorted(cfg["target_modules"])
    cfg["base_model_name_or_path"] = BASE_NAME
    if cfg.get("modules_to_save"):
        cfg["modules_to_save"] = sorted(cfg["modules_to_save"])
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    return cfg


def load_base(d):
    return load_model(d, LlamaForCausalLM)


def meta(what):
    # one key: safetensors writes several in varying order (bytes would differ between runs)
    return {
        "made_by": f"scripts/python/make_lora_fixtures.py {what} transformers={transformers.__version__} "
        f"peft={peft.__version__} torch={torch.__version__.split('+')[0]}"
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", nargs="?", default=DEFAULT_OUT)
    args = ap.parse_args()
    deterministic()
    out = args.out_dir
    if os.path.exists(out):
        for sub in ["base", "merged", *VARIANTS]:
            if os.path.exists(os.path.join(out, sub)):
                shutil.rmtree(os.path.join(out, sub))
    os.makedirs(out, exist_ok=True)

    base = make_base()
    batch = make_batch()
    with torch.no_grad():
        base_out = forward(base, batch)
    base_logits = base_out.logits.detach().clone()
    print(f"base: loss {base_out.loss.item():.6f}, |logits| max {base_logits.abs().max():.3f}")
    save_files(base, os.path.join(out, "base"))
    base_dir = os.path.join(out, "base")
    reloaded = load_base(base_dir)
    with torch.no_grad():
        torch.testing.assert_close(forward(reloaded, batch).logits, base_logits, rtol=0, atol=0)

    results = {}
    for variant, (rslora, mts, _) in VARIANTS.items():
        model = make_peft(base, rslora, mts)
        out_v, grads = loss_and_grads(model, batch)
        logits = out_v.logits.detach().clone()
        loss = out_v.loss.detach().clone()
        torch.testing.assert_close(manual_loss(logits, batch["labels"]), loss, rtol=1e-6, atol=1e-6)
        dl = (logits - base_logits).abs().max().item()
        print(f"{variant}: loss {loss.item():.6f} (base {base_out.loss.item():.6f}), max |logits - base| {dl:.4f}")
        assert dl > 0.1, f"{variant}: the adapter barely changes the logits"
        logit_rel, loss_rel, grad_rel = f64_check(model, batch, logits, loss.item(), grads)
        print(
            f"  f32 vs f64: logits {logit_rel:.2e} (max abs diff / max |logit|), loss {loss_rel:.2e} rel, "
            f"grads {grad_rel:.2e} (max over tensors of max abs diff / max |grad|)"
        )
        assert grad_rel < 1e-4, grad_rel

        d = os.path.join(out, variant)
        save_files(model, d, ADAPTER_FILES)
        cfg = sanitize_adapter_config(os.path.join(d, "adapter_config.json"))
        assert cfg["use_rslora"] == rslora and cfg["r"] == R and cfg["lora_alpha"] == ALPHA
        saved = load_file(os.path.join(d, "adapter_model.safetensors"))
        assert set(saved) == set(grads), set(saved) ^ set(grads)
        assert all(t.dtype == torch.float32 for t in saved.values())
        params = {disk_name(n): p for n, p in model.named_parameters() if p.requires_grad}
        for k, t in saved.items():
            assert torch.equal(t, params[k].detach()), k

        expected = {
            "input_ids": batch["input_ids"].to(torch.int64).contiguous(),
            "labels": batch["labels"].to(torch.int64).contiguous(),
            "logits": logits.to(torch.float32).contiguous(),
            "loss": loss.to(torch.float32).reshape(()).contiguous(),
        }
        for k in sorted(grads):
            expected[f"grad.{k}"] = grads[k].to(torch.float32).contiguous()

        # reload through PEFT from the written files: same logits
        loaded = PeftModel.from_pretrained(load_base(base_dir), d).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=batch["input_ids"], use_cache=False).logits, logits, rtol=0, atol=0)

        if variant == "adapter_plain":
            expected["base_logits"] = base_logits.to(torch.float32).contiguous()
            merged = loaded.merge_and_unload().eval()
            assert isinstance(merged, LlamaForCausalLM)
            with torch.no_grad():
                merged_logits = merged(input_ids=batch["input_ids"], use_cache=False).logits.detach()
            md = (merged_logits - logits).abs().max().item()
            print(f"  merged: max |merged logits - adapter logits| {md:.2e}")
            assert md < 1e-4, md
            merged.config._name_or_path = ""
            save_files(merged, os.path.join(out, "merged"))
            m2 = load_base(os.path.join(out, "merged"))
            with torch.no_grad():
                torch.testing.assert_close(m2(input_ids=batch["input_ids"], use_cache=False).logits, merged_logits, rtol=0, atol=0)
            expected["merged_logits"] = merged_logits.to(torch.float32).contiguous()
            merged_diff = md
        save_file(dict(sorted(expected.items())), os.path.join(d, "expected.safetensors"), metadata=meta(variant))
        results[variant] = (loss.item(), dl, logit_rel, grad_rel, len(grads), merged_diff if variant == "adapter_plain" else None)

    # whatever was written is small
    total = 0
    for dp, _, files in sorted(os.walk(out)):
        for f in files:
            total += os.path.getsize(os.path.join(dp, f))
    write_readme(out, base_out.loss.item(), results)
    print(f"total {total / 1024:.0f} KiB")


def write_readme(out, base_loss, results):
    lines = [
        "# LoRA reference fixtures (PEFT)",
        "",
        "Made by `scripts/python/make_lora_fixtures.py` with Hugging Face transformers + PEFT; `cargo test`",
        "only reads these files. Do not edit them by hand: remake them with",
        "",
        "```",
        "scripts/python/setup.sh                                 # .venv-py, pinned (scripts/python/requirements.txt)",
        ".venv-py/bin/python scripts/python/make_lora_fixtures.py",
        "```",
        "",
        f"Versions: transformers {transformers.__version__}, peft {peft.__version__}, torch "
        f"{torch.__version__.split('+')[0]} (CPU, 1 thread); Python {sys.version.split()[0]}. Re-running "
        "gives byte-identical files (fixed seeds; sorted JSON keys and tensor names; one safetensors",
        "metadata key).",
        "",
        "## Layout",
        "",
        "- `base/`: `config.json` + `model.safetensors` (`save_pretrained`, f32): LlamaForCausalLM, vocab "
        f"{VOCAB}, hidden 64, intermediate 128, 2 layers, 4 heads / 2 KV heads (head_dim 16), untied "
        "embeddings (`lm_head.weight` present), RoPE default theta 10000, max_position_embeddings 256, "
        "rms_norm_eps 1e-5, eager attention. After init every weight is overwritten with N(0, 0.2^2) "
        f"and every RMSNorm weight with 1 + N(0, 0.3^2) (seed {BASE_SEED}).",
        "- `adapter_plain/`, `adapter_rslora/`, `adapter_mts/`: PEFT's `save_pretrained` output,",
        "  `adapter_config.json` + `adapter_model.safetensors` (f32). Each is",
        f"  `get_peft_model(base, LoraConfig(r={R}, lora_alpha={ALPHA}, target_modules=[q,k,v,o,gate,up,down]_proj,",
        "  lora_dropout=0.0, init_lora_weights=False, use_rslora=..., modules_to_save=..., task_type=\"CAUSAL_LM\"))`",
        f"  with every lora_A then set to N(0, {A_STD}^2) and every lora_B to N(0, {B_STD}^2), drawn in sorted",
        "  parameter-name order from one seed, so the three adapters hold the same A/B values.",
        "  `adapter_config.json` is rewritten by the script: `target_modules` sorted (PEFT writes it from",
        f"  a set), `base_model_name_or_path` = `\"{BASE_NAME}\"` (neutral; PEFT writes the load path), keys",
        "  sorted. Tensor names on disk: `base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight`,",
        "  `base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight` (no `.default`),",
        "  lora_A `[r, in]`, lora_B `[out, r]`; `adapter_mts` also `base_model.model.lm_head.weight` `[128, 64]`.",
        "- `merged/`: `config.json` + `model.safetensors`: `adapter_plain` loaded with",
        "  `PeftModel.from_pretrained(base, adapter_plain)` then `merge_and_unload()` and `save_pretrained`",
        "  (a plain LlamaForCausalLM: W + (alpha/r) B A in every targeted Linear).",
        "- `<adapter>/expected.safetensors` (each):",
        f"  - `input_ids` [{B}, {T}] I64; `labels` [{B}, {T}] I64: = input_ids except -100 at row 0",
        "    positions 6, 7, 11 and row 1 positions 0-4;",
        f"  - `logits` [{B}, {T}, {VOCAB}] F32 (base + adapter, `use_cache=False`);",
        "  - `loss` scalar F32: transformers' built-in causal-LM loss, `model(input_ids, labels=labels).loss`",
        "    = mean cross-entropy over the non -100 entries of `labels[:, 1:]` against `logits[:, :-1]`;",
        "  - `grad.<on-disk name>` F32 for every tensor in that adapter's `adapter_model.safetensors`",
        "    (e.g. `grad.base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`; in",
        "    `adapter_mts` also `grad.base_model.model.lm_head.weight`): the gradient of `loss` (base frozen);",
        "  - `adapter_plain` only: `base_logits` [2, 16, 128] F32, the base model alone (so a load that",
        "    applies nothing is caught), and `merged_logits` [2, 16, 128] F32, the logits of `merged/`.",
        "",
        "The safetensors headers' `__metadata__` (`made_by`) name the variant and versions.",
        "",
        "## Values",
        "",
        f"Base loss {base_loss:.6f}.",
        "",
        "| variant | what | loss | max abs logit change vs base | f32 vs f64: logits | grads | tensors |",
        "|---|---|---|---|---|---|---|",
    ]
    for v, (loss, dl, lr, gr, n, _) in results.items():
        lines.append(f"| `{v}` | {VARIANTS[v][2]} | {loss:.6f} | {dl:.3f} | {lr:.1e} | {gr:.1e} | {n} |")
    lines += [
        "",
        "f32 vs f64: the same model cast to f64 (loss computed by hand, as transformers' built-in loss",
        "casts logits to f32; RoPE cos/sin stay f32), max abs difference over max abs value (logits), and",
        "for gradients the largest over all tensors of (max abs difference / max abs f64 gradient).",
        "The f64 run is only a check; it is not stored.",
        "",
        "## Checks done by the script",
        "",
        "- `base/` and `merged/` reload with `LlamaForCausalLM.from_pretrained` to bit-identical logits;",
        "  each adapter reloads with `PeftModel.from_pretrained(base, dir)` to bit-identical logits, and",
        "  the saved adapter tensors equal the in-memory ones under the name mapping",
        "  `….lora_A.default.weight` -> `….lora_A.weight`, `lm_head.modules_to_save.default.weight` ->",
        "  `lm_head.weight`.",
        "- Each adapter moves the logits by > 0.1 (table) and the merged model's logits match the",
        f"  adapter's to < 1e-4 (here {results['adapter_plain'][5]:.1e}: merging changes the f32 rounding).",
        "",
        "## Related",
        "",
        "`scripts/python/verify_lora.py DIR` checks an adapter and a merged export written by the trainer",
        "(DIR: `base/`, `adapter/`, `merged/`, `expected.safetensors` with `input_ids`, `logits` and",
        "optionally `merged_logits`). This fixture passes it with `adapter_plain/` as `adapter/`: adapter",
        f"logits bit-identical; merged vs the unmerged `logits` {results['adapter_plain'][5]:.1e}, close to its",
        "default 1e-5, so the trainer should record its own `merged_logits` as well.",
        "",
        "Size: about 1.3 MB in all, most of it `base/` and `merged/` (364 KB each at the fixed shape).",
        "",
    ]
    save_readme(out, lines)


if __name__ == "__main__":
    main()
