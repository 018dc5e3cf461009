#!/usr/bin/env python3
"""Verify a QLoRA adapter written by the trainer with PEFT over transformers + bitsandbytes.

    .venv-bnb/bin/python scripts/python/verify_qlora.py [DIR] [--atol 1e-5] [--loss-atol 1e-5]

(`.venv-bnb`: scripts/python/setup_bnb.sh, bitsandbytes 0.50.2 over the pinned torch, transformers, PEFT.)

DIR (default trainer/tests/fixtures/qlora/ours, written by the Rust test
`our_qlora_adapter_matches_the_peft_verified_golden` in trainer/tests/qlora_adapter.rs) holds
    adapter/               our PEFT adapter directory (`trainer export` of a `--base-quant nf4` run
                           over the tiny Llama of trainer/tests/fixtures/lora/base, double
                           quantization, lm_head kept)
    expected.safetensors   input_ids, labels, our logits and loss of the 4-bit base + adapter (f32)

The 4-bit base, two ways, each checked:
  - `quantized`: ../lora/base loaded with `BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=float32)`
    on the CPU (bitsandbytes quantizes it as it loads);
  - `saved`: ../base_dq, that model as transformers saved it in 4 bits (read as saved).
For each: `PeftModel.from_pretrained(base, DIR/adapter)` (HF_HUB_OFFLINE=1) puts every tensor of
adapter_model.safetensors into the model unchanged and every LoRA tensor of the model comes from
the file; its logits on input_ids are within --atol of ours and its loss (transformers' shifted
cross-entropy on labels) within --loss-atol. f32 on both sides: a Linear4bit with compute dtype
float32 is a linear over its dequantized weight, as ours is, so the differences are f32 sums in
another order. The Linear4bit layers are kept in training mode (everything else in eval mode, so
no dropout): in eval mode without gradients, on a CPU with avx512_bf16, bitsandbytes repacks
their weights for its CPU inference kernel, which is not the dequantize-then-linear PEFT's
training step runs; that path's distance from ours is printed last, as a figure (`info`), not
checked. Exit status 0 if all pass, 1 otherwise; the last line printed is a JSON summary.
"""
import argparse
import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bitsandbytes as bnb  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import PeftModel  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import BitsAndBytesConfig, LlamaForCausalLM  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from verify_lora import Checks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "trainer", "tests", "fixtures")


def load_4bit(way):
    """The tiny Llama in 4 bits: quantized by bitsandbytes on load, or read as saved."""
    kw = dict(dtype=torch.float32, device_map="cpu", attn_implementation="eager", local_files_only=True)
    if way == "saved":
        return LlamaForCausalLM.from_pretrained(os.path.join(FIXTURES, "qlora", "base_dq"), **kw)
    cfg = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    return LlamaForCausalLM.from_pretrained(os.path.join(FIXTURES, "lora", "base"), quantization_config=cfg, **kw)


def adapter_problems(model, adapter_dir):
    """(missing, unexpected, changed, number of LoRA tensors) between the adapter file and the
    adapter PEFT loaded into `model`."""
    on_disk = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    loaded = get_peft_model_state_dict(model)
    missing = sorted(set(loaded) - set(on_disk))
    unexpected = sorted(set(on_disk) - set(loaded))
    both = set(on_disk) & set(loaded)
    changed = sorted(k for k in both if not torch.equal(on_disk[k].to(loaded[k].dtype), loaded[k].cpu()))
    return missing, unexpected, changed, sum(1 for k in loaded if ".lora_" in k)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default=os.path.join(FIXTURES, "qlora", "ours"))
    ap.add_argument("--atol", type=float, default=1e-5, help="max abs logit difference")
    ap.add_argument("--loss-atol", type=float, default=1e-5, help="max abs loss difference")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    expected = load_file(os.path.join(args.dir, "expected.safetensors"))
    ids, labels = expected["input_ids"].to(torch.int64), expected["labels"].to(torch.int64)
    ours_logits, ours_loss = expected["logits"].float(), expected["loss"].float().item()
    adapter_dir = os.path.join(args.dir, "adapter")
    summary = {
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": bnb.__version__,
        "torch": torch.__version__,
    }
    check = Checks(summary)

    def layers_4bit(model, training):
        layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        for m in layers:
            m.train(training)
        return len(layers)

    for way in ["quantized", "saved"]:
        base = load_4bit(way).eval()
        n4 = layers_4bit(base, True)
        with torch.no_grad():
            base_logits = base(input_ids=ids, use_cache=False).logits.float()
        model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=False).eval()
        layers_4bit(model, True)
        missing, unexpected, changed, n_lora = adapter_problems(model, adapter_dir)
        check(
            f"{way}: adapter tensors",
            not missing and not unexpected and not changed and n_lora > 0 and n4 > 0,
            linear4bit=n4,
            lora_tensors=n_lora,
            missing=missing[:5],
            unexpected=unexpected[:5],
            changed=changed[:5],
        )
        with torch.no_grad():
            out = model(input_ids=ids, labels=labels, use_cache=False)
        logits = out.logits.float()
        if logits.shape != ours_logits.shape:
            check(f"{way}: logits", False, shape=list(logits.shape), ours=list(ours_logits.shape))
            continue
        diff = (logits - ours_logits).abs().max().item()
        moved = (logits - base_logits).abs().max().item()
        check(f"{way}: logits", diff <= args.atol, max_abs_diff=diff, atol=args.atol, adapter_vs_base=moved)
        loss_diff = abs(out.loss.item() - ours_loss)
        check(f"{way}: loss", loss_diff <= args.loss_atol, peft=out.loss.item(), ours=ours_loss, abs_diff=loss_diff)
        if way == "saved":
            layers_4bit(model, False)
            with torch.no_grad():
                packed = model(input_ids=ids, use_cache=False).logits.float()
            summary["info"] = {"cpu_inference_path_max_abs_logit_diff": (packed - ours_logits).abs().max().item()}
            print(f"info bitsandbytes' CPU inference path (eval mode): max abs logit diff {summary['info']['cpu_inference_path_max_abs_logit_diff']:.3e}")
    check.finish()


if __name__ == "__main__":
    main()
