//! Failure behaviour of the thread backend: a failing, panicking, vanished or hung rank makes
//! the others return an error naming it, quickly, never a hang; drift and mismatches are caught.

use std::time::{Duration, Instant};

use candle_comm::{
    check_in_sync, ensure_in_sync, or_abort, run_threads, CommError, Communicator, ThreadComm,
};
use candle_core::{DType, Device, Tensor, Var};

fn ones() -> Tensor {
    Tensor::ones(16, DType::F32, &Device::Cpu).unwrap()
}

/// Runs `f` on 2 ranks; returns rank 0's error, which must come in less than `within`.
fn rank0_error(
    timeout: Duration,
    within: Duration,
    f: impl Fn(&ThreadComm) -> candle_comm::Result<()> + Sync,
) -> CommError {
    let out = run_threads(2, timeout, |c| {
        let t0 = Instant::now();
        let r = f(&c);
        (r, t0.elapsed())
    });
    let mut out = out.into_iter();
    match out.next() {
        Some(Ok((Err(e), took))) => {
            assert!(took < within, "{took:?}");
            e
        }
        _ => panic!("rank 0 did not fail"),
    }
}

/// Rank 0's error names rank 1 as the peer at fault.
fn assert_names_rank1(e: &CommError) {
    assert_eq!((e.rank(), e.peer()), (Some(0), Some(1)), "{e}");
}

#[test]
fn failing_rank_is_named() {
    let e = rank0_error(Duration::from_secs(30), Duration::from_secs(5), |c| {
        c.all_reduce_sum(&ones())?;
        if c.rank() == 1 {
            let r: Result<(), String> = Err("out of data at step 3".to_string());
            return or_abort(c, r).map_err(|m| CommError::Init {
                op: candle_comm::Op::Init,
                message: m,
            });
        }
        c.all_reduce_sum(&ones()).map(|_| ())
    });
    assert!(matches!(e, CommError::PeerFailed { .. }), "{e}");
    assert_names_rank1(&e);
    assert_eq!(
        e.to_string(),
        "rank 0, all_reduce: rank 1 failed: out of data at step 3"
    );
}

#[test]
fn panicking_rank_is_named() {
    let e = rank0_error(Duration::from_secs(30), Duration::from_secs(5), |c| {
        if c.rank() == 1 {
            panic!("boom");
        }
        c.barrier()
    });
    assert!(matches!(e, CommError::PeerFailed { peer: 1, .. }), "{e}");
    assert!(e.to_string().contains("panicked"), "{e}");
}

#[test]
fn vanished_rank_is_named() {
    let e = rank0_error(Duration::from_secs(30), Duration::from_secs(5), |c| {
        if c.rank() == 1 {
            return Ok(()); // returns without taking part: its endpoint is dropped
        }
        c.recv(1, 3, &Device::Cpu).map(|_| ())
    });
    assert!(matches!(e, CommError::PeerFailed { .. }), "{e}");
    assert_names_rank1(&e);
    assert_eq!(e.op(), candle_comm::Op::Recv, "{e}");
}

#[test]
fn hung_rank_times_out() {
    let e = rank0_error(Duration::from_millis(300), Duration::from_secs(2), |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_secs(2));
            return Ok(());
        }
        c.all_reduce_sum(&ones()).map(|_| ())
    });
    assert!(matches!(e, CommError::Timeout { .. }), "{e}");
    assert_names_rank1(&e);
}

#[test]
fn shape_mismatch_is_reported_on_both_ranks() {
    let out = run_threads(2, Duration::from_secs(30), |c| {
        let t = Tensor::ones(4 + c.rank(), DType::F32, &Device::Cpu).unwrap();
        c.all_reduce_sum(&t).map(|_| ())
    });
    let errs: Vec<String> = out
        .into_iter()
        .map(|o| o.unwrap().unwrap_err().to_string())
        .collect();
    assert!(errs[0].contains("mismatch with rank 1"), "{}", errs[0]);
    assert!(
        errs[1].contains("rank 0 failed") && errs[1].contains("[5]"),
        "{}",
        errs[1]
    );
}

#[test]
fn weight_drift_is_detected() {
    let out = run_threads(3, Duration::from_secs(30), |c| {
        let v = Var::ones((4, 4), DType::F32, &Device::Cpu)?;
        ensure_in_sync(&c, std::slice::from_ref(&v))?;
        if c.rank() == 2 {
            v.set(&(v.as_tensor() * 1.000_001)?)?;
        }
        let report = check_in_sync(&c, std::slice::from_ref(&v))?;
        assert_eq!(report.differing, vec![2]);
        assert_eq!(report.fingerprints.len(), 3);
        let e = ensure_in_sync(&c, &[v]).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("weights differ from rank 0's on ranks [2]"),
            "{e}"
        );
        Ok::<_, anyhow::Error>(())
    });
    for o in out {
        o.unwrap().unwrap();
    }
}
