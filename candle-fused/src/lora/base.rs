//! The frozen base of [`super`]'s op: a dense weight or a 4-bit one.

use crate::cpu::Elem;
use crate::linear::gemm::{gemm_raw, operand, Operand};
use crate::linear::{self, strided, Strided};
use crate::nf4::Nf4Weight;
use crate::op::cpu_of;
use crate::pool;
use crate::qlora::tiled::{add_dx_host, dx_composite, fwd_acc_host};
use candle_core::{bail, Result, Tensor};

/// The op's sizes: `in`, `out` and the rank `r`.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    pub(crate) n_in: usize,
    pub(crate) n_out: usize,
    pub(crate) r: usize,
}

/// `m`'s transpose as a GEMM operand's strides.
pub(super) fn tr(m: Strided) -> Strided {
    Strided { rs: m.cs, cs: m.rs }
}

/// A row-major `[_, n]` operand.
pub(super) fn rows_of(n: usize) -> Strided {
    Strided { rs: n, cs: 1 }
}

/// The frozen base weight of the op: a dense `[in, out]` view (read through its strides) or a
/// 4-bit `[out, in]` weight dequantized a tile at a time ([`crate::qlora`]).
pub(crate) enum Base {
    Dense(Tensor),
    Nf4(Nf4Weight),
}

/// [`Base`] on the host, as the kernels read it.
pub(super) enum BaseRef<'a, T> {
    Dense((&'a [T], Strided)),
    Nf4(&'a Nf4Weight),
}

impl Base {
    /// The dense weight, if dense (its storage is held while a kernel reads it).
    pub(super) fn dense(&self) -> Option<&Tensor> {
        match self {
            Base::Dense(w) => Some(w),
            Base::Nf4(_) => None,
        }
    }

    /// The base as the kernels of `T` read it, the dense storage from [`Base::dense`]'s
    /// `storage_and_layout`.
    pub(super) fn host<'a, T: Elem, G: std::ops::Deref<Target = candle_core::Storage>>(
        &'a self,
        guard: &'a Option<(G, &candle_core::Layout)>,
    ) -> Result<BaseRef<'a, T>> {
        Ok(match (self, guard) {
            (Base::Dense(_), Some((s, l))) => BaseRef::Dense(strided::<T>(cpu_of(s)?, l)?),
            (Base::Nf4(w), _) => BaseRef::Nf4(w),
            (Base::Dense(_), None) => bail!("candle-fused lora_linear: dense weight not held"),
        })
    }

    /// `g W_baseᵀ` for `g [N, out]` from plain ops, in `g`'s dtype (the fallback's backward).
    pub(super) fn dx_composite(&self, g: &Tensor) -> Result<Tensor> {
        match self {
            Base::Dense(w) => g.matmul(&w.t()?),
            Base::Nf4(w) => dx_composite(w, g),
        }
    }
}

impl<T: Elem> BaseRef<'_, T> {
    /// `x W (+ bias)` in the accumulation type, `x [N, in]`.
    pub(super) fn fwd_acc(&self, x: &[T], bias: Option<&[T]>, dims: Dims) -> Result<Vec<T::Acc>> {
        match *self {
            BaseRef::Dense(w) => Ok(linear::fwd_acc(x, w, bias, dims.n_in, dims.n_out)),
            BaseRef::Nf4(w) => fwd_acc_host(x, w, bias),
        }
    }

    /// `dx += g Wᵀ`, `g [N, out]` (row-major), `dx [N, in]` in the accumulation type.
    pub(super) fn add_dx(
        &self,
        dx: &mut [T::Acc],
        g: &Operand<'_, T::Acc>,
        dims: Dims,
    ) -> Result<()> {
        let Dims { n_in, n_out, .. } = dims;
        match *self {
            BaseRef::Dense((w, sw)) => {
                let rows = dx.len() / n_in;
                let wa = operand(w);
                // SAFETY: `dx` holds rows x n_in initialised elements, exclusively borrowed.
                unsafe {
                    gemm_raw(
                        rows,
                        n_in,
                        n_out,
                        dx.as_mut_ptr(),
                        true,
                        (g, rows_of(n_out)),
                        (&wa, tr(sw)),
                        pool::parts(),
                    )
                };
                Ok(())
            }
            BaseRef::Nf4(w) => add_dx_host::<T>(dx, g, w),
        }
    }
}
