//! The heap counter (its own test binary, with one test: the counters are process-wide).

use test_support::alloc::{self, CountingAlloc};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn heap_counter_sees_an_allocation_and_its_release() {
    let base = alloc::reset_peak();
    let v = vec![1u8; 1 << 20];
    assert!(alloc::current_bytes() >= base + (1 << 20));
    drop(v);
    assert!(alloc::peak_bytes() >= base + (1 << 20));
    assert!(alloc::current_bytes() < base + (1 << 20));
}
