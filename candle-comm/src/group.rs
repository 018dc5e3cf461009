//! Sub-communicators: how ranks agree on their groups, and how a sub-communicator names its
//! ranks in errors (in the world and in the group).

use candle_core::{DType, Device, Tensor};

use crate::error::{CandleContext, CommError, GroupRank, Op, Result};

/// Largest color or key accepted by [`Communicator::split`](crate::Communicator::split) (MPI's
/// colors and keys are non-negative C `int`s).
pub const MAX_COLOR: usize = i32::MAX as usize;

/// Where a communicator sits in the world it was split from: nothing for a world, the group
/// (this rank's [`GroupRank`] and the world rank of every group rank) for a sub-communicator.
#[derive(Debug, Clone, Default)]
pub(crate) struct Membership(Option<Box<Group>>);

#[derive(Debug, Clone)]
struct Group {
    at: GroupRank,
    /// `members[r]`: world rank of group rank `r`.
    members: Vec<usize>,
}

impl Membership {
    /// World rank of rank `rank` of this communicator.
    pub(crate) fn world_rank(&self, rank: usize) -> usize {
        match &self.0 {
            Some(g) => g.members.get(rank).copied().unwrap_or(rank),
            None => rank,
        }
    }

    /// Size of the world, for a communicator of `size` ranks.
    pub(crate) fn world_size(&self, size: usize) -> usize {
        self.0.as_ref().map_or(size, |g| g.at.world_size)
    }

    /// This rank's place in the world and the group, for a sub-communicator.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn label(&self) -> Option<&GroupRank> {
        self.0.as_ref().map(|g| &g.at)
    }

    /// `rank R of N` for a world, `world rank W of N (rank R of n in NAME COLOR)` for a group.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn describe(&self, rank: usize, size: usize) -> String {
        match self.label() {
            Some(at) => at.to_string(),
            None => format!("rank {rank} of {size}"),
        }
    }

    /// Adds the group context ([`CommError::InGroup`]) to an error of a sub-communicator.
    pub(crate) fn wrap<T>(&self, result: Result<T>) -> Result<T> {
        match (result, &self.0) {
            (Err(e), Some(g)) if !matches!(e, CommError::InGroup { .. }) => {
                let peer_world = e.peer().and_then(|p| g.members.get(p).copied());
                Err(CommError::InGroup {
                    group: g.at.clone(),
                    peer_world,
                    source: Box::new(e),
                })
            }
            (r, _) => r,
        }
    }
}

/// The [`Communicator`](crate::Communicator) methods of a backend that does the work in
/// group-free `raw_*` methods (`raw_all_reduce`, `raw_reduce_scatter`, `raw_all_gather`,
/// `raw_broadcast`, `raw_send`, `raw_recv`) and names its group in a `group: Membership`
/// field: each method adds the group context ([`Membership::wrap`]) to its `raw_*` method's
/// result. Invoked inside the backend's `impl Communicator`, where `Tensor`, `Device`,
/// `ReduceOp` and `Result` name Candle's and this crate's types.
macro_rules! group_wrapped_ops {
    () => {
        fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
            self.group.wrap(self.raw_all_reduce(tensor, op))
        }

        fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor> {
            self.group.wrap(self.raw_reduce_scatter(tensor, op))
        }

        fn all_gather(&self, tensor: &Tensor) -> Result<Tensor> {
            self.group.wrap(self.raw_all_gather(tensor))
        }

        fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Tensor> {
            self.group.wrap(self.raw_broadcast(tensor, root))
        }

        fn send(&self, tensor: &Tensor, to: usize, tag: u32) -> Result<()> {
            self.group.wrap(self.raw_send(tensor, to, tag))
        }

        fn recv(&self, from: usize, tag: u32, device: &Device) -> Result<Tensor> {
            self.group.wrap(self.raw_recv(from, tag, device))
        }
    };
}
pub(crate) use group_wrapped_ops;

/// What the ranks agreed on in a split, seen from one rank.
#[derive(Debug)]
pub(crate) struct Plan {
    /// Every group, by increasing color: the ranks of the split communicator in group-rank order.
    pub(crate) groups: Vec<Vec<usize>>,
    /// Index of this rank's group in `groups`.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) mine: usize,
    /// This rank in its group.
    pub(crate) rank: usize,
    /// The membership of this rank's new communicator.
    pub(crate) membership: Membership,
}

/// Agrees on the groups of a split: one all-gather (`gather`, the backend's own, without group
/// context) of every rank's `(color, key, world rank)`. Ranks with the same color form a group,
/// ordered by key, then by their rank in `comm`. A color or key above [`MAX_COLOR`] on any rank
/// is an error on every rank (naming it), so that all ranks leave the split together.
pub(crate) fn plan(
    rank: usize,
    size: usize,
    parent: &Membership,
    name: &str,
    color: usize,
    key: usize,
    gather: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Plan> {
    let op = Op::Split;
    let ok = color <= MAX_COLOR && key <= MAX_COLOR;
    let mine = [
        f64::from(u8::from(ok)),
        color.min(MAX_COLOR) as f64,
        key.min(MAX_COLOR) as f64,
        parent.world_rank(rank) as f64,
    ];
    let t = Tensor::from_vec(mine.to_vec(), (1, 4), &Device::Cpu).at(rank, op)?;
    let all = gather(&t)?
        .to_dtype(DType::F64)
        .and_then(|t| t.to_vec2::<f64>())
        .at(rank, op)?;
    if all.len() != size || all.iter().any(|r| r.len() != 4) {
        return Err(CommError::InvalidArgument {
            rank,
            op,
            message: format!("split gathered {} entries for {size} ranks", all.len()),
        });
    }
    if let Some(bad) = all.iter().position(|r| r[0] == 0.0) {
        return Err(CommError::InvalidArgument {
            rank,
            op,
            message: format!(
                "rank {bad} passed a color or key above {MAX_COLOR} (colors and keys are \
                 non-negative C ints in MPI)"
            ),
        });
    }
    // Exact: every value is an integer below 2^31.
    let (colors, keys, worlds): (Vec<usize>, Vec<usize>, Vec<usize>) = (
        all.iter().map(|r| r[1] as usize).collect(),
        all.iter().map(|r| r[2] as usize).collect(),
        all.iter().map(|r| r[3] as usize).collect(),
    );
    let mut distinct = colors.clone();
    distinct.sort_unstable();
    distinct.dedup();
    let groups: Vec<Vec<usize>> = distinct
        .iter()
        .map(|&c| {
            let mut g: Vec<usize> = (0..size).filter(|&r| colors[r] == c).collect();
            g.sort_by_key(|&r| (keys[r], r));
            g
        })
        .collect();
    let mine = distinct
        .binary_search(&color)
        .map_err(|_| CommError::InvalidArgument {
            rank,
            op,
            message: format!("color {color} is missing from the gathered colors"),
        })?;
    let members = &groups[mine];
    let group_rank =
        members
            .iter()
            .position(|&r| r == rank)
            .ok_or_else(|| CommError::InvalidArgument {
                rank,
                op,
                message: "this rank is missing from its own group".to_string(),
            })?;
    let at = GroupRank {
        world_rank: parent.world_rank(rank),
        world_size: parent.world_size(size),
        name: name.to_string(),
        color,
        rank: group_rank,
        size: members.len(),
    };
    let membership = Membership(Some(Box::new(Group {
        at,
        members: members.iter().map(|&r| worlds[r]).collect(),
    })));
    Ok(Plan {
        groups,
        mine,
        rank: group_rank,
        membership,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gather_of(rows: Vec<[f64; 4]>) -> impl FnOnce(&Tensor) -> Result<Tensor> {
        move |_| {
            let n = rows.len();
            let flat: Vec<f64> = rows.into_iter().flatten().collect();
            Tensor::from_vec(flat, (n, 4), &Device::Cpu).at(0, Op::Split)
        }
    }

    #[test]
    fn groups_are_ordered_by_color_then_key_then_rank() -> Result<()> {
        // Ranks 0..4 with colors [1, 0, 1, 0] and keys [5, 0, 5, 9].
        let rows = vec![
            [1.0, 1.0, 5.0, 10.0],
            [1.0, 0.0, 0.0, 11.0],
            [1.0, 1.0, 5.0, 12.0],
            [1.0, 0.0, 9.0, 13.0],
        ];
        let p = plan(2, 4, &Membership::default(), "g", 1, 5, gather_of(rows))?;
        assert_eq!(p.groups, vec![vec![1, 3], vec![0, 2]]);
        assert_eq!((p.mine, p.rank), (1, 1));
        // The membership maps group ranks to the world ranks the ranks reported.
        assert_eq!(p.membership.world_rank(0), 10);
        assert_eq!(p.membership.world_rank(1), 12);
        let at = p.membership.label().cloned();
        assert_eq!(
            at.map(|a| a.to_string()),
            Some("world rank 2 of 4 (rank 1 of 2 in g 1)".to_string())
        );
        Ok(())
    }

    #[test]
    fn a_bad_color_on_any_rank_fails_every_rank() {
        let rows = vec![[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]];
        let e = plan(0, 2, &Membership::default(), "g", 0, 0, gather_of(rows));
        let e = e.map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("rank 1 passed a color or key above"), "{e}");
        let e = plan(0, 1, &Membership::default(), "g", usize::MAX, 0, |t| {
            Ok(t.clone())
        });
        assert!(e.is_err());
    }
}
