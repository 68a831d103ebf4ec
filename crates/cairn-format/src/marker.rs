//! Small records of the version-history and GC protocol:
//!
//! - deletion markers, object `deleted/<version id>`: the version is deleted (by `rm` or
//!   `prune`). The version record stays as a link in its image's parent chain; its data is
//!   no longer kept alive by it. Envelope "CRNDEL\0\0": version id (32) | time (i64).
//! - freed markers, object `gc/freed/<version id>`: a GC has given back the space of this
//!   deleted version (fast deletion, or an exact pass that saw it deleted), so fast deletion
//!   does not visit it again. Envelope "CRNFREE\0": version id (32) | time (i64).
//! - sessions, ref `sessions/<id>`: a process working on the repository (commit, restore,
//!   verify, gc). GC waits for sessions older than its plan before deleting anything.
//!   Envelope "CRNSESS\0": started (i64 ns) | heartbeat (i64 ns) | pid (u32) | kind (str16),
//!   then optionally (written since format v1.1) the process tag: boot id (str16) | pid
//!   namespace inode (u64) | process start time in clock ticks since boot (u64) | host name
//!   (str16). With it, a process on the same host tells at once whether the session's process
//!   is alive (same boot, same PID namespace, and a process with that pid and start time).
//! - GC plans, object `gc/plans/<id>`: what a running GC is about to delete. Sessions that
//!   start while a plan exists never deduplicate against its blobs and do not load the index
//!   files it supersedes. Envelope "CRNGCPL\0": created (i64 ns) | n blobs (u32) | n × blob id
//!   | m index files (u32) | m × index id.
//! - quarantine markers, object `quarantine/<pack id>/<blob id>` (since format v1.1): the
//!   copy of the blob in that pack failed its id check on some read, so no process
//!   deduplicates against it or reads it any more; the next commit that meets the content
//!   stores a good copy, which heals every version using it. Envelope "CRNQUAR\0": time
//!   (i64 ns) | offset of the blob in the pack (u32) | reason (str16).
//! - leftover lists, object `gc/leftover/<id>` (since format v1.1): blobs a fast deletion
//!   found dead but left in packs not worth repacking. The next fast deletion judges them
//!   again (against the live summaries), so they are freed once their pack is worth
//!   repacking instead of being forgotten until `gc --repair`. Advisory: a lost list only
//!   delays freeing to the exact pass. Envelope "CRNGCLO\0": created (i64 ns) | n (u32) |
//!   n × blob id.
//! - GC completion, ref `gc/last`: the session cutoff of the newest GC whose sweep ran, and its
//!   plan id. Envelope "CRNGCLS\0": cutoff (i64 ns) | plan id (32).

use crate::codec::{Decoder, Encoder};
use crate::envelope;
use crate::{FormatResult, Id};

const DELETED_MAGIC: &[u8; 8] = b"CRNDEL\0\0";
const FREED_MAGIC: &[u8; 8] = b"CRNFREE\0";
const SESSION_MAGIC: &[u8; 8] = b"CRNSESS\0";
const PLAN_MAGIC: &[u8; 8] = b"CRNGCPL\0";
const GC_LAST_MAGIC: &[u8; 8] = b"CRNGCLS\0";
const QUARANTINE_MAGIC: &[u8; 8] = b"CRNQUAR\0";
const LEFTOVER_MAGIC: &[u8; 8] = b"CRNGCLO\0";

/// Dead blobs a fast deletion left in packs it did not repack.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GcLeftover {
    pub created_ns: i64,
    pub blobs: Vec<Id>,
}

impl GcLeftover {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::with_capacity(12 + 32 * self.blobs.len());
        e.i64(self.created_ns).u32(self.blobs.len() as u32);
        for id in &self.blobs {
            e.id(id);
        }
        envelope::seal(LEFTOVER_MAGIC, &e.finish())
    }

    pub fn decode(data: &[u8]) -> FormatResult<Self> {
        let mut d = Decoder::new(
            envelope::open(LEFTOVER_MAGIC, data, "gc leftover list")?,
            "gc leftover list",
        );
        let created_ns = d.i64()?;
        let n = d.u32()? as usize;
        let mut blobs = Vec::with_capacity(n.min(d.remaining() / 32));
        for _ in 0..n {
            blobs.push(d.id()?);
        }
        d.finish()?;
        Ok(GcLeftover { created_ns, blobs })
    }
}

/// Why and when a blob copy was quarantined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quarantine {
    pub time_ns: i64,
    pub offset: u32,
    pub reason: String,
}

impl Quarantine {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::new();
        // A reason longer than a str16 holds is cut (on a character boundary).
        let mut reason = self.reason.as_str();
        while reason.len() > u16::MAX as usize {
            let mut cut = u16::MAX as usize;
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            reason = &reason[..cut];
        }
        e.i64(self.time_ns).u32(self.offset).str16(reason);
        envelope::seal(QUARANTINE_MAGIC, &e.finish())
    }

    pub fn decode(data: &[u8]) -> FormatResult<Self> {
        let mut d = Decoder::new(
            envelope::open(QUARANTINE_MAGIC, data, "quarantine marker")?,
            "quarantine marker",
        );
        let q = Quarantine {
            time_ns: d.i64()?,
            offset: d.u32()?,
            reason: d.str16()?,
        };
        d.finish()?;
        Ok(q)
    }
}

pub fn encode_deleted(version: &Id, time_ns: i64) -> Vec<u8> {
    let mut e = Encoder::new();
    e.id(version).i64(time_ns);
    envelope::seal(DELETED_MAGIC, &e.finish())
}

pub fn decode_deleted(data: &[u8]) -> FormatResult<(Id, i64)> {
    let mut d = Decoder::new(
        envelope::open(DELETED_MAGIC, data, "deletion marker")?,
        "deletion marker",
    );
    let r = (d.id()?, d.i64()?);
    d.finish()?;
    Ok(r)
}

pub fn encode_freed(version: &Id, time_ns: i64) -> Vec<u8> {
    let mut e = Encoder::new();
    e.id(version).i64(time_ns);
    envelope::seal(FREED_MAGIC, &e.finish())
}

pub fn decode_freed(data: &[u8]) -> FormatResult<(Id, i64)> {
    let mut d = Decoder::new(
        envelope::open(FREED_MAGIC, data, "freed marker")?,
        "freed marker",
    );
    let r = (d.id()?, d.i64()?);
    d.finish()?;
    Ok(r)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub started_ns: i64,
    pub heartbeat_ns: i64,
    pub pid: u32,
    pub kind: String,
    /// Which process on which host (absent in sessions written before format v1.1).
    pub process: Option<ProcessTag>,
}

/// What tells one process apart from every other, past and future: a pid is unique only
/// within one PID namespace of one boot, and only while its process lives (pids are
/// reused), so the tag pairs it with the boot, the namespace and the process's start time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessTag {
    /// `/proc/sys/kernel/random/boot_id`: different after every boot, on every host.
    pub boot_id: String,
    /// Inode of `/proc/self/ns/pid`: containers on one host have PID namespaces of their own.
    pub pid_namespace: u64,
    /// Field 22 of `/proc/<pid>/stat`: when the process started, in clock ticks since boot.
    pub start_ticks: u64,
    /// The host's name, for messages only.
    pub host: String,
}

impl Session {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::new();
        e.i64(self.started_ns)
            .i64(self.heartbeat_ns)
            .u32(self.pid)
            .str16(&self.kind);
        if let Some(p) = &self.process {
            e.str16(&p.boot_id)
                .u64(p.pid_namespace)
                .u64(p.start_ticks)
                .str16(&p.host);
        }
        envelope::seal(SESSION_MAGIC, &e.finish())
    }

    pub fn decode(data: &[u8]) -> FormatResult<Self> {
        let mut d = Decoder::new(envelope::open(SESSION_MAGIC, data, "session")?, "session");
        let mut s = Session {
            started_ns: d.i64()?,
            heartbeat_ns: d.i64()?,
            pid: d.u32()?,
            kind: d.str16()?,
            process: None,
        };
        if d.remaining() > 0 {
            s.process = Some(ProcessTag {
                boot_id: d.str16()?,
                pid_namespace: d.u64()?,
                start_ticks: d.u64()?,
                host: d.str16()?,
            });
        }
        d.finish()?;
        Ok(s)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GcPlan {
    pub created_ns: i64,
    /// Blobs the GC will delete.
    pub dead_blobs: Vec<Id>,
    /// Index files the GC has replaced with a consolidated one and will delete.
    pub superseded_index: Vec<Id>,
}

impl GcPlan {
    pub fn encode(&self) -> Vec<u8> {
        let mut e =
            Encoder::with_capacity(16 + 32 * (self.dead_blobs.len() + self.superseded_index.len()));
        e.i64(self.created_ns).u32(self.dead_blobs.len() as u32);
        for id in &self.dead_blobs {
            e.id(id);
        }
        e.u32(self.superseded_index.len() as u32);
        for id in &self.superseded_index {
            e.id(id);
        }
        envelope::seal(PLAN_MAGIC, &e.finish())
    }

    pub fn decode(data: &[u8]) -> FormatResult<Self> {
        let mut d = Decoder::new(envelope::open(PLAN_MAGIC, data, "gc plan")?, "gc plan");
        let created_ns = d.i64()?;
        let n = d.u32()? as usize;
        let mut dead_blobs = Vec::with_capacity(n.min(d.remaining() / 32));
        for _ in 0..n {
            dead_blobs.push(d.id()?);
        }
        let m = d.u32()? as usize;
        let mut superseded_index = Vec::with_capacity(m.min(d.remaining() / 32));
        for _ in 0..m {
            superseded_index.push(d.id()?);
        }
        d.finish()?;
        Ok(GcPlan {
            created_ns,
            dead_blobs,
            superseded_index,
        })
    }
}

/// The GC lock, ref `gc/lock`: the session key of the GC holding it. The lock is valid while
/// that session is alive. Envelope "CRNGCLK\0": session key (str16).
const GC_LOCK_MAGIC: &[u8; 8] = b"CRNGCLK\0";

pub fn encode_gc_lock(session_key: &str) -> Vec<u8> {
    let mut e = Encoder::new();
    e.str16(session_key);
    envelope::seal(GC_LOCK_MAGIC, &e.finish())
}

pub fn decode_gc_lock(data: &[u8]) -> FormatResult<String> {
    let mut d = Decoder::new(envelope::open(GC_LOCK_MAGIC, data, "gc/lock")?, "gc/lock");
    let v = d.str16()?;
    d.finish()?;
    Ok(v)
}

pub fn encode_gc_last(cutoff_ns: i64, plan: &Id) -> Vec<u8> {
    let mut e = Encoder::new();
    e.i64(cutoff_ns).id(plan);
    envelope::seal(GC_LAST_MAGIC, &e.finish())
}

pub fn decode_gc_last(data: &[u8]) -> FormatResult<(i64, Id)> {
    let mut d = Decoder::new(envelope::open(GC_LAST_MAGIC, data, "gc/last")?, "gc/last");
    let v = (d.i64()?, d.id()?);
    d.finish()?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys;

    #[test]
    fn round_trips() {
        let v = Id::of(b"v");
        assert_eq!(decode_deleted(&encode_deleted(&v, 5)).unwrap(), (v, 5));
        assert_eq!(decode_freed(&encode_freed(&v, 6)).unwrap(), (v, 6));
        let mut s = Session {
            started_ns: 1,
            heartbeat_ns: 2,
            pid: 3,
            kind: "commit".into(),
            process: None,
        };
        // A session written before v1.1 (no process tag) still decodes.
        let old = s.encode();
        assert_eq!(Session::decode(&old).unwrap(), s);
        s.process = Some(ProcessTag {
            boot_id: "6f1c1d8e-5a0b-4e0a-9d2e-3c1b2a0f9e8d".into(),
            pid_namespace: 4026531836,
            start_ticks: 123456,
            host: "node1".into(),
        });
        let new = s.encode();
        assert!(new.len() > old.len());
        assert_eq!(Session::decode(&new).unwrap(), s);
        // A truncated tag is an error, not a session without one.
        let payload = envelope::open(SESSION_MAGIC, &new, "session").unwrap();
        let cut = envelope::seal(SESSION_MAGIC, &payload[..payload.len() - 3]);
        assert!(Session::decode(&cut).is_err());
        let p = GcPlan {
            created_ns: 9,
            dead_blobs: vec![Id::of(b"a"), Id::of(b"b")],
            superseded_index: vec![Id::of(b"i")],
        };
        assert_eq!(GcPlan::decode(&p.encode()).unwrap(), p);
        assert_eq!(decode_gc_last(&encode_gc_last(77, &v)).unwrap(), (77, v));
        let q = Quarantine {
            time_ns: 5,
            offset: 4096,
            reason: "blake3 mismatch".into(),
        };
        assert_eq!(Quarantine::decode(&q.encode()).unwrap(), q);
        let (pack, blob) = (Id::of(b"p"), Id::of(b"b"));
        let key = keys::quarantine(&pack, &blob);
        assert_eq!(keys::parse_quarantine(&key).unwrap(), (pack, blob));
        assert!(keys::parse_quarantine("quarantine/zz").is_err());
    }
}
