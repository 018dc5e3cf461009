//! Process-wide settings for a fast CPU step, applied once at start-up by [`init`], a run's
//! GPU settings ([`apply_gpu_settings`]); the memory the process may use is
//! `load::fits`'.
//!
//! Both were found with `perf` on the step bench (`cargo bench -p trainer --bench step`), 2
//! cores, GPT 4/4/256:
//!
//! * **Short spins in Candle's pool.** Candle 0.11 runs element-wise ops on 64K+ elements on a
//!   pool of its own (`candle-bp-*` threads, one fewer than the cores), beside rayon's pool,
//!   which runs Candle's own matmul (the `--kernels reference` path). Its workers spin ~25 000
//!   times before they park, holding a core that a rayon thread needs: with the default, the
//!   main thread spent 30% of the fused step in the barrier pool's wait (`BarrierGuard::drop`)
//!   while `candle-fused` still ran on rayon. With 2 000 spins
//!   (`CANDLE_BARRIER_POOL_SPIN_LIMIT`, unless the user set it) the workers park soon after
//!   their op. Since `candle-fused`'s kernels run on Candle's pool too,
//!   the limit hardly matters for the fused step (2 000, 25 000 and 100 000 were within the
//!   noise of alternating runs); it is kept for the reference path.
//! * **Freed memory is reused, not returned.** Every tensor is a fresh allocation, and glibc
//!   serves large ones with `mmap` and gives them back on free, so each step page-faults its
//!   activations and gradients in again: 13% of the step's samples were in the kernel's page
//!   fault handler. With the mmap and trim thresholds raised, freed buffers stay in the heap
//!   and the next step reuses them (as PyTorch's CPU caching allocator does).

/// Applies both settings. Call at the start of `main`, before any tensor op and before other
/// threads start (Candle's pool reads its variable once, when it is first created).
pub fn init() {
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", "2000");
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only changes glibc's allocation thresholds; called before any other
    // thread exists.
    unsafe {
        // 1 GiB: above every tensor of the models the trainer runs on a CPU.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

/// Allocator settings for a streaming job (`trainer prepare`), replacing [`init`]'s: one heap
/// arena (buffers filled on worker threads and freed on the writer thread otherwise fragment
/// one arena per worker, and the heap grows with the input: 132 MiB of anonymous memory for
/// 300 MB of text instead of 98), large buffers mapped and unmapped on their own, and freed
/// memory given back. Call before the worker threads start.
pub fn init_streaming() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only changes glibc's allocation settings; called before the job's
    // worker threads exist.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 4 << 20);
    }
}

/// Applies a run's GPU settings to the whole process (Candle and candle-fused read them at
/// each launch), before its first op: TF32 for f32 matmuls on CUDA (`tf32`, the run's
/// `tf32`, on by default as in nanoGPT) and candle-fused's Triton kernels (`triton_kernels`,
/// the run's flag: given, else the environment, else candle-fused's default). Neither changes
/// anything computed on the CPU (without the `cuda` feature Candle's setter is a no-op).
pub fn apply_gpu_settings(tf32: bool, triton_kernels: Option<bool>) {
    candle_core::cuda::set_gemm_reduced_precision_f32(tf32);
    set_triton_kernels(triton_kernels);
}

/// Switches candle-fused's Triton kernels on or off for the process as the run's flag says;
/// without the flag, candle-fused decides (`CANDLE_FUSED_TRITON`, else its default), also
/// after an earlier run in the same process gave the flag.
fn set_triton_kernels(flag: Option<bool>) {
    candle_fused::cuda_kernels::choose_triton(flag);
}

/// Whether candle-fused's Triton kernels are on for the process (the flag, else the
/// environment, else candle-fused's default; they only run on CUDA).
pub fn triton_kernels() -> bool {
    candle_fused::cuda_kernels::triton_enabled()
}
