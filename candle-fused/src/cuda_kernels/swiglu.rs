//! SwiGLU (`triton/swiglu.py`): `y = silu(gate) * up` and its two gradients, elementwise over
//! the flattened tensors (`[E]`; a packed `[.., 2I]` projection's halves are copied to
//! contiguous tensors first). Bit-identical to the CPU kernel (`crate::swiglu`).

use super::Elem::Io;
use super::{Extent, KernelSpec, Param};
use candle_core::DType;

/// Elements per program (`BLOCK`).
pub const BLOCK: usize = 1024;

const FWD: &[Param] = &[
    Param::Tensor("GATE", &["E"], Io),
    Param::Tensor("UP", &["E"], Io),
    Param::Tensor("Y", &["E"], Io),
    Param::Dim("E", "E"),
];
const BWD: &[Param] = &[
    Param::Tensor("GATE", &["E"], Io),
    Param::Tensor("UP", &["E"], Io),
    Param::Tensor("DY", &["E"], Io),
    Param::Tensor("DGATE", &["E"], Io),
    Param::Tensor("DUP", &["E"], Io),
    Param::Dim("E", "E"),
];

const GRID: [Extent; 3] = [Extent::cdiv(&["E"], BLOCK), Extent::ONE, Extent::ONE];

const fn swiglu(dtype: DType) -> [KernelSpec; 2] {
    [
        KernelSpec {
            family: "swiglu",
            entry: "swiglu_fwd",
            dtype,
            num_warps: 4,
            shared_bytes: [0; 2],
            grid: GRID,
            rules: &[],
            params: FWD,
        },
        KernelSpec {
            family: "swiglu",
            entry: "swiglu_bwd",
            dtype,
            num_warps: 4,
            shared_bytes: [0; 2],
            grid: GRID,
            rules: &[],
            params: BWD,
        },
    ]
}

const F: [KernelSpec; 2] = swiglu(DType::F32);
const B: [KernelSpec; 2] = swiglu(DType::BF16);
const H: [KernelSpec; 2] = swiglu(DType::F16);

/// SwiGLU forward and backward (`d_gate`, `d_up` in one pass), for f32, bf16 and f16.
pub const KERNELS: &[KernelSpec] = &[F[0], F[1], B[0], B[1], H[0], H[1]];
