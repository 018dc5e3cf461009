//! `pool`: every piece runs exactly once and results come back in order, for any size; nested
//! and concurrent calls (pipeline stages on threads, tests on rayon pools) neither deadlock nor
//! lose work; a panicking piece reaches the caller and leaves the pool usable.

use std::sync::atomic::{AtomicUsize, Ordering};

use candle_fused::pool;

#[test]
fn map_returns_every_result_in_order() {
    for n in [0usize, 1, 2, 3, 17, 1000] {
        let v = pool::map(n, |i| i * i);
        assert_eq!(v, (0..n).map(|i| i * i).collect::<Vec<_>>(), "n = {n}");
    }
}

#[test]
fn map_chunks_mut_visits_each_element_once() {
    for (len, chunk) in [
        (0usize, 4usize),
        (1, 4),
        (10, 3),
        (64, 16),
        (1001, 7),
        (5, 0),
    ] {
        let mut v = vec![0u32; len];
        let starts = pool::map_chunks_mut(&mut v, chunk, |i, c| {
            for x in c.iter_mut() {
                *x += 1;
            }
            (i, c.len())
        });
        assert!(v.iter().all(|&x| x == 1), "len {len} chunk {chunk}");
        let chunk = chunk.max(1);
        assert_eq!(starts.len(), len.div_ceil(chunk));
        for (k, &(i, n)) in starts.iter().enumerate() {
            assert_eq!(i, k);
            assert_eq!(n, chunk.min(len - k * chunk));
        }
    }
}

#[test]
fn join_returns_both_halves() {
    let (a, b) = pool::join(|| (0..100u64).sum::<u64>(), || "right".to_string());
    assert_eq!((a, b.as_str()), (4950, "right"));
}

#[test]
fn nested_calls_run_inline() {
    let count = AtomicUsize::new(0);
    pool::for_each(8, |_| {
        pool::for_each(8, |_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        let (x, y) = pool::join(|| 1, || 2);
        assert_eq!(x + y, 3);
    });
    assert_eq!(count.into_inner(), 64);
}

#[test]
fn concurrent_callers_all_complete() {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|t| {
                s.spawn(move || {
                    (0..50)
                        .map(|r| pool::map(33, |i| i + t + r).iter().sum::<usize>())
                        .sum::<usize>()
                })
            })
            .collect();
        for (t, h) in handles.into_iter().enumerate() {
            let want: usize = (0..50)
                .map(|r| (0..33).map(|i| i + t + r).sum::<usize>())
                .sum();
            assert_eq!(h.join().expect("caller thread"), want);
        }
    });
}

#[test]
fn a_panicking_piece_reaches_the_caller_and_the_pool_still_works() {
    let r = std::panic::catch_unwind(|| {
        pool::for_each(16, |i| {
            if i == 11 {
                panic!("piece 11 fails");
            }
        })
    });
    assert!(r.is_err());
    assert_eq!(pool::map(5, |i| i + 1), vec![1, 2, 3, 4, 5]);
}

#[test]
fn parts_follow_the_callers_rayon_pool() {
    for n in [1, 3] {
        let p = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .expect("rayon pool");
        assert_eq!(p.install(pool::parts), n);
    }
}
