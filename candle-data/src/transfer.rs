//! The trainer's transfer points between the host and the device, counted.
//!
//! On a GPU every read of a tensor's values on the host (`to_scalar`, `to_vec1`) waits for
//! the device to finish all queued work, and every tensor made from host memory is a
//! host-to-device copy. A training step should make one read (the loss and the gradient
//! norm together) and copy only its batch. The step's code makes every such transfer through
//! the functions here, which count them whatever the device, so a CPU test
//! (`trainer/tests/transfers.rs`) sees the transfers a GPU run would make and fails when one
//! is added. Candle's own ops and `candle-fused`'s kernels are outside these counts.

use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{Device, Shape, Tensor, WithDType};

static DEVICE_TO_HOST: AtomicU64 = AtomicU64::new(0);
static HOST_TO_DEVICE: AtomicU64 = AtomicU64::new(0);

/// The transfers counted so far in this process (see [`counts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Transfers {
    /// Reads of tensor values on the host (each a sync with the device).
    pub device_to_host: u64,
    /// Tensors made from host memory on a device.
    pub host_to_device: u64,
}

impl std::ops::Sub for Transfers {
    type Output = Transfers;
    fn sub(self, earlier: Transfers) -> Transfers {
        Transfers {
            device_to_host: self.device_to_host - earlier.device_to_host,
            host_to_device: self.host_to_device - earlier.host_to_device,
        }
    }
}

/// The process-wide counts (every thread; take a difference around the work to count).
pub fn counts() -> Transfers {
    Transfers {
        device_to_host: DEVICE_TO_HOST.load(Ordering::Relaxed),
        host_to_device: HOST_TO_DEVICE.load(Ordering::Relaxed),
    }
}

thread_local! {
    /// Set while this thread works on tensors that stay on the host whatever the run's
    /// device ([`on_host`]): nothing crosses, nothing is counted.
    static ON_HOST: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, whose tensors are made on and read from `Device::Cpu` whatever the run's device
/// (e.g. a step counting its micro-batches' targets before drawing them for the device): its
/// uploads and reads are no transfers and are not counted.
pub fn on_host<T>(f: impl FnOnce() -> T) -> T {
    let was = ON_HOST.with(|h| h.replace(true));
    let out = f();
    ON_HOST.with(|h| h.set(was));
    out
}

fn count(counter: &AtomicU64) {
    if !ON_HOST.with(|h| h.get()) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// A tensor of `shape` on `device` from host values: one host-to-device copy.
pub fn upload<D: WithDType, S: Into<Shape>>(
    data: Vec<D>,
    shape: S,
    device: &Device,
) -> candle_core::Result<Tensor> {
    count(&HOST_TO_DEVICE);
    Tensor::from_vec(data, shape, device)
}

/// The value of a scalar tensor on the host: one device-to-host read.
pub fn read_scalar<D: WithDType>(t: &Tensor) -> candle_core::Result<D> {
    count(&DEVICE_TO_HOST);
    t.to_scalar()
}

/// The values of a vector on the host: one device-to-host read.
pub fn read_vec1<D: WithDType>(t: &Tensor) -> candle_core::Result<Vec<D>> {
    count(&DEVICE_TO_HOST);
    t.to_vec1()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_wrapper_counts_once() {
        // Other unit tests of this crate may run at once: counts only grow, so compare by at
        // least what this test did.
        let before = counts();
        let t = upload(vec![1f32, 2.0], 2, &Device::Cpu).unwrap();
        assert_eq!(read_vec1::<f32>(&t).unwrap(), [1.0, 2.0]);
        assert_eq!(read_scalar::<f32>(&t.sum_all().unwrap()).unwrap(), 3.0);
        let d = counts() - before;
        assert!(d.host_to_device >= 1 && d.device_to_host >= 2, "{d:?}");
    }
}
