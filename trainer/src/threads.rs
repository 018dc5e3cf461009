//! One thread pool for the CPU step.
//!
//! Candle 0.11 runs element-wise ops on 64K+ elements on a pool of its own (`candle-bp-*`
//! threads, one fewer than the cores, spinning ~25 000 times before they park), beside rayon's
//! pool, which runs its GEMMs and every `candle-fused` kernel. On few cores the two pools fight
//! over the cores: on the 2-core bench machine the main thread spent 30% of the fused step
//! spinning in the barrier pool's wait for a worker that a rayon thread was holding the core
//! from (`perf`, `BarrierGuard::drop`), and the same step ran ~1.5x faster with the barrier
//! pool off. So the trainer turns it off (`CANDLE_NUM_THREADS=1`: Candle's element-wise ops
//! run on the calling thread) unless the user chose a value; the heavy element-wise work is in
//! `candle-fused` kernels on rayon, GEMMs keep all cores.

/// Keeps Candle's barrier pool off unless `CANDLE_NUM_THREADS` is set. Call at the start of
/// `main`, before any tensor op and before other threads start (the pool reads the variable
/// once, when it is first used).
pub fn single_pool() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
}
