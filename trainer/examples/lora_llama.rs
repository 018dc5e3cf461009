//! LoRA fine-tuning of a Llama-family model through the library, fed by the program's own
//! batches (nanoGPT's `get_batch` over a character corpus), writing nothing to disk.
//! From the workspace root: `cargo run --release -p trainer --example lora_llama`
use rand::{Rng, SeedableRng};

/// `steps` LoRA steps (r 4, alpha 8) over the model in `base`, each on 4 rows of 32 characters
/// from the first 90% of `text` (the train split), drawn as nanoGPT draws them; the losses.
pub fn lora_losses(base: &str, text: &str, steps: usize) -> trainer::Result<Vec<f32>> {
    let vocab: std::collections::BTreeSet<char> = text.chars().collect(); // sorted
    let id = |c| vocab.range(..c).count() as u32;
    let ids: Vec<u32> = text.chars().map(id).collect();
    let (rows, block, mut rng) = (4, 32, rand_chacha::ChaCha8Rng::seed_from_u64(1337));
    let batches = std::iter::repeat_with(move || {
        let (mut x, mut y) = (vec![], vec![]);
        for _ in 0..rows {
            let i = rng.random_range(0..=(ids.len() * 9 / 10 - block - 1) as u64) as usize;
            x.extend(&ids[i..i + block]);
            y.extend(&ids[i + 1..=i + block]);
        }
        (x, y)
    });
    let mut trainer = trainer::train::Trainer::builder()
        .init_from(base)
        .lora(candle_peft::LoraConfig::new(4, 8.0))
        .batches(vocab.len(), batches)
        .batch(rows, block)
        .max_iters(steps)
        .build()?;
    (0..steps).map(|_| Ok(trainer.train_step()?.loss)).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let text = std::fs::read_to_string("data/tinyshakespeare.txt")?;
    let losses = lora_losses("trainer/tests/fixtures/lora/base", &text[..20_000], 20)?;
    std::io::Write::write_fmt(&mut std::io::stdout(), format_args!("losses: {losses:?}\n"))?;
    Ok(())
}
