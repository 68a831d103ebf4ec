//! Boot profiles: the order in which a guest first read its disk, recorded by one export and
//! fetched ahead of the guest by the next (BlobSeer's future work; eStargz and SOCI do it for
//! containers). A cold lazy boot otherwise fetches in the order the guest asks, one round trip
//! at a time; with a profile the fetches run ahead, several at once.
//!
//! A profile is image offsets, not chunks: it fits every version of the image whose layout is
//! the same, and a version that changed some blocks still gets the rest ahead of time. One
//! recorded for another image or another size is ignored, not trusted. It is a small JSON
//! document (`cairn_boot_profile`: 1), stored with the image in the repository
//! (`Repo::put_boot_profile`) or kept as a file.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::base::Base;
use crate::stats::ExportStats;

/// The profile format's version; a file of another is refused.
pub const PROFILE_VERSION: u32 = 1;
/// How long after the guest's first read the recording runs.
pub const RECORD_SECONDS: u64 = 120;
/// The most distinct bytes a profile holds.
pub const RECORD_BYTES: u64 = 1 << 30;
/// Batches fetched at once.
const PREFETCH_AT_ONCE: usize = 4;
/// The profile's bytes one batch covers: its groups are fetched together, neighbours in one
/// ranged read (`Base::prefetch_batch`).
const PREFETCH_BATCH: u64 = 4 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootProfile {
    pub cairn_boot_profile: u32,
    /// The image whose export recorded it, and the version's size.
    pub image: String,
    pub size: u64,
    /// `[offset, length]` of each range first read, in the order the guest read them.
    pub reads: Vec<[u64; 2]>,
    /// For each read, the microseconds the guest spent between it and the read before with
    /// no read of its own outstanding (its think time; 0 for the first and for reads issued
    /// while another was served). Empty in profiles recorded before it existed; a replay
    /// with it runs at the guest's pace (`bench/boot_profile.py`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub think_us: Vec<u64>,
}

impl BootProfile {
    /// Reads a profile file; an error says what is wrong with it.
    pub fn parse(bytes: &[u8]) -> Result<BootProfile, String> {
        let p: BootProfile =
            serde_json::from_slice(bytes).map_err(|e| format!("not a boot profile: {e}"))?;
        if p.cairn_boot_profile != PROFILE_VERSION {
            return Err(format!(
                "boot profile version {} (this cairn reads {PROFILE_VERSION})",
                p.cairn_boot_profile
            ));
        }
        Ok(p)
    }

    /// Why this profile does not fit a version of `image` of `size` bytes, if it does not.
    pub fn misfit(&self, image: &str, size: u64) -> Option<String> {
        if self.image != image {
            return Some(format!("it was recorded for image {:?}", self.image));
        }
        if self.size != size {
            return Some(format!(
                "it was recorded for a size of {} bytes, not {size}",
                self.size
            ));
        }
        if let Some([o, l]) = self.reads.iter().find(|[o, l]| o.saturating_add(*l) > size) {
            return Some(format!("a read at {o} of {l} bytes lies past the end"));
        }
        if !self.think_us.is_empty() && self.think_us.len() != self.reads.len() {
            return Some(format!(
                "it has {} think times for {} reads",
                self.think_us.len(),
                self.reads.len()
            ));
        }
        None
    }

    /// The bytes the profile names.
    pub fn bytes(&self) -> u64 {
        self.reads.iter().map(|[_, l]| l).sum()
    }

    /// The guest's think time over the whole profile, when it was recorded.
    pub fn think(&self) -> Option<Duration> {
        (!self.think_us.is_empty()).then(|| {
            Duration::from_micros(self.think_us.iter().fold(0, |a, t| a.saturating_add(*t)))
        })
    }
}

#[derive(Default)]
struct Recording {
    first: Option<Instant>,
    /// Ranges recorded so far (start → end), to keep only the first read of each byte.
    covered: BTreeMap<u64, u64>,
    reads: Vec<[u64; 2]>,
    think_us: Vec<u64>,
    /// Think time before reads that joined the one before them, carried to the next read.
    carried: Duration,
    bytes: u64,
    /// The guest's waits: reads outstanding now, since when one has been, and the time spent
    /// waiting since the last recorded read arrived (`last`).
    outstanding: u32,
    busy_since: Option<Instant>,
    waited: Duration,
    last: Option<Instant>,
}

impl Recording {
    /// The guest's think time from the last recorded read to `now`: the time between them
    /// with no read outstanding.
    fn think(&self, now: Instant) -> Duration {
        let Some(last) = self.last else {
            return Duration::ZERO;
        };
        let waiting = self.waited
            + match (self.outstanding, self.busy_since) {
                (1.., Some(since)) => now.saturating_duration_since(since),
                _ => Duration::ZERO,
            };
        now.saturating_duration_since(last).saturating_sub(waiting)
    }
}

/// One read in progress under a [`Recorder`]; the guest waits on it until it is dropped.
pub struct ReadTiming<'a> {
    recorder: Option<&'a Recorder>,
}

impl ReadTiming<'_> {
    /// The read was served at `now`.
    fn end_at(&mut self, now: Instant) {
        let Some(r) = self.recorder.take() else {
            return;
        };
        let mut s = r.state.lock().expect("recorder lock");
        s.outstanding = s.outstanding.saturating_sub(1);
        if s.outstanding == 0 {
            if let Some(since) = s.busy_since.take() {
                s.waited += now.saturating_duration_since(since);
            }
        }
    }
}

impl Drop for ReadTiming<'_> {
    fn drop(&mut self) {
        self.end_at(Instant::now());
    }
}

/// Records an export's first reads: from the first read for [`RECORD_SECONDS`], at most
/// [`RECORD_BYTES`] distinct bytes, each byte once, adjacent reads joined.
pub struct Recorder {
    window: Duration,
    max_bytes: u64,
    state: Mutex<Recording>,
}

impl Default for Recorder {
    fn default() -> Recorder {
        Recorder::new(Duration::from_secs(RECORD_SECONDS), RECORD_BYTES)
    }
}

impl Recorder {
    pub fn new(window: Duration, max_bytes: u64) -> Recorder {
        Recorder {
            window,
            max_bytes,
            state: Mutex::new(Recording::default()),
        }
    }

    /// Whether the recording is over (its time or its bytes are used up).
    pub fn done(&self) -> bool {
        self.over(&self.state.lock().expect("recorder lock"))
    }

    fn over(&self, s: &Recording) -> bool {
        s.bytes >= self.max_bytes || s.first.is_some_and(|t| t.elapsed() >= self.window)
    }

    /// Notes a read of `[offset, offset + len)`, served until the returned guard drops.
    pub fn record(&self, offset: u64, len: u64) -> ReadTiming<'_> {
        self.record_at(offset, len, Instant::now())
    }

    fn record_at(&self, offset: u64, len: u64, now: Instant) -> ReadTiming<'_> {
        let mut s = self.state.lock().expect("recorder lock");
        if len > 0 && !self.over(&s) {
            self.note(&mut s, offset, len, now);
        }
        s.outstanding += 1;
        if s.outstanding == 1 {
            s.busy_since = Some(now);
        }
        ReadTiming {
            recorder: Some(self),
        }
    }

    fn note(&self, s: &mut Recording, offset: u64, len: u64, now: Instant) {
        s.first.get_or_insert(now);
        let end = offset.saturating_add(len);
        // The parts of the range not recorded yet, in order.
        let mut at = offset;
        let mut fresh = Vec::new();
        let before = s
            .covered
            .range(..=offset)
            .next_back()
            .map(|(&a, &b)| (a, b));
        let overlapping = before
            .into_iter()
            .chain(s.covered.range(offset + 1..end).map(|(&a, &b)| (a, b)));
        for (a, b) in overlapping {
            if b <= at {
                continue;
            }
            if a > at {
                fresh.push((at, a.min(end)));
            }
            at = at.max(b);
            if at >= end {
                break;
            }
        }
        if at < end {
            fresh.push((at, end));
        }
        if fresh.is_empty() {
            return;
        }
        let mut think = s.think(now);
        s.last = Some(now);
        s.waited = Duration::ZERO;
        if s.outstanding > 0 {
            s.busy_since = Some(now);
        }
        for (a, b) in fresh {
            let b = b.min(a + self.max_bytes.saturating_sub(s.bytes));
            if b <= a {
                break;
            }
            s.bytes += b - a;
            match s.reads.last_mut() {
                Some([o, l]) if *o + *l == a => {
                    *l += b - a;
                    s.carried += think;
                }
                _ => {
                    s.reads.push([a, b - a]);
                    let think = think + std::mem::take(&mut s.carried);
                    s.think_us
                        .push(u64::try_from(think.as_micros()).unwrap_or(u64::MAX));
                }
            }
            think = Duration::ZERO;
            // Join with the covered ranges it touches.
            let mut start = a;
            let mut stop = b;
            if let Some((&pa, &pb)) = s.covered.range(..=a).next_back() {
                if pb >= a {
                    start = pa;
                    stop = stop.max(pb);
                }
            }
            if let Some(&nb) = s.covered.get(&b) {
                stop = stop.max(nb);
                s.covered.remove(&b);
            }
            s.covered.insert(start, stop);
        }
    }

    /// What was recorded, as the profile of a version of `image` of `size` bytes.
    pub fn profile(&self, image: &str, size: u64) -> BootProfile {
        let s = self.state.lock().expect("recorder lock");
        BootProfile {
            cairn_boot_profile: PROFILE_VERSION,
            image: image.to_string(),
            size,
            reads: s.reads.clone(),
            think_us: s.think_us.clone(),
        }
    }
}

/// Fetches the profile's reads into the cache in the order recorded, ahead of the guest: in
/// batches of 4 MiB of reads whose groups come in as few ranged reads as they can, four
/// batches at once. Counts what it asked for in `prefetched_bytes`; a failure is left for the
/// guest's own read to meet.
pub async fn prefetch(base: Arc<Base>, profile: BootProfile, stats: Arc<ExportStats>) {
    let permits = Arc::new(tokio::sync::Semaphore::new(PREFETCH_AT_ONCE));
    let mut tasks = tokio::task::JoinSet::new();
    for batch in batches(&profile.reads) {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            break;
        };
        let base = base.clone();
        let stats = stats.clone();
        tasks.spawn(async move {
            let bytes: u64 = batch.iter().map(|(_, l)| l).sum();
            match base.prefetch_batch(&batch).await {
                Ok(()) => {
                    stats.prefetched_bytes.fetch_add(bytes, Ordering::Relaxed);
                }
                Err(e) => tracing::debug!("profile prefetch at {}: {e}", batch[0].0),
            }
            drop(permit);
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// The profile's reads, in order, cut into batches of at most [`PREFETCH_BATCH`] bytes.
fn batches(reads: &[[u64; 2]]) -> Vec<Vec<(u64, u64)>> {
    let mut out: Vec<Vec<(u64, u64)>> = Vec::new();
    let mut size = PREFETCH_BATCH;
    for &[offset, len] in reads {
        let mut at = offset;
        while at < offset + len {
            if size == PREFETCH_BATCH {
                out.push(Vec::new());
                size = 0;
            }
            let take = (PREFETCH_BATCH - size).min(offset + len - at);
            out.last_mut().expect("a batch").push((at, take));
            size += take;
            at += take;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reads(r: &Recorder) -> Vec<[u64; 2]> {
        r.profile("vm", 1 << 30).reads
    }

    #[test]
    fn batches_keep_the_order_and_cut_reads_at_the_batch_size() {
        let m = 1 << 20;
        let b = batches(&[[10 * m, 3 * m], [0, 2 * m], [40 * m, 6 * m]]);
        assert_eq!(
            b,
            vec![
                vec![(10 * m, 3 * m), (0, m)],
                vec![(m, m), (40 * m, 3 * m)],
                vec![(43 * m, 3 * m)],
            ]
        );
        assert!(batches(&[]).is_empty());
    }

    #[test]
    fn first_reads_are_kept_in_order_once_each_and_adjacent_ones_joined() {
        let r = Recorder::new(Duration::from_secs(60), 1 << 30);
        r.record(5 << 20, 65536);
        r.record(1 << 20, 65536);
        r.record((1 << 20) + 65536, 65536); // joins the one before
        r.record(5 << 20, 4096); // read again: not recorded
        r.record((5 << 20) - 4096, 8192); // half new: only the new half
        r.record(0, 0);
        assert_eq!(
            reads(&r),
            vec![
                [5 << 20, 65536],
                [1 << 20, 131072],
                [(5 << 20) - 4096, 4096]
            ]
        );
        // A range spanning recorded and unrecorded parts keeps only the gaps.
        r.record(1 << 20, 3 << 20);
        let all = reads(&r);
        assert_eq!(all[3], [(1 << 20) + 131072, (3 << 20) - 131072]);
        let total: u64 = all.iter().map(|[_, l]| l).sum();
        assert_eq!(total, 65536 + 4096 + (3 << 20));
    }

    #[test]
    fn think_times_leave_out_the_time_the_guest_waited_on_its_reads() {
        let r = Recorder::new(Duration::from_secs(60), 1 << 30);
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        // Read 1 arrives at 0 and is served by 30; the guest thinks until 50.
        r.record_at(0, 4096, ms(0)).end_at(ms(30));
        // Read 2 (50..60) and, while it is served, read 3 (55..80): no think for read 3.
        let mut two = r.record_at(1 << 20, 4096, ms(50));
        let mut three = r.record_at(2 << 20, 4096, ms(55));
        two.end_at(ms(60));
        three.end_at(ms(80));
        // A read of recorded bytes (90..95) counts as waiting, not thinking; then read 4 at 100
        // after 10 + 5 ms of think.
        r.record_at(0, 4096, ms(90)).end_at(ms(95));
        r.record_at(3 << 20, 4096, ms(100)).end_at(ms(101));
        // Reads 5 and 6 join read 4; read 6's 2 ms of think move to read 7 (7 ms in all).
        r.record_at((3 << 20) + 4096, 4096, ms(101)).end_at(ms(102));
        r.record_at((3 << 20) + 8192, 4096, ms(104)).end_at(ms(105));
        r.record_at(4 << 20, 4096, ms(110)).end_at(ms(111));
        let p = r.profile("vm", 1 << 30);
        assert_eq!(
            p.reads,
            vec![
                [0, 4096],
                [1 << 20, 4096],
                [2 << 20, 4096],
                [3 << 20, 12288],
                [4 << 20, 4096]
            ]
        );
        assert_eq!(p.think_us, vec![0, 20_000, 0, 15_000, 7_000]);
        assert_eq!(p.misfit("vm", 1 << 30), None);
        let short = BootProfile {
            think_us: vec![0],
            ..p
        };
        assert_eq!(
            short.misfit("vm", 1 << 30).unwrap(),
            "it has 1 think times for 5 reads"
        );
    }

    #[test]
    fn the_recording_stops_at_its_byte_limit() {
        let r = Recorder::new(Duration::from_secs(60), 100_000);
        r.record(0, 65536);
        r.record(1 << 20, 65536);
        assert!(r.done());
        r.record(2 << 20, 65536);
        assert_eq!(reads(&r), vec![[0, 65536], [1 << 20, 100_000 - 65536]]);
    }

    #[test]
    fn a_profile_fits_only_its_image_and_size() {
        let p = BootProfile {
            cairn_boot_profile: PROFILE_VERSION,
            image: "vm".into(),
            size: 1 << 20,
            reads: vec![[0, 4096], [65536, 4096]],
            think_us: vec![],
        };
        assert_eq!(p.misfit("vm", 1 << 20), None);
        assert_eq!(
            p.misfit("db", 1 << 20).unwrap(),
            "it was recorded for image \"vm\""
        );
        assert!(p.misfit("vm", 2 << 20).unwrap().contains("size of 1048576"));
        let past = BootProfile {
            reads: vec![[(1 << 20) - 10, 4096]],
            ..p.clone()
        };
        assert!(past.misfit("vm", 1 << 20).unwrap().contains("past the end"));
        let text = serde_json::to_vec(&p).unwrap();
        assert_eq!(BootProfile::parse(&text).unwrap(), p);
        assert!(BootProfile::parse(b"{}")
            .unwrap_err()
            .starts_with("not a boot profile"));
        let v2 = String::from_utf8(text).unwrap().replace(":1,", ":2,");
        assert_eq!(
            BootProfile::parse(v2.as_bytes()).unwrap_err(),
            "boot profile version 2 (this cairn reads 1)"
        );
    }
}
