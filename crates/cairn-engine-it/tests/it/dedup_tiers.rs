//! The dedup tiers of a format 2 commit (`commit/dedup/`): what the parent's leaf, similar
//! packs and the index each find, in exact and bounded mode, counted chunk by chunk.

use std::sync::Arc;

use crate::common::{noise, restore_bytes};
use cairn_engine::commit::dedup::similar::{HOOKS, MAX_HOOKS};
use cairn_engine::commit::{commit, CommitOptions, CommitResult, DedupMode};
use cairn_engine::source::StreamSource;
use cairn_engine::verify::verify;
use cairn_format::config::RepoConfig;
use cairn_format::Id;
use cairn_repo::Repo;
use cairn_store::LocalStore;

const SEGMENT: usize = 256 << 10;
const BLOCK: usize = 4096;

async fn repo(dir: &std::path::Path, pack_target: u32) -> Arc<Repo> {
    let store = Arc::new(LocalStore::create(dir).unwrap());
    let config = RepoConfig {
        repo_id: [7; 16],
        segment_size: SEGMENT as u32,
        pack_target,
        ..RepoConfig::default_v2()
    };
    Arc::new(Repo::init(store, config).await.unwrap())
}

async fn commit_mode(repo: &Arc<Repo>, image: &str, data: &[u8], mode: DedupMode) -> CommitResult {
    let src = StreamSource::new("test", std::io::Cursor::new(data.to_vec()));
    let options = CommitOptions {
        dedup: mode,
        workers: 1,
        ..Default::default()
    };
    commit(repo.clone(), image, Box::new(src), options)
        .await
        .unwrap()
}

async fn assert_restores_and_verifies(repo: &Arc<Repo>, r: &CommitResult, data: &[u8]) {
    assert!(restore_bytes(repo, &r.record).await.unwrap() == data);
    let report = verify(repo.clone()).await.unwrap();
    assert!(report.is_clean(), "{report:?}");
}

#[tokio::test]
async fn data_moved_to_other_segments_is_found_through_its_pack_in_both_modes() {
    // 16 segments of noise, one pack; then the same bytes moved by four segments and five
    // blocks (so no segment's bytes equal a parent leaf's), with one segment of new data:
    // no segment's parent leaf holds any of its chunks.
    let a = noise(16 * SEGMENT, 1);
    let shift = 4 * SEGMENT + 5 * BLOCK;
    let mut b = a[shift..].to_vec();
    b.extend_from_slice(&a[..shift - SEGMENT]);
    b.extend(noise(SEGMENT, 2));
    for mode in [DedupMode::Exact, DedupMode::Bounded] {
        let dir = tempfile::tempdir().unwrap();
        let repo = repo(dir.path(), 8 << 20).await;
        commit_mode(&repo, "vm", &a, mode).await;
        let moved = commit_mode(&repo, "vm", &b, mode).await;
        let (s, t) = (moved.record.stats, moved.dedup);
        assert_eq!(s.new_chunks, 64, "{mode:?}: only the new segment is stored");
        assert_eq!(moved.reused_segments, 0);
        assert_eq!(t.parent, 0, "{mode:?}");
        assert_eq!(t.similar, 15 * 64, "{mode:?}: {t:?}");
        assert_eq!(t.index, 0, "{mode:?}: every moved chunk came from its pack");
        // The first moved segment's first hook finds the pack, which then answers every
        // moved chunk with no lookup; the new segment's four hooks miss.
        assert_eq!(t.hook_lookups, 1 + 4, "{mode:?}: {t:?}");
        assert_restores_and_verifies(&repo, &moved, &b).await;
    }
}

/// The chunk ids of `data`'s 4 KiB blocks, as an unencrypted repository names them.
fn block_ids(data: &[u8]) -> Vec<Id> {
    data.chunks(BLOCK).map(Id::of).collect()
}

#[tokio::test]
async fn bounded_mode_stores_again_what_its_hooks_do_not_lead_to_and_exact_mode_does_not() {
    // Forty-eight images of one segment each, committed apart (one pack each); then a new
    // image whose one segment takes a block of each and sixteen new ones: more packs than a
    // segment may look up.
    let sources: Vec<Vec<u8>> = (0..48).map(|i| noise(SEGMENT, 100 + i)).collect();
    let mut mixed = Vec::new();
    let mut from = Vec::new();
    for (i, s) in sources.iter().enumerate() {
        let at = (i % 64) * BLOCK;
        mixed.extend_from_slice(&s[at..at + BLOCK]);
        from.push(Some(i));
    }
    mixed.extend(noise(16 * BLOCK, 999));
    from.extend([None; 16]);
    mixed.resize(SEGMENT, 0);
    // What the hooks find, worked out apart: the smallest key among the chunks not found
    // yet leads to the pack of the image it came from (a new chunk's hook finds nothing),
    // until HOOKS in a row found nothing or MAX_HOOKS were looked up.
    let ids = block_ids(&mixed[..64 * BLOCK]);
    let mut open: Vec<usize> = (0..64).collect();
    open.sort_by_key(|&i| (ids[i].prefix_u64(), ids[i]));
    let (mut expected_similar, mut lookups, mut misses) = (0, 0, 0);
    while misses < HOOKS && lookups < MAX_HOOKS && !open.is_empty() {
        let hook = open.remove(0);
        lookups += 1;
        match from[hook] {
            Some(src) => {
                expected_similar += 1;
                open.retain(|&i| from[i] != Some(src));
                misses = 0;
            }
            None => misses += 1,
        }
    }
    // With these seeds: 21 packs found through 32 lookups (four hooks in all, the policy
    // before 2026-11-27, found 1).
    assert!(expected_similar < 48, "the hooks cannot reach every pack");
    assert!(
        expected_similar > HOOKS as u64,
        "hooks that find packs keep looking"
    );

    let mut stored = Vec::new();
    for mode in [DedupMode::Exact, DedupMode::Bounded] {
        let dir = tempfile::tempdir().unwrap();
        let repo = repo(dir.path(), 1 << 20).await;
        for (i, s) in sources.iter().enumerate() {
            commit_mode(&repo, &format!("src-{i}"), s, mode).await;
        }
        let r = commit_mode(&repo, "mixed", &mixed, mode).await;
        let t = r.dedup;
        assert_eq!(t.parent, 0);
        assert_eq!(t.similar, expected_similar, "{mode:?}: {t:?}");
        assert_eq!(t.hook_lookups, lookups as u64);
        match mode {
            DedupMode::Exact => {
                assert_eq!(t.index, 48 - expected_similar, "{t:?}");
                assert_eq!(r.record.stats.new_chunks, 16);
            }
            DedupMode::Bounded => {
                assert_eq!(t.index, 0, "bounded mode asks the index only for hooks");
                assert_eq!(r.record.stats.new_chunks, 64 - expected_similar);
            }
        }
        assert_restores_and_verifies(&repo, &r, &mixed).await;
        stored.push(r.record.stats.stored_bytes);
    }
    assert!(
        stored[1] > stored[0] + (48 - expected_similar - 1) * BLOCK as u64,
        "bounded stores the missed noise again: {stored:?}"
    );
}

#[tokio::test]
async fn a_clone_committed_as_its_own_image_dedups_in_bounded_mode() {
    // A golden image (text-like data in 24 segments, several packs) and a clone of it with
    // one block changed in every fourth segment, committed as an image of its own: no
    // parent, so only similarity finds the golden image's chunks.
    let golden: Vec<u8> = (0..24 * SEGMENT / 8)
        .flat_map(|i| ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555).to_le_bytes())
        .collect();
    let mut clone = golden.clone();
    for seg in (0..24).step_by(4) {
        let at = seg * SEGMENT + 10 * BLOCK;
        clone[at..at + BLOCK].copy_from_slice(&noise(BLOCK, seg as u64));
    }
    let dir = tempfile::tempdir().unwrap();
    let repo = repo(dir.path(), 1 << 20).await;
    let g = commit_mode(&repo, "golden", &golden, DedupMode::Bounded).await;
    assert_eq!(g.record.stats.new_chunks, 24 * 64);
    let c = commit_mode(&repo, "clone", &clone, DedupMode::Bounded).await;
    assert_eq!(c.record.stats.new_chunks, 6, "{:?}", c.dedup);
    assert_eq!(c.dedup.similar, 24 * 64 - 6);
    assert_eq!(c.dedup.index, 0);
    assert!(
        c.dedup.hook_lookups <= 4 * 24,
        "at most four lookups a segment: {:?}",
        c.dedup
    );
    assert_restores_and_verifies(&repo, &c, &clone).await;
}

#[tokio::test]
async fn bounded_commits_forget_their_oldest_claims_and_store_a_far_repeat_again() {
    // Eight segments of new blocks (512); block 5 repeats as segment 1's first block (near:
    // 64 claims later) and block 0 as the very last block (far: 510 claims later). With
    // generations of 64 claims, the older ones are spilled to scratch files and both repeats
    // are found there; bounded mode with no memory for spilled claims forgets the far one.
    let mut data = noise(8 * SEGMENT, 3);
    let block = |i: usize| i * BLOCK..(i + 1) * BLOCK;
    let near = data[block(5)].to_vec();
    data[block(64)].copy_from_slice(&near);
    let far = data[block(0)].to_vec();
    data[block(511)].copy_from_slice(&far);
    let cases = [
        // (mode, claims kept a generation, memory for spilled claims, workers, chunks stored)
        (DedupMode::Exact, 64, None, 1, 510),
        (DedupMode::Bounded, 0, None, 1, 510),
        (DedupMode::Bounded, 64, None, 1, 510),
        (DedupMode::Bounded, 64, Some(0), 1, 511),
        (DedupMode::Bounded, 64, Some(0), 2, 0),
    ];
    for (mode, claims, spill_memory, workers, stored) in cases {
        let dir = tempfile::tempdir().unwrap();
        let repo = repo(dir.path(), 8 << 20).await;
        let src = StreamSource::new("test", std::io::Cursor::new(data.clone()));
        let options = CommitOptions {
            dedup: mode,
            claim_generation: claims,
            claim_spill_memory: spill_memory,
            workers,
            ..Default::default()
        };
        let r = commit(repo.clone(), "vm", Box::new(src), options)
            .await
            .unwrap();
        if workers == 1 {
            assert_eq!(
                r.record.stats.new_chunks, stored,
                "{mode:?}, {claims} claims a generation, {spill_memory:?} bytes spilled"
            );
        } else {
            // Two workers claim in an order that varies: the near repeat may be stored
            // twice, the far one too; never more, and every block restores.
            let n = r.record.stats.new_chunks;
            assert!((510..=512).contains(&n), "{n}");
        }
        assert_restores_and_verifies(&repo, &r, &data).await;
    }
}
