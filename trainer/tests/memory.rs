//! Training does not accumulate memory across steps.
//!
//! Candle leaves the backward graph attached to the gradients of variables; an optimiser that
//! keeps those tensors in its moments retains every step's activations. Live heap (counted by
//! dhat's allocator) must stay flat from step 5 to step 25.

use candle_core::{Device, Tensor};
use candle_nn::Optimizer;
use trainer::model::{cross_entropy, Ctx, Gpt, GptConfig};
use trainer::optim::{AdamW, AdamWConfig};

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

#[test]
fn live_heap_is_flat_across_steps() {
    let _profiler = dhat::Profiler::builder().testing().build();
    let cfg = GptConfig {
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        block_size: 16,
        vocab_size: 20,
        dropout: 0.1,
        bias: true,
        ..GptConfig::default()
    };
    let dev = Device::Cpu;
    let (model, params) = Gpt::new(&cfg, 0, &dev).unwrap();
    let mut opt = AdamW::new(&params, AdamWConfig::default()).unwrap();
    let ids: Vec<u32> = (0..4 * 17).map(|i| (i * 7 % 20) as u32).collect();
    let all = Tensor::from_vec(ids, (4, 17), &dev).unwrap();
    let (x, y) = (all.narrow(1, 0, 16).unwrap(), all.narrow(1, 1, 16).unwrap());
    let mut live = Vec::new();
    for step in 0..25 {
        let logits = model.forward(&x, &Ctx::train(step)).unwrap();
        let loss = cross_entropy(&logits, &y, None).unwrap();
        let grads = loss.backward().unwrap();
        opt.step(&grads).unwrap();
        drop((grads, loss, logits));
        live.push(dhat::HeapStats::get().curr_bytes);
    }
    let (at5, at25) = (live[4], live[24]);
    assert!(
        (at25 as f64) < at5 as f64 * 1.1,
        "live heap grew from {at5} B at step 5 to {at25} B at step 25: {live:?}"
    );
}
