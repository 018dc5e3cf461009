//! What travels with a batch's rows beside its tokens (positions, document ids, the host copy
//! of the input ids), and the target id that does not count in the loss.

use std::ops::Range;
use std::sync::Arc;

use candle_core::Tensor;

/// Target id of a position that does not count in the loss (PyTorch's `ignore_index`; the
/// loss mask of a batch is folded into its targets as this id).
pub const IGNORE: u32 = u32::MAX;

/// What travels with a batch's rows: per-token positions and document ids (`u32 [B, T]`).
///
/// Absent means "positions `0..T` in every row, one document per row". With packed rows
/// (several examples in one row), positions restart at every example and tokens attend only
/// within their own document. Every executor hands a slice of the batch's rows the matching
/// rows of these tensors ([`Rows::narrow`]): a pipeline microbatch and a data-parallel shard
/// see exactly what the whole batch would.
#[derive(Clone, Debug, Default)]
pub struct Rows {
    /// Position of each token in its example, `u32 [B, T]`.
    pub positions: Option<Tensor>,
    /// Document id of each token, `u32 [B, T]`.
    pub doc_ids: Option<Tensor>,
    /// The rows' input token ids as the data source built them on the host (the batch's `x`
    /// before its upload): the token embedding orders its backward by them without reading
    /// `x` back from the device. Not counted by [`Rows::is_empty`].
    pub tokens: Option<HostTokens>,
}

/// Token ids `[B, T]` held on the host, row-major, beside the device tensor made from them
/// (see [`Rows::tokens`]); [`Rows::narrow`] keeps the two in step.
///
/// ```
/// use candle_data::HostTokens;
/// let t = HostTokens::new(vec![1, 2, 3, 4, 5, 6], 3);
/// assert_eq!(t.narrow(1, 1).ids(), &[4, 5, 6]);
/// ```
#[derive(Clone, Debug)]
pub struct HostTokens {
    ids: Arc<[u32]>,
    cols: usize,
    rows: Range<usize>,
}

impl HostTokens {
    /// Rows of `cols` ids each, row-major.
    pub fn new(ids: Vec<u32>, cols: usize) -> Self {
        let rows = 0..ids.len().checked_div(cols).unwrap_or(0);
        HostTokens {
            ids: ids.into(),
            cols,
            rows,
        }
    }

    /// Rows `start..start + len` of these (clamped to the rows held).
    pub fn narrow(&self, start: usize, len: usize) -> Self {
        let a = (self.rows.start + start).min(self.rows.end);
        HostTokens {
            rows: a..(a + len).min(self.rows.end),
            ..self.clone()
        }
    }

    /// The ids, flat.
    pub fn ids(&self) -> &[u32] {
        &self.ids[self.rows.start * self.cols..self.rows.end * self.cols]
    }
}

impl Rows {
    /// Rows `start..start + len` (of the tensors that are present).
    pub fn narrow(&self, start: usize, len: usize) -> candle_core::Result<Rows> {
        let rows = |t: &Option<Tensor>| t.as_ref().map(|t| t.narrow(0, start, len)).transpose();
        Ok(Rows {
            positions: rows(&self.positions)?,
            doc_ids: rows(&self.doc_ids)?,
            tokens: self.tokens.as_ref().map(|t| t.narrow(start, len)),
        })
    }

    /// The host copy of the rows' token ids, flat, if the data source kept one and it holds
    /// as many ids as `idx` (the input it was made for).
    pub fn host_tokens(&self, idx: &Tensor) -> Option<&[u32]> {
        let ids = self.tokens.as_ref().map(HostTokens::ids)?;
        (ids.len() == idx.elem_count()).then_some(ids)
    }

    /// Whether nothing travels with the rows (default positions, one document per row).
    pub fn is_empty(&self) -> bool {
        self.positions.is_none() && self.doc_ids.is_none()
    }
}
