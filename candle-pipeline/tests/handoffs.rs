//! Every activation and gradient that crosses between workers goes through the executor's
//! ordering (on a CUDA device: an event recorded on the sender's stream, waited on by the
//! receiver's), whatever the transport. Only a GPU can show the race itself; on the CPU the
//! ordering is a no-op that is still counted, so these tests check that no hand-off bypasses it.

mod common;

use std::sync::mpsc::{Receiver, Sender};

use candle_core::{Device, Tensor};
use candle_pipeline::transport::channel_mesh;
use candle_pipeline::{
    split_by_params, Action, Envelope, Expected, Handoffs, InProcess, LossReduction, Message,
    Microbatches, Pipeline, Schedule, Transport,
};
use common::{batch, mlp, sse};

/// `(activations, gradients)` the schedule moves between workers, counted from its actions.
fn moved(s: &Schedule) -> (usize, usize) {
    let (mut acts, mut grads) = (0, 0);
    for (w, list) in s.actions.iter().enumerate() {
        for a in list {
            match *a {
                Action::Forward { stage, .. }
                    if stage + 1 < s.stages && s.worker_of(stage + 1) != w =>
                {
                    acts += 1
                }
                Action::Backward { stage, .. } if stage > 0 && s.worker_of(stage - 1) != w => {
                    grads += 1
                }
                _ => {}
            }
        }
    }
    (acts, grads)
}

fn pipeline(workers: usize, v: usize, m: usize) -> (Pipeline, Microbatches) {
    let dev = Device::Cpu;
    let n = workers * v;
    let (layers, _) = mlp(n, 7, &dev);
    let stages = split_by_params(layers, n).unwrap();
    let pipe = Pipeline::new(stages, vec![dev.clone(); workers], sse).unwrap();
    let (x, t) = batch(11, 2 * m, &dev);
    let mbs = Microbatches::split(&x, &t, m, LossReduction::Sum).unwrap();
    (pipe, mbs)
}

fn schedules(workers: usize, m: usize) -> Vec<(Schedule, usize)> {
    vec![
        (Schedule::gpipe(workers, m).unwrap(), 1),
        (Schedule::one_f_one_b(workers, m).unwrap(), 1),
        (Schedule::interleaved(workers, 2, m).unwrap(), 2),
    ]
}

fn assert_all_ordered(h: &Handoffs, s: &Schedule, what: &str) {
    let (acts, grads) = moved(s);
    assert!(acts > 0 && grads > 0, "{what}: the schedule moves nothing");
    let expected = Handoffs {
        activations_sent: acts,
        gradients_sent: grads,
        received: acts + grads,
        ordered_sends: acts + grads,
        ordered_receives: acts + grads,
    };
    assert_eq!(*h, expected, "{what} ({})", s.name);
}

#[test]
fn every_handoff_is_ordered_for_gpipe_1f1b_and_interleaved() {
    for workers in [2, 3, 4] {
        for m in [1, 3, 5] {
            for (s, v) in schedules(workers, m) {
                let (pipe, mbs) = pipeline(workers, v, m);
                // Workers with their own pool run each action on a pool thread.
                let pipe = if m == 3 {
                    pipe.with_cpu_threads(1).unwrap()
                } else {
                    pipe
                };
                let out = pipe.step(&s, &mbs).unwrap();
                assert_all_ordered(&out.handoffs, &s, &format!("S={workers} m={m}"));
            }
        }
    }
}

/// A transport of its own: its own channels, and every message rebuilt from a copy of the
/// tensor (as a transport that serialises would), delivered in reverse order of arrival when
/// several wait. It never sees the ordering, so it cannot skip it.
struct Rebuilding {
    rank: usize,
    peers: Vec<Sender<Envelope>>,
    inbox: Receiver<Envelope>,
    held: std::cell::RefCell<Vec<Envelope>>,
}

fn rebuilding(n: usize) -> Vec<Rebuilding> {
    channel_mesh(n)
        .map(|(rank, peers, inbox)| Rebuilding {
            rank,
            peers,
            inbox,
            held: Default::default(),
        })
        .collect()
}

impl Transport for Rebuilding {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.peers.len()
    }
    fn send(&self, to: usize, msg: Message) -> candle_pipeline::Result<()> {
        let copy: Tensor = msg.tensor.copy().unwrap();
        let rebuilt = Message {
            payload: msg.payload,
            mb: msg.mb,
            stage: msg.stage,
            tensor: copy,
        };
        self.peers[to].send(Envelope::Data(rebuilt)).unwrap();
        Ok(())
    }
    fn recv(&self) -> candle_pipeline::Result<Envelope> {
        let mut held = self.held.borrow_mut();
        while let Ok(e) = self.inbox.try_recv() {
            held.push(e);
        }
        if let Some(e) = held.pop() {
            return Ok(e);
        }
        drop(held);
        Ok(self.inbox.recv().unwrap())
    }
    fn try_recv(&self) -> candle_pipeline::Result<Option<Envelope>> {
        Ok(None)
    }
    fn abort(&self) {
        for (w, p) in self.peers.iter().enumerate() {
            if w != self.rank {
                let _ = p.send(Envelope::Abort { from: self.rank });
            }
        }
    }
    fn recv_expected(&self, _expected: &Expected) -> candle_pipeline::Result<Envelope> {
        self.recv()
    }
}

// `Rebuilding` holds a `RefCell`: it is `Send`, not `Sync`, which is all `step_with` asks.
#[test]
fn a_transport_of_its_own_cannot_skip_the_ordering() {
    for (s, v) in schedules(3, 4) {
        let (pipe, mbs) = pipeline(3, v, 4);
        let plain = pipe.step(&s, &mbs).unwrap();
        let out = pipe.step_with(&s, &mbs, rebuilding(3)).unwrap();
        assert_all_ordered(&out.handoffs, &s, "rebuilding transport");
        assert_eq!(out.loss, plain.loss);
    }
}

/// Workers run alone ([`candle_pipeline::PipelineWorker::step`], as one per process would),
/// here on threads joined by in-process channels: the sender orders its tensor before the
/// transport sees it.
#[test]
fn workers_run_alone_order_every_handoff() {
    for (s, v) in schedules(3, 4) {
        let (pipe, mbs) = pipeline(3, v, 4);
        let workers = pipe.into_workers();
        let mut total = Handoffs::default();
        std::thread::scope(|scope| {
            let hs: Vec<_> = workers
                .iter()
                .zip(InProcess::endpoints(3))
                .map(|(w, t)| {
                    let (s, mbs) = (&s, &mbs);
                    scope.spawn(move || w.step(s, mbs, &t).unwrap())
                })
                .collect();
            for h in hs {
                total.add(&h.join().unwrap().handoffs);
            }
        });
        assert_all_ordered(&total, &s, "workers alone");
    }
}

/// A single worker moves nothing between workers: nothing to order, nothing counted.
#[test]
fn one_worker_moves_nothing() {
    let (pipe, mbs) = pipeline(1, 2, 3);
    let out = pipe
        .step(&Schedule::interleaved(1, 2, 3).unwrap(), &mbs)
        .unwrap();
    assert_eq!(out.handoffs, Handoffs::default());
}
