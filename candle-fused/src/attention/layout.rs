//! The layouts attention reads in place: a `[B, heads, T, D]` view that is a permutation of a
//! dense buffer with D innermost (a contiguous tensor; Llama's v, the `[B, T, KV, D]`
//! projection seen as `[B, KV, T, D]` by a transpose). Its gradient is made in the same
//! order, so the transpose's backward and the reshape before it are views, not copies.

use candle_core::{Layout, Result, Tensor};

/// The dimensions of a `[B, heads, T, D]` layout, outermost (largest stride) first; a
/// dimension of size 1 is stepped along never and goes first. D must come last (unit stride):
/// otherwise the contiguous order.
pub(super) fn order(dims: &[usize], strides: &[usize]) -> [usize; 4] {
    let mut order = [0, 1, 2, 3];
    order.sort_by_key(|&i| {
        let s = if dims[i] > 1 { strides[i] } else { usize::MAX };
        (std::cmp::Reverse(s), i)
    });
    if order[3] == 3 {
        order
    } else {
        [0, 1, 2, 3]
    }
}

/// A dense buffer of `dims` in `order` (outermost first): its shape, the strides it gives
/// each of `dims`, and the permutation that turns a tensor of that shape back into `dims`.
pub(super) fn permuted(dims: &[usize], order: [usize; 4]) -> (Vec<usize>, Vec<usize>, [usize; 4]) {
    let shape: Vec<usize> = order.iter().map(|&i| dims[i]).collect();
    let dense = Layout::contiguous(shape.as_slice());
    let (mut strides, mut back) = (vec![0; 4], [0; 4]);
    for (j, &i) in order.iter().enumerate() {
        strides[i] = dense.stride()[j];
        back[i] = j;
    }
    (shape, strides, back)
}

/// Whether the kernels read `l` (a `[B, heads, T, D]` layout) in place: a permutation of a
/// dense buffer, D innermost.
pub(super) fn in_place(l: &Layout) -> bool {
    let (dims, strides) = (l.dims(), l.stride());
    if dims.len() != 4 {
        return false;
    }
    let (_, want, _) = permuted(dims, order(dims, strides));
    dims.iter()
        .zip(strides.iter().zip(&want))
        .all(|(&d, (s, w))| d <= 1 || s == w)
}

/// The elements of `l` from its start to its last one, in a storage `all`.
pub(super) fn span<'a, T>(all: &'a [T], l: &Layout) -> Result<&'a [T]> {
    let last: usize = l
        .dims()
        .iter()
        .zip(l.stride())
        .map(|(&d, &s)| d.saturating_sub(1) * s)
        .sum();
    let (a, n) = (
        l.start_offset(),
        usize::from(l.shape().elem_count() > 0) + last,
    );
    match all.get(a..a + n) {
        Some(s) => Ok(s),
        None => candle_core::bail!("candle-fused: attention input outside its storage"),
    }
}

/// The gradient of an input laid out as `x` ([`in_place`]) from the elements written in that
/// order (`data`, as long as `x`'s span): a tensor of `x`'s dims with `x`'s strides.
pub(super) fn grad_as<T: candle_core::WithDType>(x: &Tensor, data: Vec<T>) -> Result<Tensor> {
    let (shape, _, back) = permuted(x.dims(), order(x.dims(), x.stride()));
    Tensor::from_vec(data, shape, x.device())?.permute(back)
}

/// Where the kernels find row `t` of head `(b, h)` of `l` in its [`span`].
pub(super) fn view(l: &Layout) -> super::View {
    let s = l.stride();
    super::View {
        off: 0,
        sb: s[0],
        sh: s[1],
        st: s[2],
    }
}
