//! Token-embedding backward (`triton/embedding.py`): `embedding_bwd`, one program per (table
//! row, column block) adding the row's segment of `dy` in f32 in the host's order (ascending
//! position) and writing the row once (zeros for absent ids: no memset, one launch).
//! Bit-identical to the CPU kernel (`crate::embedding`).

use super::Elem::{Io, U32};
use super::{Extent, KernelSpec, Param};
use candle_core::DType;

/// Columns per program (`BLOCK_C`).
pub const BLOCK_C: usize = 256;

const BWD: &[Param] = &[
    Param::Tensor("DY", &["N", "C"], Io),
    Param::Tensor("ORDER", &["N"], U32),
    Param::Tensor("START", &["V"], U32),
    Param::Tensor("DW", &["V", "C"], Io),
    Param::Dim("N", "N"),
    Param::Dim("V", "V"),
    Param::Dim("C", "C"),
];

const fn bwd(dtype: DType) -> KernelSpec {
    KernelSpec {
        family: "embedding",
        entry: "embedding_bwd",
        dtype,
        num_warps: 2,
        shared_bytes: [0; 2],
        grid: [
            Extent::of(&["V"]),
            Extent::cdiv(&["C"], BLOCK_C),
            Extent::ONE,
        ],
        rules: &[],
        params: BWD,
    }
}

/// The embedding backward for f32, bf16 and f16 tables.
pub const KERNELS: &[KernelSpec] = &[bwd(DType::F32), bwd(DType::BF16), bwd(DType::F16)];
