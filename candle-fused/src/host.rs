//! Values on the host: class targets with the caller's host copy ([`Targets`]) and the count
//! of this crate's reads of tensor values back to the host ([`read_count`]).
//!
//! On a GPU every such read waits for all queued work. The cross-entropy ops need their
//! targets on the host (the range check, and the chunked loss's selection of counted rows);
//! a caller that built the targets on the host passes that copy and the op reads nothing. A
//! read is counted whatever the device (on the CPU it is a copy, on a device a host sync), so
//! a CPU test sees the reads a GPU run would make; reads made only on the CPU path (a CPU
//! kernel reading its upstream gradient) are not counted.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{bail, Result, Tensor, WithDType};

static READS: AtomicU64 = AtomicU64::new(0);

/// The reads of tensor values back to the host this crate's ops have made in this process
/// (every thread; take a difference around the work to count): targets without a host copy
/// ([`Targets`]) and [`global_norm`](crate::adamw::global_norm)'s sum.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_fused::cross_entropy::cross_entropy;
/// use candle_fused::host::{read_count, Targets};
/// let logits = Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu)?;
/// let targets = Tensor::new(&[0u32, 2], &Device::Cpu)?;
/// let before = read_count();
/// cross_entropy(&logits, Targets::new(&targets).with_host(&[0, 2]), None, None)?;
/// assert_eq!(read_count(), before); // the host copy: nothing read
/// cross_entropy(&logits, &targets, None, None)?;
/// assert_eq!(read_count(), before + 1); // read once
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn read_count() -> u64 {
    READS.load(Ordering::Relaxed)
}

/// `t`'s values, flat, on the host: one counted read.
pub(crate) fn read_vec<T: WithDType>(t: &Tensor) -> Result<Vec<T>> {
    READS.fetch_add(1, Ordering::Relaxed);
    t.flatten_all()?.to_vec1::<T>()
}

/// A scalar's value on the host: one counted read.
pub(crate) fn read_scalar<T: WithDType>(t: &Tensor) -> Result<T> {
    READS.fetch_add(1, Ordering::Relaxed);
    t.to_scalar::<T>()
}

/// Class targets (`u32`) for a cross-entropy op and, when the caller has it, the same values
/// on the host, flat in row-major order: the op then reads nothing back from the device.
/// A `&Tensor` converts into targets without a host copy (the op reads them once).
///
/// The host copy must hold the tensor's values: the op checks its length, not its values.
#[derive(Clone, Copy, Debug)]
pub struct Targets<'a> {
    tensor: &'a Tensor,
    host: Option<&'a [u32]>,
}

impl<'a> Targets<'a> {
    /// Targets without a host copy.
    pub fn new(tensor: &'a Tensor) -> Self {
        Targets { tensor, host: None }
    }

    /// The same targets with their values on the host (`host`, flat, row-major).
    pub fn with_host(self, host: &'a [u32]) -> Self {
        Targets {
            host: Some(host),
            ..self
        }
    }

    /// The targets' tensor.
    pub fn tensor(&self) -> &'a Tensor {
        self.tensor
    }

    /// The values on the host, flat: the host copy (its length checked against the tensor,
    /// an error naming `op` otherwise) or one counted read of the tensor.
    pub(crate) fn host(&self, op: &str) -> Result<Cow<'a, [u32]>> {
        match self.host {
            Some(h) if h.len() == self.tensor.elem_count() => Ok(Cow::Borrowed(h)),
            Some(h) => bail!(
                "{op}: the targets' host copy has {} values, the targets {:?} hold {}",
                h.len(),
                self.tensor.shape(),
                self.tensor.elem_count()
            ),
            None => Ok(Cow::Owned(read_vec::<u32>(self.tensor)?)),
        }
    }
}

impl<'a> From<&'a Tensor> for Targets<'a> {
    fn from(tensor: &'a Tensor) -> Self {
        Targets::new(tensor)
    }
}
