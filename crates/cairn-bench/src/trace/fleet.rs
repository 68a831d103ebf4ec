//! The fleet a trace simulates: its parameters, its layers, and each VM's disk as it changes
//! from snapshot to snapshot — chunk ids only, never data bytes.
//!
//! A chunk is named by where it came from: a *stream* (an OS base, an application layer, one
//! day's OS update, or one VM's own data) and a counter in it, packed into a `u64`
//! ([`packed`]). Its [`Id`] is a uniform hash of that value in the first 8 bytes (what the
//! index keys and the hooks' min-hash see) followed by the value itself, so the simulated
//! store can tell which stream and counter an id stands for without a table of ids.
//!
//! Every VM has one OS base (of `os_bases`) and one application layer (of `app_groups`),
//! laid out as files: the OS in its template's order with a share of its files at VM-specific
//! places (packages installed in another order), the application layer after it, then the
//! VM's own files. Each later snapshot changes 2–5% of the data a VM holds:
//! - the day's OS update, the same new blocks in every VM of that base (cross-VM duplicates
//!   of *new* data, which only a search beyond the VM's own history can find);
//! - blocks rewritten in place, mostly in a few hot files (logs, databases);
//! - new files;
//! - in a third of the VMs (the paper's observation, `002_…` §5), files rewritten at a new
//!   place with the same content (moved data, which the parent's same segment misses).

use cairn_format::Id;

/// Bytes a chunk stands for (cairn's 4 KiB dedup unit, format 2).
pub const CHUNK_BYTES: u64 = 4096;
/// Chunks in a segment (1 MiB, the leaf unit and the unit of the digest fast path).
pub const SEGMENT_CHUNKS: usize = 256;

/// The fleet's parameters: what each trace result records (its `fleet` field) beside the figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FleetParams {
    pub vms: u32,
    pub snapshots: u32,
    /// Virtual size of every VM's disk.
    pub disk_gib: u32,
    /// OS bases the VMs are installed from (the paper's fleet ran six).
    pub os_bases: u32,
    pub os_gib: f64,
    /// Application layers, each shared by the VMs of one group.
    pub app_groups: u32,
    pub app_gib: f64,
    /// A VM's own data, on average (each VM draws 0.5–1.5× of it).
    pub user_gib: f64,
    /// Share of a VM's data changed a snapshot, drawn uniformly per VM and snapshot.
    pub change_min: f64,
    pub change_max: f64,
    /// Share of its OS base a day's update replaces in every VM of that base.
    pub os_update: f64,
    /// Shares of the rest of a day's change: new files, copies of files the VM holds, and
    /// moved files (the remainder is rewritten in place).
    pub new_share: f64,
    pub copy_share: f64,
    pub move_share: f64,
    /// Share of VMs that move data (the paper: about a third).
    pub moving_vms: f64,
    /// Share of OS and application files a VM places differently from the template.
    pub relocated: f64,
    /// Mean file size, in chunks (geometric).
    pub file_chunks: u32,
    /// Share of a VM's files that take most rewrites in place (the hot files), and the share
    /// of rewrites they take.
    pub hot_files: f64,
    pub hot_share: f64,
    pub seed: u64,
}

impl FleetParams {
    pub fn disk_chunks(&self) -> usize {
        (self.disk_gib as u64 * (1 << 30) / CHUNK_BYTES) as usize
    }

    fn chunks_of(gib: f64) -> u64 {
        (gib * (1u64 << 30) as f64 / CHUNK_BYTES as f64) as u64
    }

    /// The stream of OS base `b`, application layer `g`, update `(b, day)`, VM `v`'s data.
    pub fn os_stream(&self, b: u32) -> u32 {
        1 + b
    }
    pub fn app_stream(&self, g: u32) -> u32 {
        1 + self.os_bases + g
    }
    pub fn update_stream(&self, b: u32, day: u32) -> u32 {
        1 + self.os_bases + self.app_groups + b * self.snapshots + day
    }
    pub fn user_stream(&self, v: u32) -> u32 {
        1 + self.os_bases + self.app_groups + self.os_bases * self.snapshots + v
    }
}

/// A chunk's origin, packed: stream in the high 24 bits, counter in the low 40. Never 0
/// (streams start at 1), which a disk slot uses for a block of zeros.
pub fn packed(stream: u32, counter: u64) -> u64 {
    debug_assert!(stream < 1 << 24 && counter < 1 << 40);
    (stream as u64) << 40 | counter
}

pub fn stream_of(p: u64) -> u32 {
    (p >> 40) as u32
}

pub fn counter_of(p: u64) -> u64 {
    p & ((1 << 40) - 1)
}

/// The chunk id a packed origin stands for: a uniform 8-byte key, then the origin.
pub fn chunk_id(p: u64) -> Id {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&mix(p).to_le_bytes());
    b[8..16].copy_from_slice(&p.to_le_bytes());
    Id(b)
}

/// The origin a [`chunk_id`] carries.
pub fn origin_of(id: &Id) -> u64 {
    u64::from_le_bytes(id.0[8..16].try_into().expect("8 bytes"))
}

/// SplitMix64's finalizer: a bijection of `u64` with good avalanche.
pub fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A small deterministic generator (SplitMix64): the trace is the same for the same seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(mix(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Geometric with mean `mean` (≥ 1).
    pub fn geometric(&mut self, mean: u32) -> u64 {
        let p = 1.0 / mean.max(1) as f64;
        let u = self.unit().max(f64::MIN_POSITIVE);
        1 + (u.ln() / (1.0 - p).ln()).floor() as u64
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

/// A layer's files, as counter ranges of its stream: `(first counter, length)`.
pub fn layer_files(stream: u32, chunks: u64, mean: u32, seed: u64) -> Vec<(u64, u64)> {
    let mut rng = Rng::new(seed ^ mix(stream as u64));
    let mut files = Vec::new();
    let mut at = 0;
    while at < chunks {
        let len = rng.geometric(mean).min(chunks - at);
        files.push((at, len));
        at += len;
    }
    files
}

/// Where a file of a VM lies on its disk.
#[derive(Debug, Clone, Copy)]
struct FileAt {
    slot: usize,
    len: usize,
    /// The OS base's file it holds, if any (a day's update rewrites it).
    os_file: Option<u32>,
}

/// The shared layers, generated once.
pub struct Layers {
    os: Vec<Vec<(u64, u64)>>,
    app: Vec<Vec<(u64, u64)>>,
}

impl Layers {
    pub fn new(p: &FleetParams) -> Layers {
        let os_chunks = FleetParams::chunks_of(p.os_gib);
        let app_chunks = FleetParams::chunks_of(p.app_gib);
        Layers {
            os: (0..p.os_bases)
                .map(|b| layer_files(p.os_stream(b), os_chunks, p.file_chunks, p.seed))
                .collect(),
            app: (0..p.app_groups)
                .map(|g| layer_files(p.app_stream(g), app_chunks, p.file_chunks, p.seed))
                .collect(),
        }
    }
}

/// One VM's disk and what changed since its last snapshot.
pub struct Vm {
    pub base: u32,
    /// Packed chunk origin per 4 KiB slot; 0 for zeros.
    pub disk: Vec<u64>,
    files: Vec<FileAt>,
    /// Where each file of the OS base lies (index into `files`).
    os_files: Vec<u32>,
    hot: Vec<u32>,
    next_free: usize,
    user_stream: u32,
    user_next: u64,
    moves: bool,
    rng: Rng,
    /// The segments written since the last snapshot, with their content then.
    pub before: std::collections::HashMap<usize, Box<[u64]>>,
}

impl Vm {
    /// VM `v` at its first snapshot.
    pub fn install(p: &FleetParams, layers: &Layers, v: u32) -> Vm {
        let mut rng = Rng::new(p.seed ^ mix(0x766d_0000 + v as u64));
        let base = rng.below(p.os_bases as u64) as u32;
        let app = rng.below(p.app_groups as u64) as u32;
        let mut vm = Vm {
            base,
            disk: vec![0; p.disk_chunks()],
            files: Vec::new(),
            os_files: vec![0; layers.os[base as usize].len()],
            hot: Vec::new(),
            next_free: 0,
            user_stream: p.user_stream(v),
            user_next: 0,
            moves: rng.unit() < p.moving_vms,
            rng,
            before: Default::default(),
        };
        let os_stream = p.os_stream(base);
        let order = vm.relocated_order(layers.os[base as usize].len(), p.relocated);
        for f in order {
            let (first, len) = layers.os[base as usize][f];
            let at = vm.place(os_stream, first, len as usize, Some(f as u32));
            vm.os_files[f] = at;
        }
        vm.next_free += vm.rng.below(1024) as usize;
        let app_stream = p.app_stream(app);
        let order = vm.relocated_order(layers.app[app as usize].len(), p.relocated);
        for f in order {
            let (first, len) = layers.app[app as usize][f];
            vm.place(app_stream, first, len as usize, None);
        }
        vm.next_free += vm.rng.below(1024) as usize;
        let user = FleetParams::chunks_of(p.user_gib) as f64 * (0.5 + vm.rng.unit());
        let mut left = user as u64;
        while left > 0 {
            let len = vm.rng.geometric(p.file_chunks).min(left);
            if !vm.new_file(len as usize) {
                break;
            }
            left -= len;
        }
        let user_files: Vec<u32> = (0..vm.files.len() as u32)
            .filter(|&f| vm.files[f as usize].os_file.is_none())
            .collect();
        let hot = ((user_files.len() as f64 * p.hot_files).ceil() as usize).max(1);
        for _ in 0..hot {
            let f = user_files[vm.rng.below(user_files.len() as u64) as usize];
            vm.hot.push(f);
        }
        vm.before.clear();
        vm
    }

    /// `0..n` with a share `relocated` of its positions shuffled among themselves.
    fn relocated_order(&mut self, n: usize, relocated: f64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..n).collect();
        let mut picked: Vec<usize> = (0..n).filter(|_| self.rng.unit() < relocated).collect();
        let mut moved = picked.clone();
        self.rng.shuffle(&mut moved);
        for (at, f) in picked.drain(..).zip(moved) {
            order[at] = f;
        }
        order
    }

    /// Lays `len` chunks of `stream` from `first` out at the free space's start; the file's
    /// index.
    fn place(&mut self, stream: u32, first: u64, len: usize, os_file: Option<u32>) -> u32 {
        let slot = self.next_free;
        for i in 0..len {
            self.write(slot + i, packed(stream, first + i as u64));
        }
        self.next_free += len;
        self.files.push(FileAt { slot, len, os_file });
        self.files.len() as u32 - 1
    }

    /// A new file of the VM's own data, if the disk has room.
    fn new_file(&mut self, len: usize) -> bool {
        if self.next_free + len > self.disk.len() {
            return false;
        }
        let first = self.user_next;
        self.user_next += len as u64;
        self.place(self.user_stream, first, len, None);
        true
    }

    fn write(&mut self, slot: usize, value: u64) {
        let seg = slot / SEGMENT_CHUNKS;
        if !self.before.contains_key(&seg) {
            let start = seg * SEGMENT_CHUNKS;
            let end = (start + SEGMENT_CHUNKS).min(self.disk.len());
            self.before.insert(seg, self.disk[start..end].into());
        }
        self.disk[slot] = value;
    }

    /// The data chunks the disk holds.
    pub fn used(&self) -> u64 {
        self.disk.iter().filter(|&&c| c != 0).count() as u64
    }

    /// Applies day `day`'s changes (`day ≥ 1`): the OS update, rewrites, new and moved files.
    pub fn change(&mut self, p: &FleetParams, layers: &Layers, day: u32) {
        self.before.clear();
        let used = self.used() as f64;
        let share = p.change_min + (p.change_max - p.change_min) * self.rng.unit();
        let mut budget = (used * share) as i64;
        // The update: the same OS files get the same new blocks in every VM of this base.
        let os = &layers.os[self.base as usize];
        let mut urng = Rng::new(p.seed ^ mix(0x7570_0000 + (self.base * 1000 + day) as u64));
        let mut want = (os.iter().map(|f| f.1).sum::<u64>() as f64 * p.os_update) as u64;
        let stream = p.update_stream(self.base, day);
        let mut counter = 0;
        while want > 0 {
            let f = urng.below(os.len() as u64) as usize;
            let at = self.files[self.os_files[f] as usize];
            for i in 0..at.len {
                self.write(at.slot + i, packed(stream, counter + i as u64));
            }
            counter += at.len as u64;
            want = want.saturating_sub(at.len as u64);
            budget -= at.len as i64;
        }
        let rest = budget.max(0) as f64;
        let mut new = (rest * p.new_share) as i64;
        let mut copied = (rest * p.copy_share) as i64;
        let mut moved = if self.moves {
            (rest * p.move_share) as i64
        } else {
            0
        };
        let mut rewrite = rest as i64 - new - copied - moved;
        while new > 0 {
            let len = self.rng.geometric(p.file_chunks) as usize;
            if !self.new_file(len) {
                rewrite += new;
                break;
            }
            new -= len as i64;
        }
        // Copies of files the VM holds (a copy of a file written today is a duplicate within
        // this snapshot).
        while copied > 0 {
            let f = self.rng.below(self.files.len() as u64) as usize;
            let at = self.files[f];
            if self.next_free + at.len > self.disk.len() {
                rewrite += copied;
                break;
            }
            let content: Vec<u64> = self.disk[at.slot..at.slot + at.len].to_vec();
            let to = self.next_free;
            for (i, c) in content.into_iter().enumerate() {
                self.write(to + i, c);
            }
            self.next_free += at.len;
            self.files.push(FileAt {
                slot: to,
                len: at.len,
                os_file: None,
            });
            copied -= at.len as i64;
        }
        while moved > 0 {
            let f = self.rng.below(self.files.len() as u64) as usize;
            let at = self.files[f];
            if at.os_file.is_some() || self.next_free + at.len > self.disk.len() {
                // OS files stay where the update expects them; a full disk moves nothing.
                if self.next_free + at.len > self.disk.len() {
                    rewrite += moved;
                    break;
                }
                continue;
            }
            let content: Vec<u64> = self.disk[at.slot..at.slot + at.len].to_vec();
            let to = self.next_free;
            for (i, c) in content.into_iter().enumerate() {
                self.write(to + i, c);
                self.write(at.slot + i, 0);
            }
            self.next_free += at.len;
            self.files[f].slot = to;
            moved -= at.len as i64;
        }
        while rewrite > 0 {
            let f = if self.rng.unit() < p.hot_share {
                self.hot[self.rng.below(self.hot.len() as u64) as usize] as usize
            } else {
                self.rng.below(self.files.len() as u64) as usize
            };
            let at = self.files[f];
            if at.os_file.is_some() {
                continue;
            }
            let len = (self.rng.geometric(16) as usize).min(at.len);
            let start = at.slot + self.rng.below((at.len - len + 1) as u64) as usize;
            for i in 0..len {
                let c = packed(self.user_stream, self.user_next);
                self.user_next += 1;
                self.write(start + i, c);
            }
            rewrite -= len as i64;
        }
    }
}

/// Which chunks of each stream were committed before: what exact dedup stores is exactly
/// the chunks seen here for the first time.
#[derive(Default)]
pub struct FirstSeen {
    streams: Vec<Vec<u64>>,
}

impl FirstSeen {
    /// Marks `p` seen; `true` the first time.
    pub fn first(&mut self, p: u64) -> bool {
        let s = stream_of(p) as usize;
        if self.streams.len() <= s {
            self.streams.resize_with(s + 1, Vec::new);
        }
        let bits = &mut self.streams[s];
        let c = counter_of(p) as usize;
        if bits.len() <= c / 64 {
            bits.resize(c / 64 + 1, 0);
        }
        let (word, bit) = (c / 64, 1u64 << (c % 64));
        let new = bits[word] & bit == 0;
        bits[word] |= bit;
        new
    }

    /// Forgets stream `s` (a VM's own data, once the VM is done: no other VM has it).
    pub fn drop_stream(&mut self, s: u32) {
        if let Some(bits) = self.streams.get_mut(s as usize) {
            *bits = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_their_origin_and_a_uniform_key() {
        let p = packed(7, 12345);
        assert_eq!((stream_of(p), counter_of(p)), (7, 12345));
        let id = chunk_id(p);
        assert_eq!(origin_of(&id), p);
        assert_ne!(chunk_id(p).prefix_u64(), chunk_id(p + 1).prefix_u64());
    }

    #[test]
    fn first_seen_counts_each_chunk_once() {
        let mut s = FirstSeen::default();
        assert!(s.first(packed(3, 100)));
        assert!(!s.first(packed(3, 100)));
        assert!(s.first(packed(3, 101)));
        s.drop_stream(3);
        assert!(s.first(packed(3, 100)));
    }
}
