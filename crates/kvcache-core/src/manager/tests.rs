//! The manager's own unit tests (the model-checking harness is `crate::testing`).

use super::*;
use crate::{ArcPolicy, LruPolicy};

fn failed_store_named_twice_frees_its_chunk_once<P: Policy<ChunkId>>() {
    let config = ManagerConfig {
        num_chunks: 4,
        enable_events: false,
        store_threshold: 1,
        max_tracker_size: 16,
        semantics: VllmSemantics::default(),
    };
    let bytes = [
        crate::testing::manager_key(1),
        crate::testing::manager_key(2),
    ];
    let mut m: Manager<P> = Manager::new(config).unwrap();
    let t = m.request(None);
    let ks: Vec<Key<'_>> = bytes.iter().map(|b| m.key(b)).collect();
    let out = m
        .prepare_store(t, &ks, &[None, None], &mut Vec::new())
        .unwrap()
        .unwrap();
    assert_eq!(out.chunk_ids, vec![0, 1]);
    let twice = [ks[0], ks[0], ks[1]];
    m.complete_store(&twice, false);
    m.validate().unwrap();
    assert_eq!(m.table().num_free(), 4);
    assert_eq!(m.policy().len(), 0);
}

#[test]
fn a_failed_store_named_twice_frees_its_chunk_once() {
    failed_store_named_twice_frees_its_chunk_once::<LruPolicy<ChunkId>>();
    failed_store_named_twice_frees_its_chunk_once::<ArcPolicy<ChunkId>>();
}

#[test]
fn a_huge_cache_is_refused_or_free_until_used() {
    let config = |num_chunks| ManagerConfig {
        num_chunks,
        enable_events: false,
        store_threshold: 1,
        max_tracker_size: 16,
        semantics: VllmSemantics::default(),
    };
    // 2^32 - 1 chunks: nothing per chunk up front (the key index is presized, capped).
    let m = Manager::<LruPolicy<ChunkId>>::new(config(MAX_CHUNKS)).unwrap();
    assert_eq!(m.memory_usage().table, 0);
    assert!(m.memory_usage().total() <= 64 << 20);
    assert!(matches!(
        Manager::<ArcPolicy<ChunkId>>::new(config(MAX_CHUNKS + 1)),
        Err(CoreError::TooManyChunks { .. })
    ));
}
