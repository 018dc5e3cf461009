//! Where the CPU kernels run in parallel: on Candle's own CPU thread pool.
//!
//! Candle runs its element-wise ops (among them every gradient sum of a backward pass) on a pool
//! of its own threads, `candle_core::utils::barrier_pool`, whose workers spin for a while after
//! each op before they sleep. A training step interleaves those ops with this crate's kernels.
//! Were the kernels on rayon's pool, two sets of threads would take turns on the same cores,
//! each spinning while the other works. So the kernels run on Candle's pool too: one set of
//! threads, the calling thread working as one of them, as a PyTorch step runs on one OpenMP
//! team.
//!
//! How work is **split** is separate from which threads run it: kernels split into [`parts`]
//! pieces (the rayon thread count of the calling context, so a caller's
//! `ThreadPool::install` still chooses it), and every piece computes the same bits whichever
//! thread takes it. Calls from inside a parallel section run on the calling thread (no nesting).
//!
//! Callers on several threads at once (pipeline stages, data-parallel ranks as threads) take
//! turns: Candle's pool runs one section at a time. A piece must not call Candle tensor ops
//! itself (nor start threads that call this module): on the calling thread, which holds the
//! pool for the section, that would wait for the pool forever. No kernel of this crate does.

use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Mutex;

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as running a piece of a parallel section while alive.
struct Inside(bool);

impl Inside {
    fn enter() -> Self {
        Inside(INSIDE.with(|c| c.replace(true)))
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        INSIDE.with(|c| c.set(self.0));
    }
}

/// How many pieces parallel work is split into: rayon's thread count in the calling context.
pub(crate) fn parts() -> usize {
    rayon::current_num_threads().max(1)
}

/// Runs `f(i)` for every `i in 0..n`, spread over Candle's CPU threads (the calling thread
/// among them); on the calling thread alone when `n < 2` or inside another parallel section.
/// A panic in `f` reaches the caller (after every piece has finished), and the pool stays
/// usable.
pub(crate) fn for_each(n: usize, f: impl Fn(usize) + Sync) {
    if n < 2 || INSIDE.with(Cell::get) {
        let _inside = Inside::enter();
        (0..n).for_each(f);
        return;
    }
    // A panic must not unwind through Candle's pool: it would poison the pool's lock, and every
    // later Candle op of the process would fail. Pieces catch it; the caller re-raises it.
    let failed: Mutex<Option<Box<dyn Any + Send>>> = Mutex::new(None);
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        let _inside = Inside::enter();
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| range.for_each(&f))) {
            if let Ok(mut first) = failed.lock() {
                first.get_or_insert(p);
            }
        }
    });
    if let Some(p) = failed.into_inner().ok().flatten() {
        resume_unwind(p);
    }
}

/// A pointer shared by pieces that write disjoint elements.
pub(crate) struct Shared<T>(pub(crate) *mut T);

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Shared<T> {}

impl<T> Shared<T> {
    /// The pointer to element `i` (a method, so closures capture the whole `Shared`, which is
    /// `Sync`, not its raw pointer).
    pub(crate) fn at(self, i: usize) -> *mut T {
        // SAFETY (of callers): `i` is inside the buffer.
        self.0.wrapping_add(i)
    }
}

// SAFETY: only used to write disjoint elements (each index by one piece) of a buffer that
// outlives the parallel section.
unsafe impl<T: Send> Send for Shared<T> {}
unsafe impl<T: Send> Sync for Shared<T> {}

/// `[f(0), .., f(n - 1)]`, computed as [`for_each`] does.
pub(crate) fn map<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    let p = Shared(out.as_mut_ptr());
    for_each(n, |i| {
        // SAFETY: index i < n is written by this piece only; `out` outlives the section.
        unsafe { *p.at(i) = Some(f(i)) };
    });
    out.into_iter()
        .map(|r| r.expect("candle-fused pool: every piece ran"))
        .collect()
}

/// `f(i, chunk_i)` for the consecutive `chunk`-long pieces of `out` (the last may be shorter),
/// results in order, computed as [`for_each`] does.
pub(crate) fn map_chunks_mut<T: Send, R: Send>(
    out: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) -> R + Sync,
) -> Vec<R> {
    let (len, chunk) = (out.len(), chunk.max(1));
    let p = Shared(out.as_mut_ptr());
    map(len.div_ceil(chunk), |i| {
        let (lo, hi) = (i * chunk, ((i + 1) * chunk).min(len));
        // SAFETY: the pieces [lo, hi) are disjoint and inside `out`, which outlives the section.
        f(i, unsafe {
            std::slice::from_raw_parts_mut(p.at(lo), hi - lo)
        })
    })
}

/// `(a(), b())`, the two run side by side on Candle's threads.
pub(crate) fn join<A: Send, B: Send>(
    a: impl FnOnce() -> A + Send,
    b: impl FnOnce() -> B + Send,
) -> (A, B) {
    let (fa, fb) = (Mutex::new(Some(a)), Mutex::new(Some(b)));
    let (ra, rb) = (Mutex::new(None), Mutex::new(None));
    for_each(2, |i| {
        if i == 0 {
            if let Some(f) = fa.lock().ok().and_then(|mut g| g.take()) {
                let v = f();
                if let Ok(mut r) = ra.lock() {
                    *r = Some(v);
                }
            }
        } else if let Some(f) = fb.lock().ok().and_then(|mut g| g.take()) {
            let v = f();
            if let Ok(mut r) = rb.lock() {
                *r = Some(v);
            }
        }
    });
    let ra = ra.into_inner().ok().flatten();
    let rb = rb.into_inner().ok().flatten();
    match (ra, rb) {
        (Some(a), Some(b)) => (a, b),
        _ => unreachable!("candle-fused pool: both halves of a join ran"),
    }
}

// `pool`: every piece runs exactly once and results come back in order, for any size; nested
// and concurrent calls (pipeline stages on threads, tests on rayon pools) neither deadlock nor
// lose work; a panicking piece reaches the caller and leaves the pool usable.
#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn map_returns_every_result_in_order() {
        for n in [0usize, 1, 2, 3, 17, 1000] {
            let v = super::map(n, |i| i * i);
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
            let starts = super::map_chunks_mut(&mut v, chunk, |i, c| {
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
        let (a, b) = super::join(|| (0..100u64).sum::<u64>(), || "right".to_string());
        assert_eq!((a, b.as_str()), (4950, "right"));
    }

    #[test]
    fn nested_calls_run_inline() {
        let count = AtomicUsize::new(0);
        super::for_each(8, |_| {
            super::for_each(8, |_| {
                count.fetch_add(1, Ordering::Relaxed);
            });
            let (x, y) = super::join(|| 1, || 2);
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
                            .map(|r| super::map(33, |i| i + t + r).iter().sum::<usize>())
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
            super::for_each(16, |i| {
                if i == 11 {
                    panic!("piece 11 fails");
                }
            })
        });
        assert!(r.is_err());
        assert_eq!(super::map(5, |i| i + 1), vec![1, 2, 3, 4, 5]);
    }

    #[test]
    fn parts_follow_the_callers_rayon_pool() {
        for n in [1, 3] {
            let p = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .expect("rayon pool");
            assert_eq!(p.install(super::parts), n);
        }
    }

    #[test]
    fn for_each_visits_every_index_once() {
        let sum = AtomicUsize::new(0);
        super::for_each(100, |i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.into_inner(), 4950);
    }
}
