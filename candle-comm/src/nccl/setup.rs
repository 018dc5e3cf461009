//! Setting up NCCL communicators: the unique ids (one for the world, one per ordered pair of
//! ranks for point-to-point transfers), their exchange through a rendezvous file or another
//! [`Communicator`], the abort notice next to the rendezvous file, and a watchdog that bounds
//! blocking NCCL calls.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use candle_core::cuda::cudarc::nccl::Id;
use candle_core::{DType, Device, Tensor};

use crate::comm::Communicator;
use crate::error::{CandleContext, CommError, Op, Result};

use super::buf::nccl_text;

/// Bytes in an NCCL unique id.
const ID_BYTES: usize = 128;

/// First line of a rendezvous file.
const MAGIC: &str = "candle-comm-nccl 1";

/// How often waiting ranks look for the rendezvous file.
const POLL: Duration = Duration::from_millis(50);

/// Exit status of a process that the watchdog or a fatal error ends.
pub(super) const ABORT_CODE: i32 = 3;

/// The unique ids of one NCCL world: `world` ranks, and, when `p2p`, one two-rank communicator
/// per ordered pair of ranks (sender, receiver).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct IdBlob {
    pub(super) world: usize,
    pub(super) p2p: bool,
    /// `ids[0]`: the world's; then the pairs, see [`IdBlob::pair`].
    ids: Vec<[u8; ID_BYTES]>,
}

/// Number of ids of a world of `world` ranks.
fn id_count(world: usize, p2p: bool) -> usize {
    if p2p {
        1 + world * world.saturating_sub(1)
    } else {
        1
    }
}

fn init_error(message: String) -> CommError {
    CommError::Init {
        op: Op::Init,
        message,
    }
}

impl IdBlob {
    /// Fresh ids from `ncclGetUniqueId` (rank 0 only).
    pub(super) fn generate(world: usize, p2p: bool) -> Result<Self> {
        let ids = (0..id_count(world, p2p))
            .map(|_| {
                let id = Id::new()
                    .map_err(|e| init_error(format!("ncclGetUniqueId: {}", nccl_text(&e))))?;
                Ok(id.internal().map(|c| c as u8))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { world, p2p, ids })
    }

    /// The id of the world communicator.
    pub(super) fn world_id(&self) -> Id {
        to_id(&self.ids[0])
    }

    /// The id of the two-rank communicator on which `from` sends to `to` (`from != to`).
    pub(super) fn pair(&self, from: usize, to: usize) -> Option<Id> {
        if !self.p2p || from == to || from >= self.world || to >= self.world {
            return None;
        }
        let k = from * (self.world - 1) + if to > from { to - 1 } else { to };
        self.ids.get(1 + k).map(to_id)
    }

    /// A short hex string that identifies this run (the start of the world id, which is random).
    pub(super) fn nonce(&self) -> String {
        hex(&self.ids[0][..12])
    }

    /// Text form (the rendezvous file's contents).
    pub(super) fn to_text(&self) -> String {
        let mut s = format!(
            "{MAGIC}\nworld {}\np2p {}\n",
            self.world,
            u8::from(self.p2p)
        );
        for id in &self.ids {
            s.push_str(&hex(id));
            s.push('\n');
        }
        s
    }

    /// Parses [`IdBlob::to_text`].
    pub(super) fn from_text(text: &str) -> std::result::Result<Self, String> {
        let mut lines = text.lines();
        if lines.next() != Some(MAGIC) {
            return Err(format!(
                "not a candle-comm NCCL rendezvous file (no '{MAGIC}' line)"
            ));
        }
        let mut field = |name: &str| -> std::result::Result<usize, String> {
            lines
                .next()
                .and_then(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse().ok())
                .ok_or_else(|| format!("missing or bad '{name}' line"))
        };
        let world = field("world ")?;
        let p2p = field("p2p ")? != 0;
        let ids = lines
            .map(unhex)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        if world == 0 || ids.len() != id_count(world, p2p) {
            return Err(format!(
                "{} ids for a world of {world} (p2p {p2p})",
                ids.len()
            ));
        }
        Ok(Self { world, p2p, ids })
    }

    /// Bytes as a flat vector (for a broadcast), see [`IdBlob::from_bytes`].
    fn to_bytes(&self) -> Vec<u8> {
        self.ids.iter().flatten().copied().collect()
    }

    fn from_bytes(world: usize, p2p: bool, bytes: &[u8]) -> Self {
        let ids = bytes
            .chunks_exact(ID_BYTES)
            .map(|c| {
                let mut id = [0u8; ID_BYTES];
                id.copy_from_slice(c);
                id
            })
            .collect();
        Self { world, p2p, ids }
    }
}

fn to_id(bytes: &[u8; ID_BYTES]) -> Id {
    Id::uninit(bytes.map(|b| b as std::ffi::c_char))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn unhex(line: &str) -> std::result::Result<[u8; ID_BYTES], String> {
    let line = line.trim();
    if line.len() != 2 * ID_BYTES || !line.is_ascii() {
        return Err(format!("id line of {} characters", line.len()));
    }
    let mut id = [0u8; ID_BYTES];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&line[2 * i..2 * i + 2], 16)
            .map_err(|_| format!("bad hex in id line: {:?}", &line[2 * i..2 * i + 2]))?;
    }
    Ok(id)
}

/// Rank 0's side of the rendezvous: removes a stale abort notice, then writes `blob` to a
/// temporary file next to `path` and renames it into place (readers never see a partial file).
pub(super) fn write_rendezvous(path: &Path, blob: &IdBlob) -> Result<()> {
    let _ = std::fs::remove_file(notice_path(path));
    let tmp = sibling(path, &format!(".tmp-{}", std::process::id()));
    let io = |what: &str, p: &Path, e: std::io::Error| {
        init_error(format!("rendezvous: cannot {what} {}: {e}", p.display()))
    };
    std::fs::write(&tmp, blob.to_text()).map_err(|e| io("write", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io("rename into", path, e)
    })
}

/// A non-zero rank's side: waits up to `timeout` for rank 0's file and checks that it is for a
/// world of `world` with the same point-to-point setting.
pub(super) fn read_rendezvous(
    path: &Path,
    world: usize,
    p2p: bool,
    timeout: Duration,
) -> Result<IdBlob> {
    let start = Instant::now();
    loop {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                let blob = IdBlob::from_text(&text)
                    .map_err(|e| init_error(format!("rendezvous file {}: {e}", path.display())))?;
                if blob.world != world {
                    return Err(init_error(format!(
                        "rendezvous file {} is for a world of {}, this rank expects {world} \
                         (a stale file from another run? use a fresh path per run)",
                        path.display(),
                        blob.world
                    )));
                }
                if blob.p2p != p2p {
                    return Err(init_error(format!(
                        "rendezvous file {}: rank 0 has p2p {}, this rank p2p {p2p} (every rank \
                         must use the same setting)",
                        path.display(),
                        blob.p2p
                    )));
                }
                return Ok(blob);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(init_error(format!(
                    "rendezvous: cannot read {}: {e}",
                    path.display()
                )))
            }
        }
        if start.elapsed() > timeout {
            return Err(init_error(format!(
                "rendezvous file {} did not appear within {timeout:?} (is rank 0 running, with \
                 the same path?)",
                path.display()
            )));
        }
        std::thread::sleep(POLL);
    }
}

/// Exchanges the ids through `comm` (rank 0 generates them and broadcasts them); every rank
/// must ask for the same `p2p`, checked first with one all-gather.
pub(super) fn exchange<C: Communicator + ?Sized>(comm: &C, p2p: bool) -> Result<IdBlob> {
    let (rank, world, op) = (comm.rank(), comm.world_size(), Op::Init);
    let flag = Tensor::new(&[f64::from(u8::from(p2p))], &Device::Cpu).at(rank, op)?;
    let flags = comm.all_gather(&flag)?.to_vec1::<f64>().at(rank, op)?;
    if let Some(peer) = flags.iter().position(|&f| f != flags[0]) {
        return Err(CommError::Mismatch {
            rank,
            op,
            peer,
            message: format!("p2p setting differs from rank 0's ({})", flags[0] != 0.0),
        });
    }
    let n = id_count(world, p2p) * ID_BYTES;
    let bytes: Vec<f64> = if rank == 0 {
        let blob = IdBlob::generate(world, p2p)?;
        blob.to_bytes().into_iter().map(f64::from).collect()
    } else {
        vec![0.0; n]
    };
    let t = Tensor::from_vec(bytes, n, &Device::Cpu).at(rank, op)?;
    let got = comm
        .broadcast(&t, 0)?
        .to_dtype(DType::F64)
        .and_then(|t| t.to_vec1::<f64>())
        .at(rank, op)?;
    let bytes: Vec<u8> = got.iter().map(|&b| b as u8).collect();
    Ok(IdBlob::from_bytes(world, p2p, &bytes))
}

/// `path` with `suffix` appended to its file name.
fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

/// Where a failing rank leaves its notice for the others: `<rendezvous file>.abort`.
fn notice_path(rendezvous: &Path) -> PathBuf {
    sibling(rendezvous, ".abort")
}

/// The abort notice of one run (a file next to the rendezvous file, tagged with the run's nonce
/// so that a notice from an earlier run is ignored).
#[derive(Debug, Clone)]
pub(super) struct Notice {
    path: PathBuf,
    nonce: String,
}

impl Notice {
    /// The notice for the run whose rendezvous file is `rendezvous`.
    pub(super) fn new(rendezvous: &Path, nonce: String) -> Self {
        Self {
            path: notice_path(rendezvous),
            nonce,
        }
    }

    /// Leaves `rank failed: reason` for the other ranks (best effort; the first notice wins).
    pub(super) fn post(&self, rank: usize, reason: &str) {
        if self.read().is_some() {
            return;
        }
        let tmp = sibling(&self.path, &format!(".tmp-{}", std::process::id()));
        let text = format!("{} {rank}\n{reason}\n", self.nonce);
        if std::fs::write(&tmp, text).is_ok() && std::fs::rename(&tmp, &self.path).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }

    /// The failed rank and its reason, when a rank of this run posted a notice.
    pub(super) fn read(&self) -> Option<(usize, String)> {
        let text = std::fs::read_to_string(&self.path).ok()?;
        let (first, reason) = text.split_once('\n')?;
        let (nonce, rank) = first.split_once(' ')?;
        if nonce != self.nonce {
            return None;
        }
        Some((rank.trim().parse().ok()?, reason.trim_end().to_string()))
    }
}

/// Writes `candle-comm: <message>` to stderr.
pub(super) fn report(message: &str) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "candle-comm: {message}");
    let _ = err.flush();
}

/// Ends the process with [`ABORT_CODE`] and `message` on stderr unless disarmed (dropped)
/// within its timeout: bounds blocking NCCL calls (communicator creation, abort).
pub(super) struct Watchdog {
    disarm: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    /// Arms a watchdog that fires after `timeout`.
    pub(super) fn arm(timeout: Duration, message: String) -> Self {
        let (tx, rx) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("candle-comm-nccl-watchdog".to_string())
            .spawn(move || {
                if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(timeout) {
                    report(&message);
                    std::process::exit(ABORT_CODE);
                }
            })
            .ok();
        Self {
            disarm: Some(tx),
            thread,
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.disarm.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(world: usize, p2p: bool) -> IdBlob {
        let ids = (0..id_count(world, p2p))
            .map(|i| [i as u8; ID_BYTES])
            .collect();
        IdBlob { world, p2p, ids }
    }

    #[test]
    fn text_and_bytes_round_trip() {
        for (world, p2p) in [(1, true), (1, false), (3, true), (4, false)] {
            let b = blob(world, p2p);
            assert_eq!(IdBlob::from_text(&b.to_text()), Ok(b.clone()));
            assert_eq!(IdBlob::from_bytes(world, p2p, &b.to_bytes()), b);
        }
        assert!(IdBlob::from_text("hello\n").unwrap_err().contains("not a"));
        let mut t = blob(2, true).to_text();
        t.push_str(&"00".repeat(ID_BYTES));
        assert!(IdBlob::from_text(&t).unwrap_err().contains("4 ids"));
    }

    #[test]
    fn pair_ids_are_distinct_and_directed() {
        let b = blob(4, true);
        let mut seen = std::collections::HashSet::new();
        for from in 0..4 {
            for to in 0..4 {
                match b.pair(from, to) {
                    None => assert_eq!(from, to),
                    Some(id) => assert!(seen.insert(id.internal()[0] as u8)),
                }
            }
        }
        assert_eq!(seen.len(), 12);
        assert!(!seen.contains(&0), "pair ids must differ from the world id");
        assert!(blob(4, false).pair(0, 1).is_none());
    }

    #[test]
    fn rendezvous_file_and_notice() {
        let dir = std::env::temp_dir().join(format!("candle-comm-nccl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rdv");
        let b = blob(2, true);
        let reader = {
            let path = path.clone();
            std::thread::spawn(move || read_rendezvous(&path, 2, true, Duration::from_secs(20)))
        };
        std::thread::sleep(Duration::from_millis(120));
        write_rendezvous(&path, &b).unwrap();
        assert_eq!(reader.join().unwrap().unwrap(), b);

        let e = read_rendezvous(&path, 3, true, Duration::from_secs(1)).unwrap_err();
        assert!(
            e.to_string().contains("world of 2, this rank expects 3"),
            "{e}"
        );
        let e = read_rendezvous(&path, 2, false, Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("same setting"), "{e}");
        let e =
            read_rendezvous(&dir.join("missing"), 2, true, Duration::from_millis(100)).unwrap_err();
        assert!(e.to_string().contains("did not appear within"), "{e}");

        let notice = Notice::new(&path, b.nonce());
        assert_eq!(notice.read(), None);
        notice.post(1, "out of memory");
        notice.post(0, "second failure is not recorded");
        assert_eq!(notice.read(), Some((1, "out of memory".to_string())));
        let other_run = Notice::new(&path, "ffff".to_string());
        assert_eq!(
            other_run.read(),
            None,
            "a notice from another run is ignored"
        );
        write_rendezvous(&path, &b).unwrap();
        assert_eq!(notice.read(), None, "rank 0 clears a stale notice");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
