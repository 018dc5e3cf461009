//! The peak of a process's anonymous resident memory (`RssAnon:` in `/proc/self/status`),
//! sampled by a thread: the heap and anonymous mappings a process holds, without the pages of
//! files it maps for reading (a base model's `model.safetensors`), which `VmHWM` counts. A
//! peak shorter than the sampling period can be missed: the figure is a lower bound of the
//! true peak, within one period's allocations.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// A `/proc/self/status` field in KiB (`VmHWM:`, `VmRSS:`); NaN where absent.
pub fn status_kib(key: &str) -> f64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// How often [`AnonPeak`] reads `RssAnon`.
pub const PERIOD: Duration = Duration::from_millis(2);

/// A thread reading this process's `RssAnon` every [`PERIOD`] and keeping the highest value
/// seen since it started or since the last [`AnonPeak::reset`].
pub struct AnonPeak {
    stop: Arc<AtomicBool>,
    peak_kib: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

fn anon_kib() -> u64 {
    let v = status_kib("RssAnon:");
    if v.is_finite() {
        v as u64
    } else {
        0
    }
}

impl AnonPeak {
    /// Starts sampling.
    pub fn start() -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak_kib = Arc::new(AtomicU64::new(anon_kib()));
        let (s, p) = (stop.clone(), peak_kib.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(anon_kib(), Ordering::Relaxed);
                std::thread::sleep(PERIOD);
            }
        });
        AnonPeak {
            stop,
            peak_kib,
            thread: Some(thread),
        }
    }

    /// The highest `RssAnon` seen so far (the current one included), in MiB.
    pub fn peak_mib(&self) -> f64 {
        self.peak_kib.fetch_max(anon_kib(), Ordering::Relaxed);
        self.peak_kib.load(Ordering::Relaxed) as f64 / 1024.0
    }

    /// Starts a new peak from the current `RssAnon`.
    pub fn reset(&self) {
        self.peak_kib.store(anon_kib(), Ordering::Relaxed);
    }
}

impl Drop for AnonPeak {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
