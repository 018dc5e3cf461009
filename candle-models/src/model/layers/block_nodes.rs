//! The graph nodes of one block's forward: each residual add runs inside the projection before
//! it where that projection has no bias and nothing sits between them (Llama's `o_proj` and
//! `down_proj`, GPT-2's `c_proj` with `bias = false` and no dropout running), so the block
//! has exactly the nodes of its two halves; a biased projection (Hugging Face's GPT-2), a
//! running dropout or Gemma's sandwich norms keep the add: two nodes more.
//!
//! Counted relative to the halves (each a norm, then the attention or the MLP, ending in its
//! projection), so the count holds whatever the attention or the MLP records inside.

use candle_core::{Device, Tensor, Var};

use super::super::gpt2::{Block as GptBlock, GptConfig};
use super::super::{Builder, Ctx, Dims, LinkOps};
use super::block::GatedMlp;
use super::{Attention, Block, BlockOptions, GateAct, RmsNorm};

/// The nodes of `y`'s graph that are not leaves.
fn nodes(y: &Tensor) -> usize {
    y.sorted_nodes().iter().filter(|t| !t.is_variable()).count()
}

fn var(shape: &[usize]) -> candle_core::Result<Tensor> {
    Ok(Var::randn(0f32, 0.5, shape, &Device::Cpu)?
        .as_tensor()
        .clone())
}

/// Every tensor a fresh `Var`.
fn vars(_: &str, shape: &[usize]) -> crate::Result<Tensor> {
    Ok(var(shape)?)
}

fn llama_options(biases: bool, sandwich_norms: bool) -> BlockOptions {
    BlockOptions {
        dims: Dims {
            hidden: 16,
            heads: 4,
            kv_heads: 2,
            head_dim: 4,
            mlp: 24,
            ..Dims::default()
        },
        biases: (false, biases, biases),
        qk_norm: false,
        window: None,
        norm_eps: 1e-5,
        inv_freq: vec![1.0, 0.1],
        dropout: 0.0,
        norm_unit_offset: false,
        sandwich_norms,
        act: GateAct::Silu,
        attn_scale: None,
    }
}

/// (the block's nodes, its two halves' nodes) for a Llama-family block.
fn llama_counts(biases: bool, sandwich_norms: bool) -> crate::Result<(usize, usize)> {
    let (o, b, ctx) = (
        llama_options(biases, sandwich_norms),
        Builder::root(&vars),
        Ctx::train(1),
    );
    let norm = |name: &str| RmsNorm::build(&b.pp(name), 16, 1e-5);
    let block = Block::build(&b, &o, 0)?;
    let x = var(&[2, 3, 16])?;
    let whole = nodes(&block.forward(&x, &ctx)?);
    let attn = Attention::build(&b.pp("self_attn"), &o, 1)?;
    let mlp = GatedMlp::build(&b.pp("mlp"), &o)?;
    let a = attn.forward(&norm("input_layernorm")?.forward(&x, &ctx)?, &ctx)?;
    let h = var(&[2, 3, 16])?;
    let m = match sandwich_norms {
        true => {
            let a = norm("post_attention_layernorm")?.forward(&a, &ctx)?;
            let pre = norm("pre_feedforward_layernorm")?.forward(&h, &ctx)?;
            let m = norm("post_feedforward_layernorm")?.forward(&mlp.forward(&pre, &ctx)?, &ctx)?;
            return Ok((whole, nodes(&a) + nodes(&m)));
        }
        false => mlp.forward(&norm("post_attention_layernorm")?.forward(&h, &ctx)?, &ctx)?,
    };
    Ok((whole, nodes(&a) + nodes(&m)))
}

#[test]
fn llama_block_fuses_both_residual_adds() -> crate::Result<()> {
    let (whole, halves) = llama_counts(false, false)?;
    assert_eq!(whole, halves, "Llama block: {whole} nodes, halves {halves}");
    // o_proj and down_proj with biases, Gemma's sandwich norms: the adds stay
    for (biases, sandwich) in [(true, false), (false, true)] {
        let (whole, halves) = llama_counts(biases, sandwich)?;
        assert_eq!(whole, halves + 2, "biases {biases} sandwich {sandwich}");
    }
    Ok(())
}

/// (the block's nodes, its two halves' nodes) for a GPT-2 block.
fn gpt2_counts(bias: bool, dropout: f32) -> crate::Result<(usize, usize)> {
    let cfg = GptConfig {
        n_layer: 1,
        n_head: 2,
        n_embd: 16,
        block_size: 8,
        vocab_size: 11,
        dropout,
        bias,
        ..GptConfig::default()
    };
    let block = GptBlock::build(&Builder::root(&vars), &cfg, 0)?;
    let ctx = Ctx::train(1);
    let x = var(&[2, 3, 16])?;
    let whole = nodes(&LinkOps::forward(&block, &x, &ctx)?);
    let a = block
        .attn
        .forward(&block.ln_1.forward_ctx(&x, &ctx)?, &ctx)?;
    let h = var(&[2, 3, 16])?;
    let m = block
        .mlp
        .forward(&block.ln_2.forward_ctx(&h, &ctx)?, &ctx)?;
    Ok((whole, nodes(&a) + nodes(&m)))
}

#[test]
fn gpt2_block_fuses_where_no_bias_and_no_dropout() -> crate::Result<()> {
    let (whole, halves) = gpt2_counts(false, 0.0)?;
    assert_eq!(whole, halves, "GPT-2 block without biases");
    for (bias, dropout) in [(true, 0.0), (false, 0.1)] {
        let (whole, halves) = gpt2_counts(bias, dropout)?;
        assert_eq!(whole, halves + 2, "bias {bias} dropout {dropout}");
    }
    Ok(())
}
