//! Where a run computes: its device, its CUDA settings and how a step is spread over stages.

use candle_core::Device;

use super::{types, DeviceSpec, Parallelism, TrainConfig};
use crate::Result;

impl TrainConfig {
    /// Whether any of the run's devices is a CUDA GPU (`device`, `pipeline_devices`).
    pub(crate) fn uses_cuda(&self) -> bool {
        let cuda = |d: &DeviceSpec| matches!(d, DeviceSpec::Cuda(_));
        cuda(&self.device) || self.pipeline_devices.0.iter().any(cuda)
    }

    /// The run's CUDA settings as the banner shows them (`None` without a CUDA device, where
    /// they have no effect), with what decided the Triton switch.
    pub fn cuda_summary(&self) -> Option<String> {
        let on = |b: bool| if b { "on" } else { "off" };
        self.uses_cuda().then(|| {
            let (triton, by) = self.triton_choice();
            format!(
                "cuda: tf32 {} (f32 matmuls), triton kernels {} ({by})",
                on(self.tf32),
                on(triton)
            )
        })
    }

    /// Whether the run takes candle-fused's Triton kernels on CUDA, and what decided it: the
    /// flag (`triton_kernels`), else the environment (`CANDLE_FUSED_TRITON`), else candle-fused's
    /// default.
    pub fn triton_choice(&self) -> (bool, &'static str) {
        use candle_fused::cuda_kernels::{triton_from_env, TRITON_DEFAULT, TRITON_ENV};
        match (self.triton_kernels, triton_from_env()) {
            (Some(on), _) => (on, "--triton-kernels"),
            (None, Some(on)) => (on, TRITON_ENV),
            (None, None) => (TRITON_DEFAULT, "default"),
        }
    }

    /// Opens the run's device; a run on one stream (no pipeline, and a world of one as the
    /// environment announces it) has it prepared for that (on CUDA: the memory pool keeps
    /// freed memory, no events per allocation).
    pub(crate) fn open_device(&self) -> Result<Device> {
        let device = self.device.open()?;
        let one_rank = crate::train::parallel::world_size_from_env() == 1;
        if one_rank && matches!(self.parallelism(), Parallelism::None) {
            types::single_stream(&device)?;
        }
        Ok(device)
    }

    /// How a step is spread over stages.
    pub fn parallelism(&self) -> Parallelism {
        if self.pipeline_stages <= 1 {
            return Parallelism::None;
        }
        Parallelism::Pipeline {
            stages: self.pipeline_stages,
            microbatches: self.microbatches,
            schedule: self.schedule,
            devices: self.pipeline_devices.clone(),
            threads: self.pipeline_threads,
        }
    }
}
