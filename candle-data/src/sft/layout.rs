//! Laying examples out in a batch's rows: packed (several examples a row, best-fit
//! decreasing) or padded (one example a row).
//!
//! Each example brings its own inputs `tokens[..n-1]` and targets `tokens[1..]` (target `j`
//! counts iff `counted[j + 1]`), so no target ever crosses from one example into the next.

use super::Example;

/// The host-side contents of a batch: `batch_size * block_size` values each, row-major.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Layout {
    pub x: Vec<u32>,
    pub y: Vec<u32>,
    pub mask: Vec<f32>,
    /// Positions within each example (packed rows only).
    pub positions: Option<Vec<u32>>,
    /// Document id of each token, distinct per example within a row (packed rows only).
    pub doc_ids: Option<Vec<u32>>,
}

/// Number of inputs `ex` fills in a row of `block_size` (it is cut to `block_size + 1`
/// tokens, keeping the start).
pub(crate) fn input_len(ex: &Example, block_size: usize) -> usize {
    ex.tokens.len().saturating_sub(1).min(block_size)
}

/// Appends `ex`'s inputs, targets and weights (cut to `block_size` inputs).
fn push_example(l: &mut Layout, ex: &Example, block_size: usize) {
    let n = input_len(ex, block_size);
    l.x.extend_from_slice(&ex.tokens[..n]);
    l.y.extend_from_slice(&ex.tokens[1..=n]);
    l.mask
        .extend(ex.counted[1..=n].iter().map(|&c| if c { 1.0 } else { 0.0 }));
}

/// Appends `n` padding slots (`pad` in and out, weight 0).
fn push_padding(l: &mut Layout, n: usize, pad: u32) {
    l.x.extend(std::iter::repeat_n(pad, n));
    l.y.extend(std::iter::repeat_n(pad, n));
    l.mask.extend(std::iter::repeat_n(0.0, n));
}

/// One example a row, right-padded with `pad` (masked); default positions and documents.
/// `examples.len()` must be `batch_size`.
pub(crate) fn padded(examples: &[&Example], block_size: usize, pad: u32) -> Layout {
    let mut l = Layout {
        x: Vec::new(),
        y: Vec::new(),
        mask: Vec::new(),
        positions: None,
        doc_ids: None,
    };
    for ex in examples {
        push_example(&mut l, ex, block_size);
        push_padding(&mut l, block_size - input_len(ex, block_size), pad);
    }
    l
}

/// Rows being filled: each row's free slots and the examples placed in it.
pub(crate) struct Packer {
    free: Vec<usize>,
    rows: Vec<Vec<usize>>,
}

impl Packer {
    /// `rows` empty rows of `block_size` slots.
    pub(crate) fn new(rows: usize, block_size: usize) -> Self {
        Packer {
            free: vec![block_size; rows],
            rows: vec![Vec::new(); rows],
        }
    }

    /// Places example `i` of `len` inputs into the row with the least room that still holds
    /// it (the first such row on ties); `false` if no row has room.
    pub(crate) fn place(&mut self, i: usize, len: usize) -> bool {
        let best = (0..self.free.len())
            .filter(|&r| self.free[r] >= len)
            .min_by_key(|&r| (self.free[r], r));
        if let Some(r) = best {
            self.free[r] -= len;
            self.rows[r].push(i);
        }
        best.is_some()
    }

    /// Places examples `0..lens.len()` best-fit decreasing: longest first (ties in index
    /// order); those that fit nowhere are left out.
    pub(crate) fn place_decreasing(&mut self, lens: &[usize]) {
        let mut order: Vec<usize> = (0..lens.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(lens[i])); // stable: ties keep index order
        for i in order {
            self.place(i, lens[i]);
        }
    }

    /// Whether every slot is taken.
    pub(crate) fn is_full(&self) -> bool {
        self.free.iter().all(|&f| f == 0)
    }

    /// Each row's examples, in placement order.
    pub(crate) fn into_rows(self) -> Vec<Vec<usize>> {
        self.rows
    }
}

/// Assigns examples (by their input lengths `lens`) to `rows` rows of `block_size` slots by
/// best-fit decreasing; see [`Packer::place_decreasing`].
#[cfg(test)]
pub(crate) fn best_fit_decreasing(
    lens: &[usize],
    rows: usize,
    block_size: usize,
) -> Vec<Vec<usize>> {
    let mut p = Packer::new(rows, block_size);
    p.place_decreasing(lens);
    p.into_rows()
}

/// Lays out `rows` (indices into `examples`, as a [`Packer`] placed them) as rows of
/// `block_size` inputs: positions restart at 0 for every example, each example of a row gets
/// its own document id (0, 1, ...), and the padding at a row's end gets the next id, its own
/// positions from 0, and weight 0.
pub(crate) fn packed(
    examples: &[&Example],
    rows: Vec<Vec<usize>>,
    block_size: usize,
    pad: u32,
) -> Layout {
    let lens: Vec<usize> = examples.iter().map(|e| input_len(e, block_size)).collect();
    let cap = rows.len() * block_size;
    let mut l = Layout {
        x: Vec::with_capacity(cap),
        y: Vec::with_capacity(cap),
        mask: Vec::with_capacity(cap),
        positions: None,
        doc_ids: None,
    };
    let mut positions = Vec::with_capacity(cap);
    let mut doc_ids = Vec::with_capacity(cap);
    for row in rows {
        let mut used = 0;
        let mut doc = 0u32;
        for i in row {
            push_example(&mut l, examples[i], block_size);
            positions.extend(0..lens[i] as u32);
            doc_ids.extend(std::iter::repeat_n(doc, lens[i]));
            used += lens[i];
            doc += 1;
        }
        let rest = block_size - used;
        push_padding(&mut l, rest, pad);
        positions.extend(0..rest as u32);
        doc_ids.extend(std::iter::repeat_n(doc, rest));
    }
    l.positions = Some(positions);
    l.doc_ids = Some(doc_ids);
    l
}
