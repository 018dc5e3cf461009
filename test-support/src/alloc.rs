//! A global allocator that counts live heap bytes and their peak, for memory tests and benches.
//!
//! Install it in one test or bench binary (the counters are process-wide):
//!
//! ```no_run
//! use test_support::alloc::{self, CountingAlloc};
//!
//! #[global_allocator]
//! static ALLOC: CountingAlloc = CountingAlloc;
//!
//! let base = alloc::reset_peak();
//! let v = vec![0u8; 1 << 20];
//! assert!(alloc::peak_bytes() - base >= 1 << 20);
//! # drop(v);
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting the bytes it hands out (see the module docs).
pub struct CountingAlloc;

// SAFETY: every call is forwarded unchanged to the system allocator; the counters only observe.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            let now = CURRENT.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        CURRENT.fetch_sub(l.size(), Ordering::Relaxed);
    }
}

/// Heap bytes in use now (0 unless [`CountingAlloc`] is the global allocator).
pub fn current_bytes() -> usize {
    CURRENT.load(Ordering::Relaxed)
}

/// The most heap bytes in use at once since the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new peak at the bytes in use now, and returns them.
pub fn reset_peak() -> usize {
    let now = current_bytes();
    PEAK.store(now, Ordering::Relaxed);
    now
}
