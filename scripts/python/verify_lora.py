#!/usr/bin/env python3
"""Verify a LoRA adapter and a merged export written by the trainer, with transformers + PEFT.

    .venv-py/bin/python scripts/python/verify_lora.py DIR [--atol 1e-5] [--merged-atol 1e-5]

DIR holds
    base/                  the base model (HF directory: config.json + model.safetensors)
    adapter/               our PEFT adapter (adapter_config.json + adapter_model.safetensors)
    merged/                our merged export (HF directory)
    expected.safetensors   input_ids [B, T] I64 and logits [B, T, V] (our logits of base + adapter);
                           optionally merged_logits (our logits of the merged model)

Checks, each printed:
 1. `PeftModel.from_pretrained(<Arch>ForCausalLM.from_pretrained(base/), adapter/)` (the concrete
    class from base/config.json's `architectures`, HF_HUB_OFFLINE=1; never AutoModel, which makes
    PEFT look for an adapter on the Hub) loads without missing or unexpected keys, every
    tensor in adapter_model.safetensors lands in the model unchanged and every LoRA tensor of the
    model is in the file (so a load that applies nothing fails). Names must be PEFT's on-disk
    ones (`...q_proj.lora_A.weight`): PEFT 0.21 also accepts `...lora_A.default.weight` and loads it,
    but this check reports such names as missing/unexpected;
 2. its logits on input_ids match `logits`: max abs diff <= --atol;
 3. merged/ loads with the concrete class (no missing/unexpected/mismatched keys) and its logits
    match `merged_logits` if present, else `logits`: max abs diff <= --merged-atol.
Exit status 0 if all pass, 1 otherwise. The last line printed is a JSON summary.
Forward: f32 (--dtype), eager attention (--attn), use_cache=False.
"""
import argparse
import json
import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import PeftModel  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


class Checks:
    """Named checks, each printed as it is made (`ok` or `FAIL`, then its figures) and kept in
    `summary["checks"]`; `finish()` prints the summary as the last line and exits 0 if all
    passed, 1 otherwise."""

    def __init__(self, summary):
        self.summary, self.ok = summary, True
        summary["checks"] = {}

    def __call__(self, name, passed, **info):
        self.ok &= bool(passed)
        self.summary["checks"][name] = dict(passed=bool(passed), **info)
        extra = ", ".join(f"{k} {v:.3e}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items())
        print(f"{'ok  ' if passed else 'FAIL'} {name}: {extra}", flush=True)

    def logits(self, name, got, want, atol, beside, **info):
        """Check `name`: `got` has `want`'s shape and lies within `atol` of it (max abs diff);
        `beside` maps a figure's name to logits whose distance from `got` is reported too."""
        if got.shape != want.shape:
            self(name, False, shape=list(got.shape), ours=list(want.shape))
            return
        diff = (got - want).abs().max().item()
        far = {k: (got - t).abs().max().item() for k, t in beside.items()}
        self(name, diff <= atol, **info, max_abs_diff=diff, atol=atol, **far)

    def finish(self):
        self.summary["ok"] = self.ok
        print(json.dumps(self.summary))
        sys.exit(0 if self.ok else 1)


def model_class(d):
    with open(os.path.join(d, "config.json")) as f:
        archs = json.load(f).get("architectures") or ["LlamaForCausalLM"]
    return getattr(transformers, archs[0])


def load_hf(d, dtype, attn):
    model, info = model_class(d).from_pretrained(
        d, dtype=dtype, attn_implementation=attn, output_loading_info=True, local_files_only=True
    )
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    return model.eval(), bad


def logits_of(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=False).logits.float()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--atol", type=float, default=1e-5, help="max abs logit diff, base + adapter")
    ap.add_argument("--merged-atol", type=float, default=1e-5, help="max abs logit diff, merged")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--attn", default="eager", help="attn_implementation (eager, sdpa)")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    # PEFT looks for the base config at base_model_name_or_path (relative to the cwd) to see whether
    # the vocabulary was resized; harmless here
    warnings.filterwarnings("ignore", message="Could not find a config file")
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    dtype = DTYPES[args.dtype]

    d = args.dir
    expected = load_file(os.path.join(d, "expected.safetensors"))
    input_ids = expected["input_ids"].to(torch.int64)
    ours = expected["logits"].float()
    summary = {"transformers": transformers.__version__, "peft": peft.__version__}
    check = Checks(summary)

    # 1-2: base + adapter through PEFT
    base, bad = load_hf(os.path.join(d, "base"), dtype, args.attn)
    check("base loads", not bad, problems=json.dumps(bad) if bad else "none")
    base_logits = logits_of(base, input_ids)
    adapter_dir = os.path.join(d, "adapter")
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=False).eval()
    on_disk = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    loaded = get_peft_model_state_dict(model)
    missing = sorted(set(loaded) - set(on_disk))
    unexpected = sorted(set(on_disk) - set(loaded))
    changed = sorted(
        k for k in set(on_disk) & set(loaded) if not torch.equal(on_disk[k].to(loaded[k].dtype), loaded[k].cpu())
    )
    n_lora = sum(1 for k in loaded if ".lora_" in k)
    check(
        "adapter tensors",
        not missing and not unexpected and not changed and n_lora > 0,
        in_file=len(on_disk),
        lora_tensors=n_lora,
        missing=missing[:5],
        unexpected=unexpected[:5],
        changed=changed[:5],
    )
    peft_logits = logits_of(model, input_ids)
    check.logits("adapter logits", peft_logits, ours, args.atol, {"adapter_vs_base": base_logits})

    # 3: merged export
    merged, bad = load_hf(os.path.join(d, "merged"), dtype, args.attn)
    check("merged loads", not bad, problems=json.dumps(bad) if bad else "none")
    ref_name = "merged_logits" if "merged_logits" in expected else "logits"
    ref = expected[ref_name].float()
    merged_logits = logits_of(merged, input_ids)
    check.logits(
        "merged logits", merged_logits, ref, args.merged_atol, {"merged_vs_peft": peft_logits}, against=ref_name
    )
    check.finish()


if __name__ == "__main__":
    main()
