//! The typed values of [`TrainConfig`](super::TrainConfig) fields that are written as text in
//! TOML files and on the command line (`--dtype bf16`, `--schedule interleaved:2`): each is
//! parsed once, by `FromStr` (clap) or serde (TOML, JSON), and printed back by `Display`.

use std::fmt;
use std::str::FromStr;

use candle_amp::ScalerConfig;
use candle_core::{DType, Device};
use candle_data::{named_enum, serde_as_text};
use candle_pipeline::Schedule;

use crate::{Error, Result};

/// The compute dtype: `f32`, or `bf16` / `f16` with f32 master weights and optimiser state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// bf16 compute (f32's range: no loss scaling needed by default).
    Bf16,
    /// f16 compute (dynamic loss scaling by default).
    F16,
}

impl Precision {
    /// The Candle dtype the model computes in.
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F16 => DType::F16,
        }
    }
}

named_enum!(Precision, "dtype must be f32, f16 or bf16", {
    F32 => "f32",
    Bf16 => "bf16",
    F16 => "f16",
});
serde_as_text!(Precision);

/// How a LoRA run holds its frozen base's linear layers: as they are (`none`, in the base
/// dtype) or in 4 bits (`nf4`: QLoRA, bitsandbytes' NF4).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BaseQuant {
    /// Full precision (`--base-dtype`).
    #[default]
    None,
    /// 4-bit NormalFloat, quantized on load as bitsandbytes does (lm_head kept).
    Nf4,
}

named_enum!(BaseQuant, "base_quant must be none or nf4", {
    None => "none",
    Nf4 => "nf4",
});
serde_as_text!(BaseQuant);

/// Loss scaling: `auto` (dynamic for f16, none otherwise), `dynamic`, `none`, or a static
/// positive scale.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum LossScale {
    /// Dynamic for f16, none for bf16 and f32.
    #[default]
    Auto,
    /// Grow and back off with overflows (PyTorch's `GradScaler`).
    Dynamic,
    /// No scaling.
    None,
    /// A fixed scale.
    Static(f64),
}

impl LossScale {
    /// The scaler for `precision` (in f32 it scales nothing: a disabled scaler).
    pub fn scaler(self, precision: Precision) -> ScalerConfig {
        match self {
            LossScale::Auto if precision == Precision::F16 => ScalerConfig::dynamic(),
            LossScale::Auto | LossScale::None => ScalerConfig::none(),
            LossScale::Dynamic => ScalerConfig::dynamic(),
            LossScale::Static(v) => ScalerConfig::static_scale(v),
        }
    }
}

impl FromStr for LossScale {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(match s {
            "auto" => LossScale::Auto,
            "dynamic" => LossScale::Dynamic,
            "none" => LossScale::None,
            s => match s.parse::<f64>() {
                Ok(v) if v > 0.0 && v.is_finite() => LossScale::Static(v),
                _ => {
                    return Err(format!(
                        "loss_scale must be auto, dynamic, none or a positive number, not `{s}`"
                    ))
                }
            },
        })
    }
}

impl fmt::Display for LossScale {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LossScale::Auto => f.write_str("auto"),
            LossScale::Dynamic => f.write_str("dynamic"),
            LossScale::None => f.write_str("none"),
            LossScale::Static(v) => write!(f, "{v}"),
        }
    }
}
serde_as_text!(LossScale);

/// The pipeline schedule: `gpipe`, `1f1b` or `interleaved:V` (V virtual stages per worker).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    GPipe,
    /// One forward, one backward in the steady state.
    #[default]
    OneFOneB,
    /// 1F1B over `V` virtual stages per worker.
    Interleaved(usize),
}

impl ScheduleKind {
    /// Virtual stages per worker.
    pub fn virtual_stages(self) -> usize {
        match self {
            ScheduleKind::Interleaved(v) => v,
            _ => 1,
        }
    }

    /// The schedule for `stages` workers and `m` microbatches.
    pub fn build(self, stages: usize, m: usize) -> Result<Schedule> {
        let s = match self {
            ScheduleKind::GPipe => Schedule::gpipe(stages, m),
            ScheduleKind::OneFOneB => Schedule::one_f_one_b(stages, m),
            ScheduleKind::Interleaved(v) => Schedule::interleaved(stages, v, m),
        };
        s.map_err(|e| Error::Config(format!("schedule `{self}`: {e}")))
    }
}

impl FromStr for ScheduleKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            _ => match s.strip_prefix("interleaved:").map(str::parse::<usize>) {
                Some(Ok(v)) if v >= 1 => Ok(ScheduleKind::Interleaved(v)),
                _ => Err(format!(
                    "schedule must be gpipe, 1f1b or interleaved:V, not `{s}`"
                )),
            },
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleKind::GPipe => f.write_str("gpipe"),
            ScheduleKind::OneFOneB => f.write_str("1f1b"),
            ScheduleKind::Interleaved(v) => write!(f, "interleaved:{v}"),
        }
    }
}
serde_as_text!(ScheduleKind);

/// Where tensors live: `cpu`, `cuda` (= `cuda:0`), `cuda:N` or `metal`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DeviceSpec {
    /// The host.
    #[default]
    Cpu,
    /// CUDA device N (needs the `cuda` feature).
    Cuda(usize),
    /// The Metal device (needs the `metal` feature).
    Metal,
}

impl DeviceSpec {
    /// Opens the device (GPU devices need the crate's matching feature).
    pub fn open(self) -> Result<Device> {
        Ok(match self {
            DeviceSpec::Cpu => Device::Cpu,
            DeviceSpec::Cuda(i) => Device::new_cuda(i)?,
            DeviceSpec::Metal => Device::new_metal(0)?,
        })
    }
}

/// Prepares `device` for a run that uses it from one stream (no data-parallel ranks, no
/// pipeline workers): on CUDA the default memory pool keeps the memory freed to it (release
/// threshold at its maximum; cudarc's default of 0 hands it back to the driver at every
/// synchronisation) and cudarc creates no events per allocation (their only use is to order
/// one buffer's uses across streams). Nothing on other devices. Must run before the run
/// allocates; a run on more than one stream keeps cudarc's defaults.
pub(crate) fn single_stream(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        use candle_core::cuda::cudarc::driver::{result, sys};
        let stream = cuda.cuda_stream();
        let ctx = stream.context();
        let failed = |e: result::DriverError| Error::Config(format!("CUDA memory pool: {e:?}"));
        let mut max = u64::MAX;
        // SAFETY: the pool is the device's default one, and the release threshold attribute
        // takes a `cuuint64_t`; no tensor exists yet whose uses cross streams (one stream).
        unsafe {
            let pool = result::device::get_default_mem_pool(ctx.cu_device()).map_err(failed)?;
            let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
            result::mem_pool::set_attribute(pool, attr, (&mut max as *mut u64).cast())
                .map_err(failed)?;
            ctx.disable_event_tracking();
        }
    }
    let _ = device;
    Ok(())
}

/// Whether cudarc orders `device`'s buffers across streams (true on every device but a CUDA
/// one prepared by [`single_stream`]).
pub(crate) fn tracks_streams(device: &Device) -> bool {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        return cuda.cuda_stream().context().is_event_tracking();
    }
    let _ = device;
    true
}

impl FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            "metal" => Ok(DeviceSpec::Metal),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(i)) => Ok(DeviceSpec::Cuda(i)),
                _ => Err(format!(
                    "device must be cpu, cuda, cuda:N or metal, not `{other}`"
                )),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(i) => write!(f, "cuda:{i}"),
            DeviceSpec::Metal => f.write_str("metal"),
        }
    }
}
serde_as_text!(DeviceSpec);

/// Devices of the pipeline stages, comma-separated (`cpu,cpu`, `cuda:0,cuda:1`); empty: every
/// stage on the run's device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct DeviceList(pub Vec<DeviceSpec>);

impl FromStr for DeviceList {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s.trim().is_empty() {
            return Ok(DeviceList::default());
        }
        s.split(',')
            .map(|d| d.trim().parse())
            .collect::<std::result::Result<_, _>>()
            .map(DeviceList)
    }
}

impl fmt::Display for DeviceList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&names.join(","))
    }
}
serde_as_text!(DeviceList);

/// How a step is spread over stages, read from the config's pipeline fields
/// ([`super::TrainConfig::parallelism`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Parallelism {
    /// The whole model runs in one place.
    None,
    /// Pipeline stages on threads or devices.
    Pipeline {
        /// Pipeline workers (threads or devices).
        stages: usize,
        /// Microbatches each micro-batch is split into.
        microbatches: usize,
        /// The schedule.
        schedule: ScheduleKind,
        /// Each worker's device (empty: the run's device).
        devices: DeviceList,
        /// CPU threads per worker (0: cores / stages).
        threads: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<T>(values: &[T])
    where
        T: FromStr + fmt::Display + PartialEq + fmt::Debug,
        <T as FromStr>::Err: fmt::Debug,
    {
        for v in values {
            assert_eq!(&v.to_string().parse::<T>().unwrap(), v);
        }
    }

    #[test]
    fn text_round_trips_and_bad_text_is_named() {
        round_trip(&[Precision::F32, Precision::Bf16, Precision::F16]);
        round_trip(&[
            LossScale::Auto,
            LossScale::Dynamic,
            LossScale::None,
            LossScale::Static(1024.0),
        ]);
        round_trip(&[
            ScheduleKind::GPipe,
            ScheduleKind::OneFOneB,
            ScheduleKind::Interleaved(2),
        ]);
        round_trip(&[DeviceSpec::Cpu, DeviceSpec::Cuda(1), DeviceSpec::Metal]);
        round_trip(&[
            DeviceList::default(),
            DeviceList(vec![DeviceSpec::Cpu, DeviceSpec::Cuda(1)]),
        ]);
        assert!("cpu,gpu".parse::<DeviceList>().unwrap_err().contains("gpu"));
        assert_eq!("cuda".parse::<DeviceSpec>(), Ok(DeviceSpec::Cuda(0)));
        assert!("f8".parse::<Precision>().unwrap_err().contains("f8"));
        assert!("-1".parse::<LossScale>().is_err());
        assert!("interleaved:0".parse::<ScheduleKind>().is_err());
        assert!("tpu".parse::<DeviceSpec>().unwrap_err().contains("tpu"));
    }
}

/// The architecture of a fresh model (`arch`): made from the model registry.
pub use crate::model::Arch;

/// Module names, comma-separated (`lm_head,embed_tokens`); empty by default.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModuleList(pub Vec<String>);

impl FromStr for ModuleList {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(ModuleList(
            s.split(',')
                .map(|n| n.trim().to_string())
                .filter(|n| !n.is_empty())
                .collect(),
        ))
    }
}

impl fmt::Display for ModuleList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join(","))
    }
}

serde_as_text!(ModuleList);
