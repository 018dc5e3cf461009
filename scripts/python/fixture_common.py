"""What the fixture scripts (make_*_fixtures.py) share: the deterministic setup, saving a
model's files, the gradient dump and the README."""

import os
import shutil
import tempfile

import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What a PEFT adapter's `save_pretrained` writes that the fixtures keep.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def deterministic():
    """Offline, one thread, deterministic algorithms and quiet transformers: the same bytes on
    every run."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def load_model(path, cls=transformers.AutoModelForCausalLM):
    """`cls.from_pretrained(path)` in f32 with eager attention, in eval mode; asserts that every
    weight matched (no missing, unexpected or mismatched key)."""
    model, info = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, (path, bad)
    return model.eval()


def save_files(model, d, files=("config.json", "model.safetensors")):
    """`model.save_pretrained` (safetensors) into a temporary folder, of which only `files` are
    copied into `d` (made here; it must not exist yet): no README, generation config or
    tokenizer. A saved config.json must name no absolute path."""
    os.makedirs(d)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for f in files:
            shutil.copy(os.path.join(tmp, f), d)
    if "config.json" in files:
        text = open(os.path.join(d, "config.json")).read()
        assert "/tmp" not in text and ROOT not in text, "absolute path in config.json"


def gradients(model, key=lambda name: name):
    """The gradient of each of `model`'s parameters that requires one, in parameter order, as
    an f32 copy keyed by `key(name)`; each must exist and be nonzero (a zero one means the
    parameter took no part in the loss)."""
    grads = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, n
            assert p.grad.abs().sum() > 0, f"zero gradient for {n}"
            grads[key(n)] = p.grad.detach().clone().to(torch.float32).contiguous()
    return grads


def save_readme(out_dir, lines):
    """`lines` joined by newlines as `out_dir/README.md`."""
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write("\n".join(lines))


def add_gradients(expected, model):
    """Every gradient of `model` into `expected` as `grad.<name>` (see `gradients`), then
    cleared; the parameter names, in order."""
    grads = gradients(model)
    expected.update({f"grad.{n}": g for n, g in grads.items()})
    model.zero_grad(set_to_none=True)
    return list(grads)
