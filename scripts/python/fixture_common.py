"""What the fixture scripts (make_*_fixtures.py) share: the gradient dump and the README."""

import os

import torch


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
