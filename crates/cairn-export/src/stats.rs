//! Counters of one export, shown by `cairn export --stats` and in its `--json` status.

use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{json, Value};

#[derive(Debug, Default)]
pub struct ExportStats {
    /// NBD reads and the bytes they returned to the client.
    pub reads: AtomicU64,
    pub bytes_read: AtomicU64,
    /// Bytes of those reads that were zeros by the manifest (never fetched).
    pub zero_bytes_read: AtomicU64,
    /// Chunks and plain chunk bytes fetched from the repository.
    pub chunks_fetched: AtomicU64,
    pub bytes_fetched: AtomicU64,
    /// Manifest bytes fetched (interior nodes at open, leaves on first use).
    pub metadata_bytes_fetched: AtomicU64,
    /// Chunk lookups served by the host-wide cache, and those that were not.
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    /// Bytes served from local seed images instead of being fetched (`export --seed`).
    pub seeded_bytes: AtomicU64,
    /// Bytes of a boot profile's reads fetched ahead of the guest (`export --profile`).
    pub prefetched_bytes: AtomicU64,
    /// Chunks fetched ahead of the reads that needed them.
    pub readahead_chunks: AtomicU64,
    pub fetch_errors: AtomicU64,
    /// NBD writes (including write-zeroes and trim) and their bytes.
    pub writes: AtomicU64,
    pub bytes_written: AtomicU64,
    pub flushes: AtomicU64,
    /// NBD clients in the transmission phase now.
    pub clients: AtomicU64,
}

impl ExportStats {
    pub fn to_json(&self) -> Value {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        json!({
            "clients": g(&self.clients),
            "reads": g(&self.reads),
            "read_bytes": g(&self.bytes_read),
            "zero_read_bytes": g(&self.zero_bytes_read),
            "chunks_fetched": g(&self.chunks_fetched),
            "fetched_bytes": g(&self.bytes_fetched),
            "metadata_fetched_bytes": g(&self.metadata_bytes_fetched),
            "cache_hits": g(&self.cache_hits),
            "cache_misses": g(&self.cache_misses),
            "readahead_chunks": g(&self.readahead_chunks),
            "seeded_bytes": g(&self.seeded_bytes),
            "prefetched_bytes": g(&self.prefetched_bytes),
            "fetch_errors": g(&self.fetch_errors),
            "writes": g(&self.writes),
            "written_bytes": g(&self.bytes_written),
            "flushes": g(&self.flushes),
        })
    }
}
