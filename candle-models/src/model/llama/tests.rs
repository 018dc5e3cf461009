use super::*;
use crate::model::Ctx;
use candle_core::{Device, Tensor};

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

#[test]
fn links_own_every_parameter_once() {
    for family in Family::ALL {
        let mut cfg = LlamaConfig::new(family, 30, 2, 16, 4, 2, 24);
        cfg.tie_word_embeddings = family == Family::Qwen2;
        let (model, params) = crate::model::init(&cfg, 3, &Device::Cpu).unwrap();
        params.check_ownership(&model.links()).unwrap();
        let mapped = model.to_dtype(candle_core::DType::F64).unwrap();
        let weights: usize = mapped.links().iter().map(|l| l.params().len()).sum();
        assert_eq!(weights, params.len(), "{family:?}");
    }
}
