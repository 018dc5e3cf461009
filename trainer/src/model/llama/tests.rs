use super::*;
use candle_core::Device;

#[test]
fn tiny_llama_trains_a_step() {
    let cfg = LlamaConfig::new(Family::Llama, 50, 2, 16, 4, 2, 24);
    let (model, params) = crate::model::init(&cfg, 1, &Device::Cpu).unwrap();
    let idx = Tensor::new(&[[1u32, 2, 3, 4], [5, 6, 7, 8]], &Device::Cpu).unwrap();
    let loss = model.loss(&idx, &idx, &Ctx::train(1)).unwrap();
    let g = loss.mean.backward().unwrap();
    for (n, v) in params.iter() {
        assert!(g.get(v).is_some(), "{n}");
    }
}
