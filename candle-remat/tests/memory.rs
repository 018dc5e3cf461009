//! Peak heap with checkpointing is a fraction of the plain one (dhat counting allocator), and
//! the tape frees every recomputed segment before the next: peak does not grow with depth.

mod common;

use candle_core::{DType, Device};
use candle_remat::{Policy, Tape};
use common::{tokens, uniform_costs, Cfg, Gpt};

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

fn step_peak(gpt: &Gpt, policy: Policy, t: usize) -> u64 {
    let dev = Device::Cpu;
    let (idx, tgt) = tokens(1, 4, t, gpt.cfg.vocab, &dev).unwrap();
    let n = gpt.blocks.len();
    let plan = policy.plan(&uniform_costs(n, 10, 1, 1)).unwrap();
    let base = dhat::HeapStats::get().curr_bytes as u64;
    let before_max = dhat::HeapStats::get().max_bytes as u64;
    let tape = Tape::new(0);
    let loss = gpt.loss(&tape, &plan, &idx, &tgt).unwrap();
    let grads = tape.backward(&loss).unwrap();
    drop((grads, loss));
    let max = dhat::HeapStats::get().max_bytes as u64;
    assert!(
        max > before_max,
        "peak did not exceed an earlier run; order runs by increasing peak"
    );
    max - base
}

#[test]
fn checkpointing_cuts_peak_heap_and_frees_segments() {
    let _prof = dhat::Profiler::builder()
        .testing()
        .trim_backtraces(Some(1))
        .build();
    let dev = Device::Cpu;
    let mut cfg = Cfg::tiny(32, 4, 4, 64);
    cfg.dropout = 0.0;
    let gpt4 = Gpt::new(0, cfg, DType::F32, &dev).unwrap();
    cfg.n_layer = 8;
    let gpt8 = Gpt::new(0, cfg, DType::F32, &dev).unwrap();
    // Runs ordered by increasing peak, since dhat's max cannot be reset.
    let ck4 = step_peak(&gpt4, Policy::EveryK(1), 64);
    let ck8 = step_peak(&gpt8, Policy::EveryK(1), 64);
    let plain4 = step_peak(&gpt4, Policy::None, 64);
    let plain8 = step_peak(&gpt8, Policy::None, 64);
    // Plain memory grows with depth; checkpointed memory grows only by boundaries and grads.
    assert!(
        plain8 as f64 > 1.6 * plain4 as f64,
        "plain {plain4} -> {plain8}"
    );
    assert!(
        (ck8 as f64) < 1.35 * ck4 as f64,
        "checkpointed {ck4} -> {ck8}"
    );
    assert!(
        plain8 as f64 > 2.5 * ck8 as f64,
        "plain {plain8} vs checkpointed {ck8}"
    );
}
