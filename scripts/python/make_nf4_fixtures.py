"""NF4 reference fixtures for candle-fused's `nf4` module (tests/nf4.rs), made by bitsandbytes
0.50.2 on the CPU (venv: scripts/python/setup_bnb.sh).

    /work/venv-bnb/bin/python scripts/python/make_nf4_fixtures.py [OUT_DIR]

Writes OUT_DIR/nf4.safetensors (default candle-fused/tests/fixtures/nf4/): for each case NAME,

    NAME.input                        f32, the weight quantized
    NAME.weight                       u8 [n/2, 1], two codes a byte, the first in the high nibble
    NAME.weight.absmax                f32 [blocks] (plain) or u8 [blocks] (double quantization)
    NAME.weight.quant_map             f32 [16], the NF4 values
    NAME.weight.nested_absmax         f32 [nested blocks]      (double quantization only)
    NAME.weight.nested_quant_map      f32 [256], bitsandbytes' dynamic map    (idem)
    NAME.weight.quant_state.bitsandbytes__nf4   u8, the JSON of the other settings
    NAME.nested_offset                f32 [1], the mean subtracted from the absmaxes (idem)
    NAME.dequant_f32 / NAME.dequant_bf16 / NAME.dequant_f16   dequantize_4bit to each dtype

(the `weight*` names as transformers saves a 4-bit module's weight), and for N in MEAN_SIZES
`mean_N.absmax` (f32 [N]), `mean_N.offset` (f32 [1]), `mean_N.codes` (u8 [N]) and
`mean_N.nested_absmax`: the double quantization of a weight whose blocks have those absmaxes.

Cases: `random` (randn, 32 x 128), `edges` (one block of exact midpoints between NF4 values at
absmax 1, one of midpoints at absmax 2 with their neighbours one ulp either side, a block
holding an outlier, an all-zero block, a block whose absmax is a negative value), `tail`
(120 values: a last block of 56), and their double-quantized twins `random_dq` (75 x 256:
300 absmaxes: two nested blocks, the last of 44), `edges_dq`, `tail_dq`.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

import bitsandbytes as bnb
import bitsandbytes.functional as F

assert bnb.__version__ == "0.50.2", bnb.__version__

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "candle-fused/tests/fixtures/nf4"
OUT.mkdir(parents=True, exist_ok=True)
# One thread: torch's sum (the mean bitsandbytes subtracts before double quantization) adds
# in a fixed order then.
torch.set_num_threads(1)

NF4 = F.get_4bit_type("nf4", device="cpu").float()
# The midpoints as bitsandbytes' CPU quantizer computes them (f32).
MID = (NF4[:-1] + NF4[1:]) / 2


def edges() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    blocks = []
    # Block 0: absmax 1 (the scale is exact), every midpoint, its negative stays a midpoint
    # only where the table is symmetric: put the midpoints themselves, 1.0, -1.0, the values.
    b = torch.cat([MID, NF4, torch.tensor([1.0, -1.0])])
    b = torch.cat([b, torch.zeros(64 - b.numel())])
    blocks.append(b)
    # Block 1: absmax 2, the midpoints times 2 and one ulp either side of each.
    m2 = MID * 2
    up = torch.nextafter(m2, torch.full_like(m2, 10.0))
    down = torch.nextafter(m2, torch.full_like(m2, -10.0))
    b = torch.cat([torch.tensor([2.0]), m2, up, down])
    b = torch.cat([b, torch.zeros(64 - b.numel())])
    blocks.append(b)
    # Block 2: small values and one outlier (most codes collapse to the zero code).
    b = torch.randn(64, generator=g) * 0.01
    b[17] = 10.0
    blocks.append(b)
    # Block 3: all zero.
    blocks.append(torch.zeros(64))
    # Block 4: the absmax is a negative value.
    b = torch.randn(64, generator=g) * 0.1
    b[5] = -0.75
    blocks.append(b)
    # Block 5: values spread over [-1, 1] at absmax 1, one of them 1.
    b = torch.linspace(-1, 1, 64)
    blocks.append(b)
    return torch.stack(blocks).reshape(6, 64)


def cases():
    g = torch.Generator().manual_seed(0)
    yield "random", torch.randn(32, 128, generator=g) * 0.05
    yield "edges", edges()
    yield "tail", torch.randn(3, 40, generator=g)
    g = torch.Generator().manual_seed(2)
    yield "random_dq", torch.randn(75, 256, generator=g) * 0.02
    yield "edges_dq", edges()
    yield "tail_dq", torch.randn(3, 40, generator=g)


# Lengths of the absmax vectors whose mean is checked (`mean_N`): the scalar path (< 8), the
# 8-lane vectors with and without a tail, the cascade of 16-row levels.
MEAN_SIZES = [1, 3, 5, 6, 7, 8, 9, 31, 33, 100, 257, 1000, 5000]

tensors = {}
for name, w in cases():
    w = w.float().contiguous()
    double = name.endswith("_dq")
    q, state = F.quantize_4bit(w, blocksize=64, compress_statistics=double, quant_type="nf4")
    packed = state.as_dict(packed=True)
    tensors[f"{name}.input"] = w
    tensors[f"{name}.weight"] = q.contiguous()
    for key, value in packed.items():
        tensors[f"{name}.weight.{key}"] = value.contiguous()
    if double:
        tensors[f"{name}.nested_offset"] = state.offset.reshape(1).float()
        # The packed JSON holds the same offset.
        js = json.loads(bytes(packed["quant_state.bitsandbytes__nf4"].tolist()))
        assert np.float32(js["nested_offset"]) == state.offset.item()
    for dt, tag in [(torch.float32, "f32"), (torch.bfloat16, "bf16"), (torch.float16, "f16")]:
        st = F.QuantState.from_dict(dict(packed), device="cpu")
        st.dtype = dt
        tensors[f"{name}.dequant_{tag}"] = F.dequantize_4bit(q, st).contiguous()

# The offset of double quantization (torch's f32 mean of the absmaxes) for absmax vectors of
# several lengths: block i of the weight is [a_i, 0, ..., 0], so its absmax is a_i exactly.
g = torch.Generator().manual_seed(3)
for n in MEAN_SIZES:
    a = torch.rand(n, generator=g) * 2 + 0.01
    w = torch.zeros(n, 64)
    w[:, 0] = a
    q, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    tensors[f"mean_{n}.absmax"] = a.contiguous()
    tensors[f"mean_{n}.offset"] = state.offset.reshape(1).float()
    tensors[f"mean_{n}.codes"] = state.absmax.contiguous()
    tensors[f"mean_{n}.nested_absmax"] = state.state2.absmax.contiguous()

save_file(tensors, str(OUT / "nf4.safetensors"))
print("wrote", OUT / "nf4.safetensors", len(tensors), "tensors")
