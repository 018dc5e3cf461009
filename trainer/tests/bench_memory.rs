//! The benches' anonymous-memory peak (trainer/benches/support/memory.rs): its sampling thread
//! sees an allocation that is gone again before anyone asks for the peak.

#[path = "../benches/support/memory.rs"]
#[allow(dead_code)]
mod memory;

use std::time::Duration;

use memory::{status_kib, AnonPeak, PERIOD};

#[test]
fn the_peak_outlives_a_short_allocation() {
    const MIB: usize = 256;
    let peak = AnonPeak::start();
    let before = peak.peak_mib();
    {
        // Written, so resident; freed (unmapped: a large allocation) when dropped.
        let v = vec![1u8; MIB << 20];
        std::hint::black_box(&v);
        std::thread::sleep(PERIOD * 20);
    }
    let now = status_kib("RssAnon:") / 1024.0;
    let seen = peak.peak_mib();
    assert!(
        seen >= before + 0.9 * MIB as f64,
        "peak {seen} MiB, before {before}"
    );
    assert!(
        now < seen - 0.5 * MIB as f64,
        "freed: {now} MiB now, peak {seen}"
    );
    // A reset starts from what is resident now.
    peak.reset();
    std::thread::sleep(Duration::from_millis(10));
    assert!(peak.peak_mib() < seen - 0.5 * MIB as f64);
}
