//! All-reduce bandwidth under MPI: single messages by size (raw rsmpi vs the Tensor API), and a
//! GPT-sized list of gradients reduced in buckets vs one call per tensor.
//!
//! `cargo bench -p candle-comm --features mpi --bench allreduce --no-run`, then run the printed
//! binary with `mpirun -np 2 <binary> --bench` (rank 0 prints the tables).

use std::time::{Duration, Instant};

use candle_comm::{Communicator, GradBuckets, MpiComm, ReduceOp, DEFAULT_BUCKET_BYTES};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use mpi::collective::SystemOperation;
use mpi::traits::CommunicatorCollectives;

/// Runs `f` after a barrier until ~`budget` has passed (at least 3, at most 1000 times); returns
/// the mean time per call, the slowest rank's (all ranks run the same number of iterations).
fn time<F: FnMut() -> anyhow::Result<()>>(
    comm: &MpiComm,
    budget: Duration,
    mut f: F,
) -> anyhow::Result<f64> {
    f()?; // warm-up
    comm.barrier()?;
    let probe = Instant::now();
    f()?;
    let once = probe.elapsed().as_secs_f64().max(1e-6);
    let mine = Tensor::new(
        &[((budget.as_secs_f64() / once) as f32).clamp(3.0, 1000.0)],
        &Device::Cpu,
    )?;
    let iters = comm.all_reduce(&mine, ReduceOp::Min)?.to_vec1::<f32>()?[0] as usize;
    comm.barrier()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    let mine = Tensor::new(&[t0.elapsed().as_secs_f64() / iters as f64], &Device::Cpu)?;
    Ok(comm.all_reduce(&mine, ReduceOp::Max)?.to_vec1::<f64>()?[0])
}

fn gb_s(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// GPT-2-style parameter shapes (148 tensors for 12 layers).
fn gpt_shapes(layers: usize, c: usize, vocab: usize, ctx: usize) -> Vec<Vec<usize>> {
    let mut s = vec![vec![vocab, c], vec![ctx, c]];
    for _ in 0..layers {
        s.extend([
            vec![c],
            vec![c],
            vec![c, 3 * c],
            vec![3 * c],
            vec![c, c],
            vec![c],
        ]);
        s.extend([
            vec![c],
            vec![c],
            vec![c, 4 * c],
            vec![4 * c],
            vec![4 * c, c],
            vec![c],
        ]);
    }
    s.extend([vec![c], vec![c]]);
    s
}

fn main() -> anyhow::Result<()> {
    let comm = MpiComm::init()?;
    let (rank, n) = (comm.rank(), comm.world_size());
    let say = |s: String| {
        if rank == 0 {
            println!("{s}");
        }
    };
    say(format!(
        "all-reduce (sum, f32), {n} ranks; busbw = algbw * 2(n-1)/n"
    ));
    say("raw: MPI_Allreduce on reused Vec<f32> buffers; raw fresh: a new result Vec per call (as the".into());
    say("Tensor API must allocate its result); Tensor API: Communicator::all_reduce_sum on a tensor".into());
    say(
        "| message | raw ms | raw busbw GB/s | raw fresh ms | Tensor API ms | Tensor busbw GB/s |"
            .into(),
    );
    say("|---|---|---|---|---|---|".into());
    let bus = 2.0 * (n as f64 - 1.0) / n as f64;
    for kib in [4usize, 64, 1024, 4096, 16384, 65536] {
        let elems = kib * 1024 / 4;
        let send = vec![1f32; elems];
        let mut recv = vec![0f32; elems];
        let raw = time(&comm, Duration::from_millis(700), || {
            comm.raw()
                .all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
            Ok(())
        })?;
        let fresh = time(&comm, Duration::from_millis(700), || {
            let mut out = vec![0f32; elems];
            comm.raw()
                .all_reduce_into(&send[..], &mut out[..], SystemOperation::sum());
            Ok(())
        })?;
        let t = Tensor::ones(elems, DType::F32, &Device::Cpu)?;
        let api = time(&comm, Duration::from_millis(700), || {
            Ok(comm.all_reduce_sum(&t).map(|_| ())?)
        })?;
        let bytes = elems * 4;
        let size = if kib >= 1024 {
            format!("{} MiB", kib / 1024)
        } else {
            format!("{kib} KiB")
        };
        say(format!(
            "| {size} | {:.3} | {:.2} | {:.3} | {:.3} | {:.2} |",
            raw * 1e3,
            bus * gb_s(bytes, raw),
            fresh * 1e3,
            api * 1e3,
            bus * gb_s(bytes, api)
        ));
    }

    let models = [
        (
            "GPT 12 x 256 (vocab 65, T 256)",
            gpt_shapes(12, 256, 65, 256),
        ),
        (
            "GPT-2 small 12 x 768 (vocab 50257, T 1024)",
            gpt_shapes(12, 768, 50257, 1024),
        ),
    ];
    for (name, shapes) in models {
        let vars = shapes
            .iter()
            .map(|s| Var::zeros(s.as_slice(), DType::F32, &Device::Cpu))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let params: usize = vars.iter().map(|v| v.elem_count()).sum();
        let bytes = params * 4;
        say(String::new());
        say(format!(
            "{name}: {} tensors, {:.1} M parameters, {:.1} MB of f32 gradients",
            vars.len(),
            params as f64 / 1e6,
            bytes as f64 / 1e6
        ));
        say(
            "| mode | buckets | all-reduce calls | ms per gradient all-reduce | busbw GB/s |"
                .into(),
        );
        say("|---|---|---|---|---|".into());
        let mut grads = GradStore::default();
        for v in &vars {
            grads.insert(v.as_tensor(), v.as_tensor().ones_like()?);
        }
        for (mode, bucket) in [
            ("bucketed 25 MiB", DEFAULT_BUCKET_BYTES),
            ("bucketed 4 MiB", 4 << 20),
            ("per tensor", 0),
        ] {
            let buckets = GradBuckets::new(vars.clone(), bucket);
            let mut calls = 0;
            let secs = time(&comm, Duration::from_secs(3), || {
                let mut g = GradStore::default();
                for v in &vars {
                    if let Some(t) = grads.get(v.as_tensor()) {
                        g.insert(v.as_tensor(), t.clone());
                    }
                }
                calls = buckets.all_reduce_mean(&comm, &mut g)?.calls;
                Ok(())
            })?;
            say(format!(
                "| {mode} | {} | {calls} | {:.1} | {:.2} |",
                buckets.num_buckets(),
                secs * 1e3,
                bus * gb_s(bytes, secs)
            ));
        }
    }
    Ok(())
}
