#!/usr/bin/env python3
"""QLoRA reference fixtures: the tiny Llama of trainer/tests/fixtures/lora/base loaded in 4 bits
(NF4) by transformers + bitsandbytes 0.50.2 on the CPU, and PEFT's LoRA step over it.

    /work/venv-bnb/bin/python scripts/python/make_qlora_fixtures.py [OUT_DIR]
        # venv: scripts/python/setup_bnb.sh; OUT_DIR defaults to trainer/tests/fixtures/qlora

For each setting `dq` (bnb_4bit_use_double_quant=True) and `plain` (False), with
bnb_4bit_compute_dtype float32 and lm_head kept in 32 bits (transformers' default):

    OUT_DIR/base_<setting>/config.json, model.safetensors   save_pretrained of the 4-bit model
    OUT_DIR/expected_<setting>.safetensors                  input_ids, labels, logits, loss and
        grad.<adapter tensor> of PEFT's adapter_plain (../lora/adapter_plain: r 8, alpha 16,
        non-zero B) loaded trainable over the 4-bit model, on make_lora_fixtures.py's batch
    OUT_DIR/merged_dq.safetensors                           PEFT's merge_and_unload of it (dq only),
        each projection dequantized to bf16

`cargo test` never runs this: the outputs are committed.
"""
import copy
import os
import shutil
import sys

import bitsandbytes as bnb
import peft
import torch
import transformers
from peft import PeftModel
from safetensors.torch import save_file
from transformers import BitsAndBytesConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fixture_common import save_files  # noqa: E402
from make_lora_fixtures import disk_name, make_batch  # noqa: E402

assert bnb.__version__ == "0.50.2", bnb.__version__
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LORA = os.path.join(ROOT, "trainer", "tests", "fixtures", "lora")
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "trainer", "tests", "fixtures", "qlora")


def load_4bit(double, compute=torch.float32):
    cfg = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=compute,
        bnb_4bit_use_double_quant=double,
    )
    return LlamaForCausalLM.from_pretrained(
        os.path.join(LORA, "base"),
        quantization_config=cfg,
        dtype=torch.float32,
        device_map="cpu",
        attn_implementation="eager",
    ).eval()


def peft_step(model, batch):
    """PEFT's adapter_plain loaded trainable over `model`, one forward and backward on `batch`:
    the output, the expected tensors (input_ids, labels, logits, loss, grad.<adapter tensor>, every
    gradient non-zero) and the number of gradients."""
    p = PeftModel.from_pretrained(model, os.path.join(LORA, "adapter_plain"), is_trainable=True)
    # Training mode, as a training step runs: in eval mode, on a CPU with AVX512-BF16,
    # bitsandbytes' Linear4bit runs an input that needs no gradient through a bf16 inference
    # kernel (input and absmax cast to bf16) instead of dequantize_4bit + an f32 linear.
    # (Dropout is 0 everywhere: training mode changes nothing else.)
    p.train()
    p.zero_grad(set_to_none=True)
    out = p(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
    out.loss.backward()
    expected = {
        "input_ids": batch["input_ids"].to(torch.int64).contiguous(),
        "labels": batch["labels"].to(torch.int64).contiguous(),
        "logits": out.logits.detach().float().contiguous(),
        "loss": out.loss.detach().float().reshape(()).contiguous(),
    }
    n = 0
    for name, q in p.named_parameters():
        if q.requires_grad:
            assert q.grad is not None and q.grad.abs().sum() > 0, name
            expected[f"grad.{disk_name(name)}"] = q.grad.detach().float().contiguous()
            n += 1
    return out, expected, n


def main():
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.makedirs(OUT, exist_ok=True)
    batch = make_batch()
    meta = {
        "made_by": f"scripts/python/make_qlora_fixtures.py transformers={transformers.__version__} "
        f"peft={peft.__version__} bitsandbytes={bnb.__version__} torch={torch.__version__.split('+')[0]}"
    }
    lines = [
        "# QLoRA reference fixtures (transformers + bitsandbytes + PEFT)",
        "",
        "Made by `scripts/python/make_qlora_fixtures.py` (venv: `scripts/python/setup_bnb.sh`); `cargo test`",
        "only reads these files. Versions: " + meta["made_by"].split(" ", 1)[1] + ".",
        "",
        "- `base_dq/`, `base_plain/`: `save_pretrained` of `../lora/base` loaded with",
        "  `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\", bnb_4bit_compute_dtype=float32,",
        "  bnb_4bit_use_double_quant=True/False)` on the CPU: the 14 projections in 4 bits (`weight` u8 packed,",
        "  `weight.absmax`, `weight.quant_map`, with double quantization `weight.nested_absmax` and",
        "  `weight.nested_quant_map`, `weight.quant_state.bitsandbytes__nf4`), lm_head, embeddings and norms f32.",
        "- `expected_dq.safetensors`, `expected_plain.safetensors`: `input_ids`, `labels` (the batch of",
        "  `make_lora_fixtures.py`), `logits`, `loss` and `grad.<tensor>` of PEFT's `../lora/adapter_plain`",
        "  loaded trainable over that 4-bit model (`PeftModel.from_pretrained(.., is_trainable=True)`).",
        "- `merged_dq.safetensors`: PEFT's `merge_and_unload()` of `adapter_plain` over the `dq` model",
        "  (each projection re-quantized from its dequantized weight plus the update), every projection's",
        "  weight dequantized to bf16.",
        "",
    ]
    for setting, double in [("dq", True), ("plain", False)]:
        model = load_4bit(double)
        d = os.path.join(OUT, f"base_{setting}")
        if os.path.exists(d):
            shutil.rmtree(d)
        model.config._name_or_path = ""
        save_files(model, d)

        out, expected, n = peft_step(model, batch)
        assert n == 28, n
        save_file(dict(sorted(expected.items())), os.path.join(OUT, f"expected_{setting}.safetensors"), metadata=meta)
        print(f"{setting}: loss {out.loss.item():.6f}, {n} gradients")
        if double:
            # PEFT's merge_and_unload over the 4-bit base: each projection's dequantized
            # weight plus the update, quantized again (the model stays 4-bit); saved
            # dequantized to bf16 (`dequantize_4bit` with dtype bf16).
            merged = PeftModel.from_pretrained(load_4bit(double), os.path.join(LORA, "adapter_plain"))
            merged = merged.merge_and_unload()
            dq = {}
            for name, mod in merged.named_modules():
                if isinstance(mod, bnb.nn.Linear4bit):
                    st = copy.copy(mod.weight.quant_state)
                    st.dtype = torch.bfloat16
                    dq[f"{name}.weight"] = bnb.functional.dequantize_4bit(mod.weight.data, st).contiguous()
            assert len(dq) == 14, len(dq)
            save_file(dict(sorted(dq.items())), os.path.join(OUT, f"merged_{setting}.safetensors"), metadata=meta)
        lines.append(f"- `{setting}`: loss {out.loss.item():.6f}, {n} gradients.")
    # bf16 compute (bnb_4bit_compute_dtype=bfloat16, the model otherwise f32): the 4-bit
    # layers' input cast to bf16, the dequantized weight cast to bf16, their output back to f32.
    out, expected, _ = peft_step(load_4bit(True, torch.bfloat16), batch)
    save_file(dict(sorted(expected.items())), os.path.join(OUT, "expected_dq_bf16.safetensors"), metadata=meta)
    print(f"dq, bf16 compute: loss {out.loss.item():.6f}")
    lines.append(
        f"- `expected_dq_bf16.safetensors`: the same step of `dq` with bnb_4bit_compute_dtype bfloat16 (the "
        f"model otherwise f32): loss {out.loss.item():.6f}."
    )
    with open(os.path.join(OUT, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
