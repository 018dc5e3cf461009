"""Fused in-place AdamW and the sum of squares of a gradient (for the global grad norm), in
Triton.

    g' = grad_scale g
    m  = b1 m + (1 - b1) g'                     (exp_avg, f32, in place)
    v  = b2 v + (1 - b2) g'^2                   (exp_avg_sq, f32, in place)
    p  = p (1 - lr wd) - (lr / bc1) m / (sqrt(v / bc2) + eps)     (param, f32, in place)

The CPU kernel (candle-fused/src/adamw.rs `adamw_update`) makes three passes (Candle's in-place
ops write one destination each); this kernel makes one pass, reading the gradient (in its
dtype: f32, bf16 or f16) and the three f32 tensors and writing the three. Per element the
operations and their order are the CPU's: `m * b1 + (g * gs) * (1 - b1)`, `v * b2 + (g' * g') *
(1 - b2)`, `p * decay - (m * step_size) / (sqrt(v * inv_bc2) + eps)`, every constant an f32
rounded as the CPU rounds it (the launcher gets them from
`candle_fused::cuda_kernels::adamw::scalars`), the square root and the division correctly
rounded (`sqrt_rn`, `div_rn`; Triton's defaults are approximate on the GPU), no FMA
contraction: the results are bit-identical.

Sum of squares (the CPU's `sum_of_squares`, whose square root over all gradients is
`global_norm`, and `clip_coefficient(norm, max_norm)` the `grad_scale` above): `sumsq_partial`
adds `x^2` over fixed blocks of 1024 elements in f64 (an f32 square is exact in f64) into
`PARTIAL` (`[P]` f64, `P = cdiv(E, 1024)`), and `sumsq_total` adds the partials in a fixed order
in f64 and rounds once to f32. The CPU adds the same f64 squares in another fixed order (8
lanes over blocks of 8192); both f64 sums are within ~1e-16 relative of the exact one, so the
f32 results are equal unless the sum lies within that of an f32 rounding boundary. No atomics:
the same bits on every run.

Layout contract (`candle_fused::cuda_kernels::adamw`): param, exp_avg, exp_avg_sq f32, grad in
the variant's dtype, all contiguous, flattened to `[E]`; every pointer 16-byte aligned; `E` any
value (< 2^31).

Multi-tensor forms (the CPU's `adamw_update_multi` / `sum_of_squares_multi`): the kernels above
take one tensor per launch, so a model of N parameters costs N `adamw_update` launches and 2 N
sum-of-squares launches (plus N - 1 adds) per step. `adamw_update_multi`,
`sumsq_partial_multi` and `sumsq_total_multi` take a small i64 table of a group's tensors
(device addresses, element counts, prefix sums of their blocks) built on the host each step
and run one program per block of every tensor: one launch per gradient dtype for the update,
one per gradient dtype for the partial sums of squares and one for the totals, with the bits
of the per-tensor kernels:

* `adamw_update_multi`: program `pid` finds its tensor `t` by a binary search of the block
  prefix sums and steps block `pid - first_block[t]` of it as `adamw_update` does, with the
  factor `decay` where the tensor's flag is set and 1 where it is not (what the per-tensor
  kernel gets for a weight decay of 0: `1 - lr 0 = 1`).
* `sumsq_partial_multi`: the f64 sum of `x^2` over block `b` of tensor `t`, as
  `sumsq_partial`, stored at `PARTIAL[part_start[t] + b]` (launches for several dtypes fill
  one buffer).
* `sumsq_total_multi`: one program; for each tensor in the group's order its partials summed
  as `sumsq_total` sums them, rounded to f32, and added to the running f32 total: the
  per-tensor kernels followed by f32 adds in order.

Tables (i64, row-major; every address 16-byte aligned): `adamw_update_multi` `[T, 8]` (param,
grad, exp_avg, exp_avg_sq addresses, elements, first block, decay flag 0/1, 0);
`sumsq_partial_multi` `[T, 4]` (gradient address, elements, first block, first partial);
`sumsq_total_multi` `[T + 1]` (prefix sums of the partial counts). `GRAD0` is any gradient of
the variant's dtype (the group's first): its type types the gradient loads, nothing is read
through it. These are checked in the interpreter (the interpreter reads host memory at the
raw addresses) and compiled by `ptxas`, but not yet in `AOT`: the Rust launch tables bind grid
sizes from tensor shapes only, and the table is a launch argument of a new kind.
"""
import triton
import triton.language as tl


@triton.jit
def adamw_update(PARAM, GRAD, EXP_AVG, EXP_AVG_SQ, E, grad_scale, beta1, one_minus_beta1,
                 beta2, one_minus_beta2, decay, step_size, inv_bc2, eps, BLOCK: tl.constexpr):
    """Program `p`: one AdamW step on elements `[p * BLOCK, (p + 1) * BLOCK)`, in place."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    g = tl.load(GRAD + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
    m = tl.load(EXP_AVG + offs, mask=mask, other=0.0)
    v = tl.load(EXP_AVG_SQ + offs, mask=mask, other=0.0)
    p = tl.load(PARAM + offs, mask=mask, other=0.0)
    m = m * beta1 + g * one_minus_beta1
    v = v * beta2 + (g * g) * one_minus_beta2
    denom = tl.sqrt_rn(v * inv_bc2) + eps
    p = p * decay - tl.div_rn(m * step_size, denom)
    tl.store(EXP_AVG + offs, m, mask=mask)
    tl.store(EXP_AVG_SQ + offs, v, mask=mask)
    tl.store(PARAM + offs, p, mask=mask)


@triton.jit
def sumsq_partial(X, PARTIAL, E, BLOCK: tl.constexpr):
    """Program `p`: `PARTIAL[p] = sum x^2` over elements `[p * BLOCK, (p + 1) * BLOCK)`, in f64."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < E, other=0.0).to(tl.float64)
    tl.store(PARTIAL + pid, tl.sum(x * x, axis=0))


@triton.jit
def sumsq_total(PARTIAL, OUT, P, BLOCK_P: tl.constexpr):
    """One program: `OUT[0] = sum PARTIAL` (f64, tiles of BLOCK_P partials in order), as f32."""
    acc = tl.zeros([BLOCK_P], dtype=tl.float64)
    for start in range(0, P, BLOCK_P):
        offs = start + tl.arange(0, BLOCK_P)
        acc += tl.load(PARTIAL + offs, mask=offs < P, other=0.0)
    tl.store(OUT, tl.sum(acc, axis=0).to(tl.float32))


@triton.jit
def _find(TABLE, T, WIDTH: tl.constexpr, COL: tl.constexpr, pid):
    """The last row `t` of `TABLE` (`[T, WIDTH]`) whose column `COL` (increasing) is <= pid."""
    lo = 0
    hi = T
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go = tl.load(TABLE + mid * WIDTH + COL) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def adamw_update_multi(TABLE, GRAD0, T, NB, grad_scale, beta1, one_minus_beta1, beta2,
                       one_minus_beta2, decay, step_size, inv_bc2, eps, BLOCK: tl.constexpr):
    """Program `pid` (of `NB`, the group's blocks): one AdamW step on one block of one tensor
    of the table, in place. `GRAD0`: the first gradient, which gives the variant's dtype."""
    pid = tl.program_id(0).to(tl.int64)
    if pid >= NB:
        return
    t = _find(TABLE, T, 8, 5, pid)
    row = TABLE + t * 8
    param = tl.load(row).to(tl.pointer_type(tl.float32))
    grad = tl.load(row + 1).to(tl.pointer_type(GRAD0.dtype.element_ty))
    exp_avg = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    exp_avg_sq = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    e = tl.load(row + 4)
    first = tl.load(row + 5)
    dec = tl.where(tl.load(row + 6) != 0, decay, 1.0)
    offs = (pid - first) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < e
    g = tl.load(grad + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
    m = tl.load(exp_avg + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq + offs, mask=mask, other=0.0)
    p = tl.load(param + offs, mask=mask, other=0.0)
    m = m * beta1 + g * one_minus_beta1
    v = v * beta2 + (g * g) * one_minus_beta2
    denom = tl.sqrt_rn(v * inv_bc2) + eps
    p = p * dec - tl.div_rn(m * step_size, denom)
    tl.store(exp_avg + offs, m, mask=mask)
    tl.store(exp_avg_sq + offs, v, mask=mask)
    tl.store(param + offs, p, mask=mask)


@triton.jit
def sumsq_partial_multi(TABLE, PARTIAL, GRAD0, T, NB, BLOCK: tl.constexpr):
    """Program `pid` (of `NB`): `PARTIAL[part_start[t] + b] = sum x^2` over block `b` of
    tensor `t`, f64."""
    pid = tl.program_id(0).to(tl.int64)
    if pid >= NB:
        return
    t = _find(TABLE, T, 4, 2, pid)
    row = TABLE + t * 4
    x_ptr = tl.load(row).to(tl.pointer_type(GRAD0.dtype.element_ty))
    e = tl.load(row + 1)
    b = pid - tl.load(row + 2)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < e, other=0.0).to(tl.float64)
    tl.store(PARTIAL + tl.load(row + 3) + b, tl.sum(x * x, axis=0))


@triton.jit
def sumsq_total_multi(PARTS, PARTIAL, OUT, T, BLOCK_P: tl.constexpr):
    """One program: `OUT[0]` = the f32 sum, in order, of each tensor's partials summed in f64
    (tiles of BLOCK_P partials, as `sumsq_total`) and rounded to f32."""
    total = 0.0
    for t in range(0, T):
        start = tl.load(PARTS + t)
        end = tl.load(PARTS + t + 1)
        acc = tl.zeros([BLOCK_P], dtype=tl.float64)
        for s in range(start, end, BLOCK_P):
            offs = s + tl.arange(0, BLOCK_P)
            acc += tl.load(PARTIAL + offs, mask=offs < end, other=0.0)
        total += tl.sum(acc, axis=0).to(tl.float32)
    tl.store(OUT, total)


# The fixed configuration compiled ahead of time; the Rust launch table is
# candle-fused/src/cuda_kernels/adamw.rs.
BLOCK = 1024
SUMSQ_BLOCK = 1024
TOTAL_BLOCK_P = 256

SCALARS = ["grad_scale", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "decay",
           "step_size", "inv_bc2", "eps"]
AOT = [
    dict(fn=adamw_update, num_warps=4, grid=f"(cdiv(E, {BLOCK}), 1, 1)",
         constexprs={"BLOCK": BLOCK},
         params=[("PARAM", "*fp32", "in/out [E] f32"), ("GRAD", "*{io}", "in [E]"),
                 ("EXP_AVG", "*fp32", "in/out [E] f32"), ("EXP_AVG_SQ", "*fp32", "in/out [E] f32"),
                 ("E", "i32", "elements")]
         + [(s, "fp32", "f32 constant (cuda_kernels::adamw::scalars)") for s in SCALARS]),
    dict(fn=sumsq_partial, num_warps=4, grid=f"(cdiv(E, {SUMSQ_BLOCK}), 1, 1)",
         constexprs={"BLOCK": SUMSQ_BLOCK},
         params=[("X", "*{io}", "in [E]"), ("PARTIAL", "*fp64", "out [P] f64"),
                 ("E", "i32", "elements")]),
    dict(fn=sumsq_total, num_warps=4, grid="(1, 1, 1)", dtypes=("f32",),
         constexprs={"BLOCK_P": TOTAL_BLOCK_P},
         params=[("PARTIAL", "*fp64", "in [P] f64"), ("OUT", "*fp32", "out [1] f32"),
                 ("P", "i32", "partials")]),
    # The multi-tensor forms (one launch per gradient dtype group; `cuda_kernels::adamw`):
    # TABLE rows are i64 device addresses and sizes (see the kernels); NB, the group's
    # blocks, is the grid; GRAD0 the group's first gradient (the variant's dtype).
    dict(fn=adamw_update_multi, num_warps=4, grid="(NB, 1, 1)",
         constexprs={"BLOCK": BLOCK},
         params=[("TABLE", "*i64", "in [T, W] i64: param, grad, exp_avg, exp_avg_sq, E, first "
                  "block, decay flag, 0"),
                 ("GRAD0", "*{io}", "in [G]: the first gradient"),
                 ("T", "i32", "tensors"), ("NB", "i32", "blocks: sum of cdiv(E, BLOCK)")]
         + [(s, "fp32", "f32 constant (cuda_kernels::adamw::scalars)") for s in SCALARS]),
    dict(fn=sumsq_partial_multi, num_warps=4, grid="(NB, 1, 1)",
         constexprs={"BLOCK": SUMSQ_BLOCK},
         params=[("TABLE", "*i64", "in [T, W] i64: x, E, first block, first partial"),
                 ("PARTIAL", "*fp64", "out [P] f64"),
                 ("GRAD0", "*{io}", "in [G]: the first gradient"),
                 ("T", "i32", "tensors"), ("NB", "i32", "blocks: sum of cdiv(E, BLOCK)")]),
    dict(fn=sumsq_total_multi, num_warps=4, grid="(1, 1, 1)", dtypes=("f32",),
         constexprs={"BLOCK_P": TOTAL_BLOCK_P},
         params=[("PARTS", "*i64", "in [T1] i64: each tensor's first partial, then P"),
                 ("PARTIAL", "*fp64", "in [P] f64"), ("OUT", "*fp32", "out [1] f32"),
                 ("T", "i32", "tensors")]),
]

# Interpreter check. param, exp_avg, exp_avg_sq: bit-identical ("exact": no element differs)
# for every gradient dtype: the same f32 operations in the same order (IEEE add, multiply,
# correctly rounded sqrt and divide, no FMA contraction). sumsq: elementwise relative ("elem"):
# two f64 sums in different orders rounded to f32, equal unless the sum is within ~1e-16 of an
# f32 rounding boundary, then one f32 ulp apart: 2^-23 relative at most (expected 0).
# Group files (`adamw.<dtype>.group`, the multi-tensor kernels): param, exp_avg, exp_avg_sq
# exact as above; sumsq_group ("elem"): each of the six tensors' f32 sums within 2^-23 of the
# CPU's, and each f32 add of them in order may then round the other way: 8 * 2^-23 bounds the
# total (expected 0). `interpret` also requires the multi kernels to agree bit for bit with
# the per-tensor kernels (the update and the total).
ERROR = {"param": "exact", "exp_avg": "exact", "exp_avg_sq": "exact", "sumsq": "elem",
         "sumsq_group": "elem"}
TOL = {dt: {"param": 0, "exp_avg": 0, "exp_avg_sq": 0, "sumsq": 2.0**-23,
            "sumsq_group": 8 * 2.0**-23}
       for dt in ("f32", "bf16", "f16")}


def _split(flat, sizes):
    """Separate allocations (distinct addresses) holding `flat`'s pieces."""
    out, at = [], 0
    for n in sizes:
        out.append(flat[at:at + n].clone())
        at += n
    return out


def _per_tensor(ps, gs, ms, vs, flags, scalars):
    """The group stepped and summed by `adamw.py`'s per-tensor kernels (copies)."""
    import torch
    ps, ms, vs = ([x.clone() for x in xs] for xs in (ps, ms, vs))
    total = None
    for p, g, m, v, f in zip(ps, gs, ms, vs, flags):
        e = g.numel()
        s = list(scalars)
        s[5] = s[5] if f else 1.0
        adamw_update[(triton.cdiv(e, BLOCK),)](p, g, m, v, e, *s, BLOCK=BLOCK)
        n = triton.cdiv(e, SUMSQ_BLOCK)
        partial = torch.empty(n, dtype=torch.float64)
        sumsq_partial[(n,)](g, partial, e, BLOCK=SUMSQ_BLOCK)
        out = torch.empty(1, dtype=torch.float32)
        sumsq_total[(1,)](partial, out, n, BLOCK_P=TOTAL_BLOCK_P)
        total = out if total is None else total + out
    return ps, ms, vs, total


def _interpret_group(t):
    """The group of the file (`sizes`, `decay` flags, the concatenated `param_in`,
    `exp_avg_in`, `exp_avg_sq_in`, `grad`, and `scalars`) stepped by `adamw_update_multi`
    (one launch) and its gradients summed by `sumsq_partial_multi` (two launches, the group
    split in two, into one buffer) and `sumsq_total_multi`, under the interpreter; checked
    bit for bit against the per-tensor kernels."""
    import torch
    sizes = [int(n) for n in t["sizes"]]
    flags = [int(f) for f in t["decay"]]
    ps, ms, vs, gs = (_split(t[k], sizes) for k in
                      ("param_in", "exp_avg_in", "exp_avg_sq_in", "grad"))
    scalars = [float(s) for s in t["scalars"]]
    want = _per_tensor(ps, gs, ms, vs, flags, scalars)
    rows, first = [], 0
    for p, g, m, v, f in zip(ps, gs, ms, vs, flags):
        rows.append([p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), g.numel(), first,
                     f, 0])
        first += triton.cdiv(g.numel(), BLOCK)
    table = torch.tensor(rows, dtype=torch.int64)
    adamw_update_multi[(first,)](table, gs[0], len(sizes), first, *scalars, BLOCK=BLOCK)
    counts = [triton.cdiv(n, SUMSQ_BLOCK) for n in sizes]
    parts = [0]
    for c in counts:
        parts.append(parts[-1] + c)
    partial = torch.full((parts[-1],), float("nan"), dtype=torch.float64)
    half = len(sizes) // 2
    for lo, hi in ((0, half), (half, len(sizes))):
        rows, first = [], 0
        for i in range(lo, hi):
            rows.append([gs[i].data_ptr(), sizes[i], first, parts[i]])
            first += counts[i]
        sumsq_partial_multi[(first,)](torch.tensor(rows, dtype=torch.int64), partial, gs[lo],
                                      hi - lo, first, BLOCK=SUMSQ_BLOCK)
    out = torch.empty(1, dtype=torch.float32)
    sumsq_total_multi[(1,)](torch.tensor(parts, dtype=torch.int64), partial, out, len(sizes),
                            BLOCK_P=TOTAL_BLOCK_P)
    bits = lambda x: x.contiguous().view(torch.int32)
    for name, got, ref in zip(("param", "exp_avg", "exp_avg_sq"), (ps, ms, vs), want):
        for i, (a, b) in enumerate(zip(got, ref)):
            assert torch.equal(bits(a), bits(b)), f"{name} {i}: multi != per-tensor kernel"
    assert torch.equal(bits(out), bits(want[3])), "sumsq: multi != per-tensor kernels"
    return {"param": torch.cat(ps), "exp_avg": torch.cat(ms), "exp_avg_sq": torch.cat(vs),
            "sumsq_group": out}


def interpret(t, out_dtype):
    """A group file (`sizes`): `_interpret_group`. Otherwise: the update on copies of the file's `param`, `exp_avg`, `exp_avg_sq` with its `grad` and
    `scalars` (the nine f32 constants), and the sum of squares of `grad`, under the
    interpreter. (`out_dtype` is unused: every output is f32.)"""
    import torch
    if "sizes" in t:
        return _interpret_group(t)
    grad = t["grad"].reshape(-1)
    e = grad.numel()
    p, m, v = (t[k + "_in"].reshape(-1).clone() for k in ("param", "exp_avg", "exp_avg_sq"))
    scalars = [float(s) for s in t["scalars"]]
    adamw_update[(triton.cdiv(e, BLOCK),)](p, grad, m, v, e, *scalars, BLOCK=BLOCK)
    n_partial = triton.cdiv(e, SUMSQ_BLOCK)
    partial = torch.empty(n_partial, dtype=torch.float64)
    sumsq_partial[(n_partial,)](grad, partial, e, BLOCK=SUMSQ_BLOCK)
    out = torch.empty(1, dtype=torch.float32)
    sumsq_total[(1,)](partial, out, n_partial, BLOCK_P=TOTAL_BLOCK_P)
    shape = t["grad"].shape
    return {"param": p.reshape(shape), "exp_avg": m.reshape(shape),
            "exp_avg_sq": v.reshape(shape), "sumsq": out}
