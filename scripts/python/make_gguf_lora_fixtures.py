#!/usr/bin/env python3
"""Reference GGUF LoRA adapters for `trainer export ADAPTER OUT.gguf --format gguf --gguf-lora`,
made by llama.cpp's own `convert_lora_to_gguf.py` (what `llama-cli --lora` loads).

    .venv-py/bin/python scripts/python/make_gguf_lora_fixtures.py [OUT_DIR]
        # OUT_DIR defaults to trainer/tests/fixtures/gguf (beside the base models it adapts)

Over two of `make_gguf_fixtures.py`'s tiny models (run that first): `llama` (q/k rows permuted
for llama.cpp's rotary layout, which applies to lora_B's rows) and `qwen2` (no permutation), a
PEFT adapter on every linear layer (r 8, alpha 16) with lora_A and lora_B both random, so that
every tensor is non-trivial, saved with `save_pretrained` in `lora_<model>/`. Each is converted
with `--base` pointing at its model to f32, f16, bf16 and q8_0; `expected.json` records every
metadata key and every tensor's type, shape and the sha256 of its bytes, as for the models
(`describe` of make_gguf_fixtures.py; the test leaves out `general.base_model.*` and
`general.tags`, which the converter derives from the path it was given). A third, `lora_llama_rslora`, uses rsLoRA (scale
alpha / sqrt(r)), which llama.cpp's converter writes with the plain alpha (its scale is
always alpha / r): its expected.json holds the converter's file with `adapter.lora.alpha`
replaced by alpha * sqrt(r), the value that gives llama.cpp PEFT's scale, which is what the
trainer writes. `cargo test` never runs this script.
"""
import json
import math
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_gguf_fixtures as base  # noqa: E402

TYPES = ["f32", "f16", "bf16", "q8_0"]
CASES = [("lora_llama", "llama", False, 11), ("lora_qwen2", "qwen2", False, 12),
         ("lora_llama_rslora", "llama", True, 13)]


def adapter(model_dir, rslora, seed):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                     use_rslora=rslora, task_type="CAUSAL_LM")
    pm = get_peft_model(m, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p) * 0.05)
    return pm


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else base.DEFAULT_OUT
    llama = base.converter()
    sys.path.insert(0, llama)
    sys.path.insert(1, os.path.join(llama, "gguf-py"))
    import gguf
    import peft
    import transformers
    for name, model_name, rslora, seed in CASES:
        model_dir = os.path.join(out, model_name)
        d = os.path.join(out, name)
        shutil.rmtree(d, ignore_errors=True)
        pm = adapter(model_dir, rslora, seed)
        pm.save_pretrained(d)
        os.remove(os.path.join(d, "README.md"))  # PEFT's model card template
        cfg_path = os.path.join(d, "adapter_config.json")
        cfg = json.load(open(cfg_path))
        cfg["base_model_name_or_path"] = "../" + model_name  # as PEFT resolves it: see the test
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")
        expected = {"llama_cpp": {"source": base.SDIST, "commit": base.llama_cpp_commit(llama)},
                    "transformers": transformers.__version__, "peft": peft.__version__,
                    "types": {}}
        with tempfile.TemporaryDirectory() as tmp:
            for t in TYPES:
                path = os.path.join(tmp, f"{t}.gguf")
                base.run_script(llama, "convert_lora_to_gguf.py",
                                [d, "--base", model_dir, "--outtype", t, "--outfile", path])
                described = base.describe(path, gguf)
                if rslora:
                    alpha = described["keys"]["adapter.lora.alpha"]
                    alpha["value"] = float(__import__("numpy").float32(16 * math.sqrt(8)))
                expected["types"][t] = described
        base.write_expected(name, d, expected)


if __name__ == "__main__":
    main()
