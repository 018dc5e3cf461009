"""Token-embedding backward in Triton: `dW[v] = sum of dy[p] over the positions p with ids[p] == v`.

The positions sorted by id, ascending position within an id (`ORDER [N]`), and where each id's
positions start in it (`START [V]`; id `v`'s segment is `ORDER[START[v]:START[v + 1]]`, the
last one ending at `N`) are computed on the host from the batch's ids by a counting sort
(`Segments::new`, candle-fused/src/embedding.rs), so nothing is read back from the device.

Program `(v, q)` owns row `v` of `dW` and columns `[BLOCK_C q, ..)`: it adds its segment's rows
of `dy` (UNROLL at a time, loaded together, added one after the other) in that order into an f32 accumulator starting at 0 and stores it once, rounded to the
table's dtype. Rows of ids absent from the batch (empty segments) are written as zeros by the
same program, so `dW` needs no memset: one launch writes every element once, no atomics. The
CPU kernel (`scatter_add`) adds the same f32 values in the same order from 0, so the results
are its bits (f32 adds only: no contraction to change).

The forward is a gather (a copy, no arithmetic): Candle's `index_select` on the GPU, no Triton
kernel.

Layout contract (`candle_fused::cuda_kernels::embedding`): dy `[N, C]`, dW `[V, C]`
contiguous; ORDER, START u32; every pointer 16-byte aligned; sizes any value (offsets in i64).
"""
import triton
import triton.language as tl

BLOCK_C = 256
UNROLL = 8
NUM_WARPS = 2


@triton.jit
def embedding_bwd(DY, ORDER, START, DW, N, V, C, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < C
    first = tl.load(START + row).to(tl.int32)
    end = tl.load(START + row + 1, mask=row + 1 < V, other=N).to(tl.int32)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    # UNROLL rows of the segment per trip: their loads do not depend on the sum, so they are in
    # flight together (a frequent id, e.g. padding, is a long serial chain otherwise); the adds
    # stay in order. Past the segment's end a row loads as +0.0, and `acc + 0.0` is `acc`
    # (acc is never -0.0: it starts at +0.0 and round-to-nearest gives +0.0 for x + (-x)).
    for k in range(first, end, UNROLL):
        for j in tl.static_range(UNROLL):
            live = k + j < end
            p = tl.load(ORDER + k + j, mask=live, other=0).to(tl.int64)
            # `ok & live` as one comparison (the interpreter refuses a vector & scalar mask)
            row_ok = cols < tl.where(live, C, 0)
            acc += tl.load(DY + p * C + cols, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(DW + row.to(tl.int64) * C + cols, acc.to(DW.dtype.element_ty), mask=ok)


AOT = [
    dict(fn=embedding_bwd, num_warps=NUM_WARPS, grid=f"(V, cdiv(C, {BLOCK_C}), 1)",
         constexprs={"BLOCK_C": BLOCK_C, "UNROLL": UNROLL},
         params=[("DY", "*{io}", "in [N, C]"), ("ORDER", "*u32", "in [N]"),
                 ("START", "*u32", "in [V]"), ("DW", "*{io}", "out [V, C]"),
                 ("N", "i32", "ids"), ("V", "i32", "table rows"), ("C", "i32", "columns")]),
]

# Interpreter check: dw bit-identical ("exact") for every dtype, for the reason above (for bf16
# the kernel stores f32 and the driver rounds to nearest even, as `cvt.rn.bf16.f32` does).
# The reference went through Candle's backprop, which adds each op's gradient to a zero tensor
# (`0 + (-0) = +0`); `interpret` does the same (only the sign of a zero can change).
ERROR = {"dw": "exact"}
TOL = {"f32": {"dw": 0}, "bf16": {"dw": 0}, "f16": {"dw": 0}}


def segments(ids, v):
    """`(ORDER, START)` of `ids` (numpy), as the Rust counting sort makes them."""
    import numpy
    order = numpy.argsort(ids, kind="stable").astype(numpy.uint32)
    counts = numpy.bincount(ids, minlength=v)
    start = numpy.concatenate([[0], numpy.cumsum(counts)[:-1]]).astype(numpy.uint32)
    return order, start


def interpret(t, out_dtype):
    """`embedding_bwd` on the vectors `t` (`ids [N]`, `dy [N, C]`, the table `w [V, C]` for its
    size) under the interpreter."""
    import torch
    ids = t["ids"].to(torch.int64).numpy()
    dy, (v, c) = t["dy"], t["w"].shape
    n = ids.shape[0]
    order, start = segments(ids, v)
    order, start = torch.from_numpy(order), torch.from_numpy(start)
    dw = torch.empty((v, c), dtype=out_dtype)
    embedding_bwd[(v, triton.cdiv(c, BLOCK_C))](dy, order, start, dw, n, v, c, BLOCK_C=BLOCK_C,
                                                 UNROLL=UNROLL)
    return {"dw": dw + 0.0}
