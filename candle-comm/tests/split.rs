//! Sub-communicators (`Communicator::split`) on `Local` and thread worlds of 1-5 ranks (the same
//! checks run under `mpirun` in the `mpi_collectives` example), and how a failing group member
//! is reported: naming it in the group and in the world.

mod common;

use std::time::{Duration, Instant};

use anyhow::Result;
use candle_comm::{run_threads, CommError, Communicator, Local, ReduceOp, MAX_COLOR};
use candle_core::{DType, Device, Tensor};

fn ones() -> Tensor {
    Tensor::ones(4, DType::F32, &Device::Cpu).expect("tensor")
}

#[test]
fn local_split() -> Result<()> {
    common::check_split(&Local::new())?;
    let sub = Local::new().split_group("pipeline", 3, 0)?;
    common::check_collectives(&sub, &Device::Cpu, DType::F32)?;
    Ok(())
}

#[test]
fn thread_split() {
    for n in 1..=5 {
        let out = run_threads(n, Duration::from_secs(30), |c| common::check_split(&c));
        for (rank, r) in out.into_iter().enumerate() {
            match r {
                Ok(Ok(())) => {}
                Ok(Err(e)) => panic!("world {n}, rank {rank}: {e:#}"),
                Err(_) => panic!("world {n}, rank {rank} panicked"),
            }
        }
    }
}

#[test]
fn a_thread_sub_communicator_is_send() {
    // `split_group` keeps the concrete type: a group endpoint can move to another thread.
    let out = run_threads(2, Duration::from_secs(30), |c| -> Result<f32> {
        let sub = c.split_group("g", 0, 0)?;
        let h = std::thread::spawn(move || -> Result<f32> {
            Ok(sub.all_reduce(&ones(), ReduceOp::Sum)?.to_vec1::<f32>()?[0])
        });
        h.join().map_err(|_| anyhow::anyhow!("panicked"))?
    });
    for r in out {
        assert_eq!(r.expect("no panic").expect("ok"), 2.0);
    }
}

/// 4 ranks split by parity; world rank 3 (rank 0 of 2 in group 1, key = rank reversed) fails
/// in its group: world rank 1 gets an error naming itself and the failed rank in the world and
/// in the group; the other group is unaffected.
#[test]
fn a_failing_group_member_is_named_in_the_group_and_the_world() {
    let out = run_threads(4, Duration::from_secs(30), |c| {
        let t0 = Instant::now();
        let sub = c.split_named("dp", c.rank() % 2, 3 - c.rank())?;
        if c.rank() == 3 {
            sub.abort("out of data at step 3");
            return Err(CommError::Init {
                op: candle_comm::Op::Init,
                message: "failed on purpose".into(),
            });
        }
        let r = sub.all_reduce(&ones(), ReduceOp::Sum).map(|_| ());
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        r
    });
    let mut out = out.into_iter().map(|r| r.expect("no panic"));
    assert!(out.next().is_some_and(|r| r.is_ok()), "rank 0");
    let e = out.next().and_then(|r| r.err()).expect("rank 1 fails");
    assert_eq!(
        e.to_string(),
        "world rank 1 of 4 (rank 1 of 2 in dp 1): rank 1, all_reduce: rank 0 failed: out of \
         data at step 3 [group rank 0 is world rank 3]"
    );
    assert!(
        matches!(
            e.inner(),
            CommError::PeerFailed {
                rank: 1,
                peer: 0,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        (e.rank(), e.world_rank(), e.peer()),
        (Some(1), Some(1), Some(0))
    );
    assert_eq!(e.group().map(|g| (g.color, g.size)), Some((1, 2)));
    assert!(out.next().is_some_and(|r| r.is_ok()), "rank 2");
}

/// A group member whose thread returns (dropping its endpoints) is reported as gone.
#[test]
fn a_vanished_group_member_is_named() {
    let out = run_threads(3, Duration::from_secs(30), |c| {
        let sub = c.split(0, 0)?;
        if c.rank() == 2 {
            return Ok(());
        }
        sub.all_reduce(&ones(), ReduceOp::Sum).map(|_| ())
    });
    let e = out[0]
        .as_ref()
        .expect("no panic")
        .as_ref()
        .expect_err("rank 0 fails");
    let s = e.to_string();
    assert!(
        s.starts_with("world rank 0 of 3 (rank 0 of 3 in group 0): rank 0, all_reduce: rank 2 failed: its endpoint was dropped"),
        "{s}"
    );
}

/// Backends without sub-communicators get the default: an `Unsupported` error.
#[test]
fn the_default_split_is_unsupported() {
    struct NoSplit(Local);
    impl Communicator for NoSplit {
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            1
        }
        fn backend(&self) -> &'static str {
            "nosplit"
        }
        fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> candle_comm::Result<Tensor> {
            self.0.all_reduce(t, op)
        }
        fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> candle_comm::Result<Tensor> {
            self.0.reduce_scatter(t, op)
        }
        fn all_gather(&self, t: &Tensor) -> candle_comm::Result<Tensor> {
            self.0.all_gather(t)
        }
        fn broadcast(&self, t: &Tensor, root: usize) -> candle_comm::Result<Tensor> {
            self.0.broadcast(t, root)
        }
        fn send(&self, t: &Tensor, to: usize, tag: u32) -> candle_comm::Result<()> {
            self.0.send(t, to, tag)
        }
        fn recv(&self, from: usize, tag: u32, d: &Device) -> candle_comm::Result<Tensor> {
            self.0.recv(from, tag, d)
        }
        fn barrier(&self) -> candle_comm::Result<()> {
            Ok(())
        }
        fn abort(&self, _reason: &str) {}
    }
    let e = NoSplit(Local::new())
        .split(0, 0)
        .err()
        .map(|e| e.to_string());
    assert_eq!(
        e.as_deref(),
        Some("rank 0, split: not supported by the nosplit backend")
    );
    // A color above MAX_COLOR is refused before any backend call.
    assert!(Local::new().split(MAX_COLOR + 1, 0).is_err());
}
