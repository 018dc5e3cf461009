//! `prepare`'s token streams: each document's pieces go to the train or the validation split
//! (by the rule on its index, see [`VAL_SEED`]), and each split's stream is cut into shards of
//! [`PrepareOptions::shard_tokens`] tokens, skipping the tokens of shards a resumed run
//! already finished.

use std::path::Path;

use super::encode::Piece;
use super::format::{Expect, PairEntry, ShardEntry};
use super::options::PrepareOptions;
use super::progress::{load_partial, Progress, SplitState};
use super::unit::{start, Position};
use super::write::ShardWriter;
use crate::error::Result;
use crate::hash::splitmix64;

/// Seed of the validation rule (see the [`prepare`](super::prepare) module docs).
pub(super) const VAL_SEED: u64 = 0x5eed_da7a;

const SPLITS: [&str; 2] = ["train", "val"];

/// What every shard of one `prepare` holds: the token width, the vocabulary's hash, whether a
/// loss mask goes with the tokens, whether a pair table does.
#[derive(Clone, Copy, Debug)]
pub(super) struct ShardShape {
    pub width: u32,
    pub vocab: u64,
    pub mask: bool,
    pub pairs: bool,
}

impl ShardShape {
    /// An empty shard of this shape (with document starts).
    pub(super) fn writer(self) -> ShardWriter {
        let w = ShardWriter::new(self.width, self.vocab, true, self.mask);
        match self.pairs {
            true => w.with_pairs(&[]),
            false => w,
        }
    }
}

/// One split's token stream being cut into shards.
struct Stream {
    name: &'static str,
    writer: ShardWriter,
    /// Tokens emitted to this stream so far (skipped ones included).
    pos: u64,
    /// Tokens before this belong to finished shards (resume).
    skip_until: u64,
    done: Vec<ShardEntry>,
}

/// The train and validation streams of one `prepare`, cut into shard files in `dir`.
pub(super) struct Cutter<'a> {
    dir: &'a Path,
    shard_tokens: u64,
    shape: ShardShape,
    streams: [Stream; 2],
    doc: u64,
    in_val: bool,
    val_below: u64,
    /// Whether a shard was finished since this was last taken.
    pub finished_now: bool,
    /// Preference records dropped (their prompt fills the maximum length) so far.
    pub dropped: u64,
}

impl Stream {
    /// What a progress save records of this split.
    fn state(&self) -> SplitState<'_> {
        (self.name, &self.done, &self.writer)
    }
}

impl<'a> Cutter<'a> {
    /// A cutter at the start of the inputs, or where the interrupted run `resume` stopped
    /// (its finished shards skipped, its partial ones reloaded and checked against `expect`).
    pub(super) fn new(
        dir: &'a Path,
        opts: &PrepareOptions,
        shape: ShardShape,
        resume: Option<Progress>,
        expect: &Expect,
    ) -> Result<Self> {
        let val_below = (opts.val_fraction * 18_446_744_073_709_551_616.0) as u64;
        let at = resume.as_ref().map_or_else(start, |p| p.resume.clone());
        let partial = |i: usize| -> Result<ShardWriter> {
            match resume.as_ref().and_then(|p| p.partial[i].as_ref()) {
                Some(e) => load_partial(&dir.join(&e.file), expect),
                None => Ok(shape.writer()),
            }
        };
        let writers = [partial(0)?, partial(1)?];
        let [w0, w1] = writers;
        let stream = |i: usize, done: Vec<ShardEntry>, pos: u64, writer: ShardWriter| Stream {
            name: SPLITS[i],
            skip_until: done.len() as u64 * opts.shard_tokens + writer.len(),
            writer,
            pos,
            done,
        };
        let (done_t, done_v) = resume.map_or((Vec::new(), Vec::new()), |p| (p.train, p.val));
        let mut cut = Cutter {
            dir,
            shard_tokens: opts.shard_tokens,
            shape,
            streams: [
                stream(0, done_t, at.pos[0], w0),
                stream(1, done_v, at.pos[1], w1),
            ],
            doc: at.doc,
            in_val: false,
            val_below,
            finished_now: false,
            dropped: 0,
        };
        // A resumed unit in the middle of a text file continues the document before it.
        cut.in_val = at.doc > 0 && cut.is_val(at.doc - 1);
        Ok(cut)
    }

    fn is_val(&self, doc: u64) -> bool {
        splitmix64(doc ^ VAL_SEED) < self.val_below
    }

    /// Shards finished so far, both splits.
    pub(super) fn shards(&self) -> usize {
        self.streams[0].done.len() + self.streams[1].done.len()
    }

    /// `next` (where the following unit starts) with this cutter's counters, and what a
    /// progress save records of each split there.
    pub(super) fn save_point(&self, next: &Position) -> (Position, [SplitState<'_>; 2]) {
        let mut next = next.clone();
        next.doc = self.doc;
        next.pos = [self.streams[0].pos, self.streams[1].pos];
        (next, self.streams.each_ref().map(Stream::state))
    }

    /// Sends a unit's pieces to their splits; returns the tokens they held.
    pub(super) fn feed(&mut self, pieces: Vec<Piece>) -> Result<u64> {
        let mut made = 0;
        for p in pieces {
            if p.dropped {
                self.dropped += 1;
                continue;
            }
            if p.starts {
                self.in_val = self.is_val(self.doc);
                self.doc += 1;
            }
            made += p.tokens.len() as u64;
            let s = usize::from(self.in_val);
            let start = p.starts.then_some(p.pair);
            self.push(s, &p.tokens, p.counted.as_deref(), start)?;
        }
        Ok(made)
    }

    /// Pushes `tokens` to split `s`; `start` when they start a document (`Some(pair)` for a
    /// preference pair's).
    fn push(
        &mut self,
        s: usize,
        tokens: &[u32],
        counted: Option<&[bool]>,
        mut start: Option<Option<PairEntry>>,
    ) -> Result<()> {
        let n = tokens.len();
        let mut i = 0;
        while i < n {
            let st = &mut self.streams[s];
            if st.pos < st.skip_until {
                let k = ((st.skip_until - st.pos) as usize).min(n - i);
                i += k;
                st.pos += k as u64;
                start = None;
                continue;
            }
            let k = ((self.shard_tokens - st.writer.len()) as usize).min(n - i);
            match start.take() {
                Some(Some(pair)) => st.writer.start_pair(&pair),
                Some(None) => st.writer.start_doc(),
                None => {}
            }
            st.writer
                .push(&tokens[i..i + k], counted.map(|c| &c[i..i + k]));
            i += k;
            st.pos += k as u64;
            if st.writer.len() == self.shard_tokens {
                self.finish(s)?;
            }
        }
        Ok(())
    }

    fn finish(&mut self, s: usize) -> Result<()> {
        let fresh = self.shape.writer();
        let st = &mut self.streams[s];
        let writer = std::mem::replace(&mut st.writer, fresh);
        let file = format!("{}-{:05}.tok", st.name, st.done.len());
        st.done.push(writer.finish_entry(self.dir, file)?);
        self.finished_now = true;
        Ok(())
    }

    /// Finishes the last shard of each split; returns the train and val shards.
    pub(super) fn close(mut self) -> Result<[Vec<ShardEntry>; 2]> {
        for s in 0..2 {
            if !self.streams[s].writer.is_empty() {
                self.finish(s)?;
            }
        }
        Ok(self.streams.map(|s| s.done))
    }
}
