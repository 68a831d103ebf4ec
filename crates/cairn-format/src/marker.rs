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
//!   Envelope "CRNSESS\0": started (i64 ns) | heartbeat (i64 ns) | pid (u32) | kind (str16).
//! - GC plans, object `gc/plans/<id>`: what a running GC is about to delete. Sessions that
//!   start while a plan exists never deduplicate against its blobs and do not load the index
//!   files it supersedes. Envelope "CRNGCPL\0": created (i64 ns) | n blobs (u32) | n × blob id
//!   | m index files (u32) | m × index id.
//! - GC completion, ref `gc/last`: the session cutoff of the newest GC whose sweep ran, and its
//!   plan id. Envelope "CRNGCLS\0": cutoff (i64 ns) | plan id (32).

use crate::codec::{Decoder, Encoder};
use crate::envelope;
use crate::{FormatResult, Id};

pub const DELETED_PREFIX: &str = "deleted/";
pub const FREED_PREFIX: &str = "gc/freed/";
pub const SESSIONS_PREFIX: &str = "sessions/";
pub const PLANS_PREFIX: &str = "gc/plans/";
pub const GC_LAST_REF: &str = "gc/last";

const DELETED_MAGIC: &[u8; 8] = b"CRNDEL\0\0";
const FREED_MAGIC: &[u8; 8] = b"CRNFREE\0";
const SESSION_MAGIC: &[u8; 8] = b"CRNSESS\0";
const PLAN_MAGIC: &[u8; 8] = b"CRNGCPL\0";
const GC_LAST_MAGIC: &[u8; 8] = b"CRNGCLS\0";

pub fn deleted_key(version: &Id) -> String {
    format!("{DELETED_PREFIX}{version}")
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

pub fn freed_key(version: &Id) -> String {
    format!("{FREED_PREFIX}{version}")
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
}

impl Session {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::new();
        e.i64(self.started_ns)
            .i64(self.heartbeat_ns)
            .u32(self.pid)
            .str16(&self.kind);
        envelope::seal(SESSION_MAGIC, &e.finish())
    }

    pub fn decode(data: &[u8]) -> FormatResult<Self> {
        let mut d = Decoder::new(envelope::open(SESSION_MAGIC, data, "session")?, "session");
        let s = Session {
            started_ns: d.i64()?,
            heartbeat_ns: d.i64()?,
            pid: d.u32()?,
            kind: d.str16()?,
        };
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
pub const GC_LOCK_REF: &str = "gc/lock";
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

    #[test]
    fn round_trips() {
        let v = Id::of(b"v");
        assert_eq!(decode_deleted(&encode_deleted(&v, 5)).unwrap(), (v, 5));
        assert_eq!(decode_freed(&encode_freed(&v, 6)).unwrap(), (v, 6));
        let s = Session {
            started_ns: 1,
            heartbeat_ns: 2,
            pid: 3,
            kind: "commit".into(),
        };
        assert_eq!(Session::decode(&s.encode()).unwrap(), s);
        let p = GcPlan {
            created_ns: 9,
            dead_blobs: vec![Id::of(b"a"), Id::of(b"b")],
            superseded_index: vec![Id::of(b"i")],
        };
        assert_eq!(GcPlan::decode(&p.encode()).unwrap(), p);
        assert_eq!(decode_gc_last(&encode_gc_last(77, &v)).unwrap(), (77, v));
    }
}
