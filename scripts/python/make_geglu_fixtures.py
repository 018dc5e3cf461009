"""GeGLU reference fixtures for candle-fused's `geglu` (tests/gated.rs), made by torch on the
CPU: Gemma's MLP activation as transformers computes it (`gelu_pytorch_tanh`, i.e.
`torch.nn.functional.gelu(gate, approximate="tanh") * up`).

    /work/venv-py/bin/python scripts/python/make_geglu_fixtures.py [OUT_DIR]

Writes OUT_DIR/geglu.safetensors (default candle-fused/tests/fixtures/geglu/), for DT in f64
and f32: `DT.gate`, `DT.up`, `DT.dy` (inputs, [13, 65]; the gate uniform in [-6, 6) with
tanh's tails and both zeros first), `DT.y` (the forward) and `DT.d_gate`, `DT.d_up`
(torch.autograd's gradients of `sum(y * dy)`), all in DT.
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "candle-fused/tests/fixtures/geglu"
OUT.mkdir(parents=True, exist_ok=True)
torch.set_num_threads(1)

TAILS = [-50.0, -10.0, -5.5, -0.0, 0.0, 5.5, 10.0, 50.0]
SHAPE = (13, 65)

g = torch.Generator().manual_seed(37)
gate = torch.rand(SHAPE, generator=g, dtype=torch.float64) * 12 - 6
gate.view(-1)[: len(TAILS)] = torch.tensor(TAILS, dtype=torch.float64)
up = torch.rand(SHAPE, generator=g, dtype=torch.float64) * 4 - 2
dy = torch.rand(SHAPE, generator=g, dtype=torch.float64) * 2 - 1

out = {}
for name, dt in (("f64", torch.float64), ("f32", torch.float32)):
    gt, ut = (t.to(dt).detach().clone().requires_grad_() for t in (gate, up))
    y = torch.nn.functional.gelu(gt, approximate="tanh") * ut
    d = dy.to(dt)
    (y * d).sum().backward()
    for k, v in (("gate", gt), ("up", ut), ("dy", d), ("y", y), ("d_gate", gt.grad),
                 ("d_up", ut.grad)):
        out[f"{name}.{k}"] = v.detach().contiguous()
save_file(out, OUT / "geglu.safetensors", metadata={"torch": torch.__version__})
print(f"wrote {OUT / 'geglu.safetensors'} (torch {torch.__version__})")
