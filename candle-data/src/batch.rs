//! [`Batch`]: the token windows a [`DataSource`](super::DataSource) serves, with their
//! loss mask, row context and host copies.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, TensorId};

use super::Split;
use crate::error::{Error, Result};
use crate::{HostTokens, Rows, IGNORE};

/// One batch of training windows.
///
/// `x` and `y` are `u32` tensors of shape `[B, T]` on the requested device; `y` is `x` shifted
/// left by one token (row `i` of `y` is the continuation of row `i` of `x`).
#[derive(Clone, Debug)]
pub struct Batch {
    /// Input token ids, `u32 [B, T]`.
    pub x: Tensor,
    /// Target token ids, `u32 [B, T]`: `y[i, j]` is the token that follows `x[i, j]`.
    pub y: Tensor,
    /// Loss weights, `f32 [B, T]`: 1.0 where the target `y[i, j]` counts in the loss, 0.0
    /// elsewhere. `None` means every target counts.
    pub mask: Option<Tensor>,
    /// Positions and document ids of the rows' tokens (default: `0..T`, one document a row).
    pub rows: Rows,
    /// The mask's counted targets per row, when the data source built the mask on the host
    /// ([`Batch::with_host_mask`]): counting and sharding then read nothing back from the
    /// device. Used only while `mask` is the tensor they were counted from.
    pub mask_counts: Option<MaskCounts>,
    /// A reference model's summed log-probability of each row's counted targets (`f32 [B]`),
    /// when the source holds them (DPO with reference values computed before training; see
    /// the model context's `reference`).
    pub reference: Option<Tensor>,
    /// The targets as the data source built them on the host ([`Batch::from_host`]): the
    /// cross-entropy ops then read nothing back from the device. Used only while `y` and
    /// `mask` are the tensors they were built with.
    pub host_targets: Option<HostTargets>,
}

/// A batch's targets on the host, the mask folded in ([`IGNORE`] where a target does not
/// count), flat, row-major (see [`Batch::host_targets`]).
#[derive(Clone, Debug)]
pub struct HostTargets {
    y: TensorId,
    mask: Option<TensorId>,
    values: Arc<[u32]>,
}

/// Counted targets per row of one mask tensor, summed on the host (see
/// [`Batch::mask_counts`]).
#[derive(Clone, Debug)]
pub struct MaskCounts {
    mask: TensorId,
    per_row: Vec<f32>,
}

impl Batch {
    /// A batch of inputs and targets in which every target counts.
    pub fn new(x: Tensor, y: Tensor) -> Self {
        Batch {
            x,
            y,
            mask: None,
            rows: Rows::default(),
            mask_counts: None,
            reference: None,
            host_targets: None,
        }
    }

    /// A batch of inputs `x` and targets `y` (`[B, T]` row-major on the host) copied to
    /// `device`, every target counting; the host copies of the targets ([`Batch::host_targets`])
    /// and of the token ids (for the embedding's backward) are kept.
    pub fn from_host(
        x: Vec<u32>,
        y: Vec<u32>,
        shape: (usize, usize),
        device: &Device,
    ) -> candle_core::Result<Self> {
        let values: Arc<[u32]> = y.as_slice().into();
        let y = crate::transfer::upload(y, shape, device)?;
        let host_targets = Some(HostTargets {
            y: y.id(),
            mask: None,
            values,
        });
        let tokens = HostTokens::new(x.clone(), shape.1);
        let mut batch = Batch {
            host_targets,
            ..Batch::new(crate::transfer::upload(x, shape, device)?, y)
        };
        batch.rows.tokens = Some(tokens);
        Ok(batch)
    }

    /// A batch of Hugging Face causal-LM inputs: `input_ids` and `labels` (`[B, T]`, integer
    /// ids; -100 = ignored), the labels shifted as transformers' `ForCausalLMLoss` shifts them:
    /// position `t` predicts `labels[t + 1]`, the last position nothing (the mask says which
    /// targets count).
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use candle_data::Batch;
    ///
    /// let ids = Tensor::new(&[[5u32, 6, 7, 8]], &Device::Cpu)?;
    /// let labels = Tensor::new(&[[-100i64, 6, -100, 8]], &Device::Cpu)?;
    /// let batch = Batch::from_hf_labels(&ids, &labels)?;
    /// let ignore = candle_data::IGNORE;
    /// assert_eq!(batch.targets()?.to_vec2::<u32>()?, [[6, ignore, 8, ignore]]);
    /// # Ok::<(), candle_data::Error>(())
    /// ```
    pub fn from_hf_labels(input_ids: &Tensor, labels: &Tensor) -> Result<Batch> {
        let (rows, t) = labels.dims2()?;
        if input_ids.dims() != [rows, t] || t == 0 {
            return Err(Error::Config(format!(
                "input_ids {:?} and labels {:?} must have the same [batch, length] shape, \
                 length at least 1",
                input_ids.dims(),
                labels.dims()
            )));
        }
        let labels = labels.to_dtype(DType::I64)?;
        let ignored = Tensor::full(-100i64, (rows, 1), labels.device())?;
        let shifted = Tensor::cat(&[&labels.narrow(1, 1, t - 1)?, &ignored], 1)?;
        let counts = shifted.ge(0i64)?;
        let y = counts.where_cond(&shifted, &shifted.zeros_like()?)?;
        Ok(
            Batch::new(input_ids.to_dtype(DType::U32)?, y.to_dtype(DType::U32)?)
                .with_mask(Some(counts.to_dtype(DType::F32)?)),
        )
    }

    /// The same batch with a loss mask.
    pub fn with_mask(self, mask: Option<Tensor>) -> Self {
        Batch {
            mask,
            mask_counts: None,
            ..self
        }
    }

    /// The same batch with the loss mask `mask` (`f32 [B, T]`, row-major, as laid out on the
    /// host) copied to `device`, and its counted targets per row summed on the host.
    pub fn with_host_mask(self, mask: Vec<f32>, device: &Device) -> candle_core::Result<Self> {
        let shape = self.y.shape().clone();
        let per_row = match shape.dims() {
            [_, t] if *t > 0 => mask.chunks_exact(*t).map(|r| r.iter().sum()).collect(),
            _ => Vec::new(),
        };
        let host_targets = self.host_targets().map(|ys| {
            let folded = ys.iter().zip(&mask);
            folded
                .map(|(&y, &m)| if m != 0.0 { y } else { IGNORE })
                .collect()
        });
        let mask = crate::transfer::upload(mask, shape, device)?;
        let mask_counts = (!per_row.is_empty()).then(|| MaskCounts {
            mask: mask.id(),
            per_row,
        });
        let host_targets = host_targets.map(|values| HostTargets {
            y: self.y.id(),
            mask: Some(mask.id()),
            values,
        });
        Ok(Batch {
            mask: Some(mask),
            mask_counts,
            host_targets,
            ..self
        })
    }

    /// Counted targets per row (the mask's row sums, or every target): from the host's
    /// counts when the mask came with them, else read back from the device once.
    pub fn row_counts(&self) -> candle_core::Result<Vec<f32>> {
        match (&self.mask, &self.mask_counts) {
            (None, _) => Ok(vec![self.y.dim(1)? as f32; self.y.dim(0)?]),
            (Some(mask), Some(c)) if c.mask == mask.id() => Ok(c.per_row.clone()),
            (Some(mask), _) => crate::transfer::read_vec1(&mask.sum(1)?),
        }
    }

    /// The targets with the mask folded in: [`IGNORE`] where a target does not count (what a
    /// model's head takes, as PyTorch's `ignore_index`).
    pub fn targets(&self) -> candle_core::Result<Tensor> {
        match &self.mask {
            None => Ok(self.y.clone()),
            Some(mask) => {
                let ignore = Tensor::full(IGNORE, self.y.shape(), self.y.device())?;
                mask.ne(0f32)?.where_cond(&self.y, &ignore)
            }
        }
    }

    /// [`Batch::targets`] on the host (flat, row-major) when the data source built them
    /// there and `y` and `mask` are still the tensors it built.
    pub fn host_targets(&self) -> Option<Arc<[u32]>> {
        let h = self.host_targets.as_ref()?;
        let mask = self.mask.as_ref().map(Tensor::id);
        (h.y == self.y.id() && h.mask == mask).then(|| h.values.clone())
    }

    /// The number of targets that count in the loss (the mask's sum, or every target).
    pub fn counted(&self) -> candle_core::Result<f64> {
        match &self.mask {
            None => Ok(self.y.elem_count() as f64),
            Some(_) => Ok(self.row_counts()?.iter().map(|&c| f64::from(c)).sum()),
        }
    }

    /// Rows `start..start + len` of the batch (inputs, targets, mask and the rows' context).
    pub fn narrow(&self, start: usize, len: usize) -> candle_core::Result<Batch> {
        let rows = |t: &Tensor| t.narrow(0, start, len);
        let mask = self.mask.as_ref().map(rows).transpose()?;
        let mask_counts = match (&self.mask, &self.mask_counts, &mask) {
            (Some(m), Some(c), Some(narrowed)) if c.mask == m.id() => Some(MaskCounts {
                mask: narrowed.id(),
                per_row: c.per_row[start..start + len].to_vec(),
            }),
            _ => None,
        };
        let y = rows(&self.y)?;
        let t = self.y.dim(1)?;
        let host_targets = self.host_targets().map(|v| HostTargets {
            y: y.id(),
            mask: mask.as_ref().map(Tensor::id),
            values: v[start * t..(start + len) * t].into(),
        });
        Ok(Batch {
            x: rows(&self.x)?,
            y,
            mask,
            rows: self.rows.narrow(start, len)?,
            mask_counts,
            reference: self.reference.as_ref().map(rows).transpose()?,
            host_targets,
        })
    }
}

/// What [`DataSource::batch`](super::DataSource::batch) is asked for: `batch_size` windows
/// of `block_size` inputs from `split`, uploaded to `device` (both sizes checked positive
/// before a source's [`draw`](super::DataSource::draw) sees them).
#[derive(Clone, Copy, Debug)]
pub struct BatchRequest<'a> {
    /// The split the windows come from.
    pub split: Split,
    /// Rows of the batch.
    pub batch_size: usize,
    /// Inputs (and targets) a row.
    pub block_size: usize,
    /// Where the batch goes.
    pub device: &'a Device,
}

impl BatchRequest<'_> {
    /// The batch of `batch_size` rows of `block_size + 1` tokens laid end to end in `rows`,
    /// the host copies of its targets and ids kept (see [`Batch::from_host`]).
    ///
    /// `target_mask`, if given, has one weight per target, `batch_size * block_size` values.
    pub(crate) fn batch_of(&self, rows: &[u32], target_mask: Option<Vec<f32>>) -> Result<Batch> {
        let (batch_size, block_size, device) = (self.batch_size, self.block_size, self.device);
        let w = block_size + 1;
        debug_assert_eq!(rows.len(), batch_size * w);
        let mut x = Vec::with_capacity(batch_size * block_size);
        let mut y = Vec::with_capacity(batch_size * block_size);
        for row in rows.chunks_exact(w) {
            x.extend_from_slice(&row[..block_size]);
            y.extend_from_slice(&row[1..]);
        }
        let batch = Batch::from_host(x, y, (batch_size, block_size), device)?;
        Ok(match target_mask {
            Some(m) => batch.with_host_mask(m, device)?,
            None => batch,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_shift_by_one() {
        let rows: Vec<u32> = (0..2 * 5).collect();
        let want = BatchRequest {
            split: Split::Train,
            batch_size: 2,
            block_size: 4,
            device: &Device::Cpu,
        };
        let b = want.batch_of(&rows, None).unwrap();
        assert_eq!(
            b.x.to_vec2::<u32>().unwrap(),
            vec![vec![0, 1, 2, 3], vec![5, 6, 7, 8]]
        );
        assert_eq!(
            b.y.to_vec2::<u32>().unwrap(),
            vec![vec![1, 2, 3, 4], vec![6, 7, 8, 9]]
        );
        assert!(b.mask.is_none());
    }
}
