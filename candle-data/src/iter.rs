//! A program's own iterator of batches as a [`DataSource`] (see
//! the trainer's `TrainerBuilder::batches`).
//!
//! The trainer draws training batches with its generator and may draw a step's batches twice
//! (once on the host to count the step's targets when it accumulates micro-batches, then for
//! the step), or draw them again after a step abandoned on a signal. So the adapter numbers the
//! draws by the generator's position (one `u64` a batch: draw `n` is the one made with the
//! generator at word `2n`) and keeps the last `keep` batches it took from the iterator: the same
//! generator state always gives the same batch, as [`DataSource::batch`] requires.
//!
//! A finite iterator that ends is an error naming how many batches it gave (the run stops
//! with it; its last checkpoint, if it writes any, is intact). There is no validation split:
//! a run fed this way does not evaluate.

use std::collections::VecDeque;
use std::sync::Mutex;

use candle_core::{Device, Tensor};
use rand::RngCore;
use rand_chacha::ChaCha8Rng;

use super::{Batch, BatchRequest, DataSource, Fingerprint, Split};
use crate::{Error, Result};

/// Something a program's batch iterator yields: a [`Batch`], or the input and target token ids
/// of one whole batch, row-major (`batch_size * block_size` each).
pub trait IntoBatch: Send {
    /// The batch of `rows x block` tokens on `device` (an error when the shape differs).
    fn into_batch(self, rows: usize, block: usize, device: &Device) -> Result<Batch>;
}

impl IntoBatch for Batch {
    fn into_batch(self, rows: usize, block: usize, device: &Device) -> Result<Batch> {
        if self.x.dims() != [rows, block] || self.y.dims() != [rows, block] {
            return Err(Error::Config(format!(
                "the batch has inputs {:?} and targets {:?} but the run draws [{rows}, \
                 {block}] (batch_size x block_size, times the data-parallel world)",
                self.x.dims(),
                self.y.dims()
            )));
        }
        let moved = |t: &Tensor| t.to_device(device);
        Ok(Batch {
            x: moved(&self.x)?,
            y: moved(&self.y)?,
            mask: self.mask.as_ref().map(moved).transpose()?,
            rows: self.rows,
            mask_counts: None,
            reference: self.reference.as_ref().map(moved).transpose()?,
            host_targets: None,
        })
    }
}

impl IntoBatch for (Vec<u32>, Vec<u32>) {
    fn into_batch(self, rows: usize, block: usize, device: &Device) -> Result<Batch> {
        let (x, y) = self;
        if x.len() != rows * block || y.len() != rows * block {
            return Err(Error::Config(format!(
                "the batch has {} input and {} target ids but the run draws {rows} rows of \
                 {block} (batch_size x block_size, times the data-parallel world)",
                x.len(),
                y.len()
            )));
        }
        Ok(Batch::from_host(x, y, (rows, block), device)?)
    }
}

/// One of the iterator's items, made a batch once the run's shape is known.
type Item = Box<dyn FnOnce(usize, usize, &Device) -> Result<Batch> + Send>;
type Items = Box<dyn Iterator<Item = Item> + Send>;

struct State {
    items: Items,
    /// Batches taken from the iterator, the last `keep` of them, the first being draw `first`.
    kept: VecDeque<Batch>,
    first: usize,
    ended: bool,
}

/// A program's batch iterator as a [`DataSource`] over a vocabulary of `vocab_size` ids.
pub struct BatchIter {
    vocab_size: usize,
    keep: usize,
    state: Mutex<State>,
}

impl BatchIter {
    /// Serves `batches` in order, keeping the last `keep` (the run's `grad_accum`).
    pub fn new<T: IntoBatch + 'static>(
        vocab_size: usize,
        batches: impl Iterator<Item = T> + Send + 'static,
        keep: usize,
    ) -> Self {
        let items: Items = Box::new(batches.map(|b| {
            Box::new(move |rows: usize, block: usize, device: &Device| {
                b.into_batch(rows, block, device)
            }) as Item
        }));
        BatchIter {
            vocab_size,
            keep: keep.max(1),
            state: Mutex::new(State {
                items,
                kept: VecDeque::new(),
                first: 0,
                ended: false,
            }),
        }
    }
}

impl DataSource for BatchIter {
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn describe(&self) -> String {
        format!(
            "the program's batch iterator: vocabulary {}",
            self.vocab_size
        )
    }

    fn draw(&self, want: &BatchRequest<'_>, rng: &mut ChaCha8Rng) -> Result<Batch> {
        let (split, batch_size, block_size) = (want.split, want.batch_size, want.block_size);
        if split == Split::Val {
            return Err(Error::Config(
                "a batch iterator has no validation split: a run fed by one does not evaluate"
                    .into(),
            ));
        }
        let draw = (rng.get_word_pos() / 2) as usize;
        rng.next_u64();
        let mut s = self
            .state
            .lock()
            .map_err(|_| Error::Config("the batch iterator panicked in another thread".into()))?;
        if draw < s.first {
            return Err(Error::Config(format!(
                "batch {draw} of the batch iterator was drawn again after batch {} (it keeps \
                 the last {}): a batch iterator feeds the training steps in order, once",
                s.first + s.kept.len() - 1,
                self.keep
            )));
        }
        while draw >= s.first + s.kept.len() {
            let taken = s.first + s.kept.len();
            let item = if s.ended { None } else { s.items.next() };
            let Some(item) = item else {
                s.ended = true;
                return Err(Error::Config(format!(
                    "the batch iterator ended after {taken} batches, before the run's last \
                     step: give it max_iters x grad_accum batches, or train fewer steps"
                )));
            };
            let b = item(batch_size, block_size, want.device)
                .map_err(|e| Error::Config(format!("batch {taken} of the batch iterator: {e}")))?;
            if s.kept.len() == self.keep {
                s.kept.pop_front();
                s.first += 1;
            }
            s.kept.push_back(b);
        }
        let b = s.kept[draw - s.first].clone();
        if b.x.dims() != [batch_size, block_size] {
            return Err(Error::Config(format!(
                "batch {draw} of the batch iterator was drawn as [{}, {}] and is asked for as \
                 [{batch_size}, {block_size}]",
                b.x.dim(0)?,
                b.x.dim(1)?
            )));
        }
        Ok(b)
    }

    fn encode(&self, _: &str) -> Result<Vec<u32>> {
        Err(Error::Config(
            "a batch iterator has no vocabulary to encode text with".into(),
        ))
    }

    fn decode(&self, _: &[u32]) -> Result<String> {
        Err(Error::Config(
            "a batch iterator has no vocabulary to decode tokens with".into(),
        ))
    }

    fn fingerprint(&self) -> Fingerprint {
        // Nothing identifies a program's stream: a checkpoint of such a run records the
        // vocabulary size only, and resuming it from its config's data is refused.
        Fingerprint {
            tokens: "batch-iterator".into(),
            vocab: format!("batch-iterator-{}", self.vocab_size),
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    fn draw(src: &BatchIter, rng: &mut ChaCha8Rng) -> Result<Vec<u32>> {
        let b = src.batch(Split::Train, 1, 2, rng, &Device::Cpu)?;
        Ok(b.x.flatten_all()?.to_vec1()?)
    }

    #[test]
    fn draws_are_numbered_by_the_generator_and_kept_for_a_step() {
        let items = (0u32..4).map(|i| (vec![i, i], vec![i, i]));
        let src = BatchIter::new(8, items, 2);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let mut ahead = rng.clone();
        assert_eq!(draw(&src, &mut ahead).unwrap(), [0, 0]);
        assert_eq!(draw(&src, &mut ahead).unwrap(), [1, 1]);
        // The step draws the same two again, then moves on.
        assert_eq!(draw(&src, &mut rng).unwrap(), [0, 0]);
        assert_eq!(draw(&src, &mut rng).unwrap(), [1, 1]);
        assert_eq!(draw(&src, &mut rng).unwrap(), [2, 2]);
        assert_eq!(draw(&src, &mut rng).unwrap(), [3, 3]);
        let err = draw(&src, &mut ChaCha8Rng::seed_from_u64(0)).unwrap_err();
        assert!(err.to_string().contains("drawn again"), "{err}");
        let err = draw(&src, &mut rng).unwrap_err();
        assert!(err.to_string().contains("ended after 4 batches"), "{err}");
    }

    #[test]
    fn a_batch_of_the_wrong_size_names_its_number() {
        let src = BatchIter::new(8, std::iter::once((vec![1u32; 3], vec![1u32; 3])), 1);
        let err = draw(&src, &mut ChaCha8Rng::seed_from_u64(0)).unwrap_err();
        assert!(
            err.to_string().contains("batch 0 of the batch iterator"),
            "{err}"
        );
        assert!(err.to_string().contains("3 input"), "{err}");
    }
}
