//! Token-shard preparation helpers shared by the `prepare` tests.

use std::sync::atomic::{AtomicU64, Ordering};

use trainer::data::shards::{prepare, PrepareOptions};

/// Runs `prepare(o)` and kills it (a panic in the progress callback: nothing is cleaned up)
/// once `after_shards` shards are written; returns the input bytes done by then and the total.
pub fn prepare_killed(o: &PrepareOptions, after_shards: usize) -> (u64, u64) {
    let (done, total) = (AtomicU64::new(0), AtomicU64::new(0));
    let crashed = std::panic::catch_unwind(|| {
        prepare(o, &|p| {
            if p.shards >= after_shards {
                done.store(p.bytes_done, Ordering::Relaxed);
                total.store(p.bytes_total, Ordering::Relaxed);
                panic!("killed");
            }
        })
    });
    assert!(
        crashed.is_err(),
        "prepare finished before {after_shards} shards"
    );
    (done.into_inner(), total.into_inner())
}
