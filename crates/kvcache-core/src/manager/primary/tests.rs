use super::super::{ChunkId, Manager, ManagerConfig};
use crate::error::CoreError;
use crate::key::Key;
use crate::policy::Policy;
use crate::{ArcPolicy, LruPolicy, TurnPolicy, VllmSemantics};

fn manager<P: Policy<ChunkId>>(num_chunks: usize) -> Manager<P> {
    Manager::new(ManagerConfig {
        num_chunks,
        enable_events: true,
        store_threshold: 1,
        max_tracker_size: 16,
        semantics: VllmSemantics::default(),
    })
    .unwrap()
}

fn keys(n: u8) -> Vec<Vec<u8>> {
    (0..n).map(crate::testing::manager_key).collect()
}

/// A failed promotion's chunks stay write-pending and out of the free list until released;
/// their keys leave the cache at once; reset is refused meanwhile.
fn deferred_release<P: Policy<ChunkId>>() {
    let mut m = manager::<P>(4);
    let bytes = keys(3);
    let ks: Vec<Key<'_>> = bytes.iter().map(|b| m.key(b)).collect();
    let t = m.request(None);
    let out = m
        .prepare_store(t, &ks, &[None; 3], &mut Vec::new())
        .unwrap()
        .unwrap();
    assert_eq!(out.chunk_ids, vec![0, 1, 2]);
    // Not a pending write any more: refused, nothing changes.
    m.complete_store(&ks[2..], true);
    m.take_events();
    assert!(matches!(
        m.defer_write_release(&ks[1..]),
        Err(CoreError::NotWritePending(_))
    ));
    assert!(matches!(
        m.defer_write_release(&[ks[0], ks[0]]),
        Err(CoreError::DuplicateInOffer(_))
    ));
    assert_eq!((m.policy().len(), m.num_write_pending()), (3, 2));
    let deferred = m.defer_write_release(&ks[..2]).unwrap();
    m.validate().unwrap();
    assert_eq!(deferred, vec![0, 1]);
    assert_eq!((m.policy().len(), m.num_write_pending()), (1, 2));
    assert_eq!(
        (m.len(), m.num_deferred()),
        (3, 2),
        "deferred chunks are held, not free"
    );
    assert_eq!(m.lookup(ks[0]), crate::LookupResult::Miss);
    let events = m.take_events();
    assert_eq!(events.len(), 1);
    assert!(events[0].removed && events[0].metadata_only);
    assert!(matches!(m.try_reset(), Err(CoreError::DeferredWrites(2))));
    // A later store of the same key takes a fresh chunk: the deferred ones are not free.
    let again = m
        .prepare_store(t, &ks[..1], &[None], &mut Vec::new())
        .unwrap()
        .unwrap();
    assert_eq!(again.chunk_ids, vec![3]);
    for bad in [&[5_i64][..], &[-1], &[0, 0], &[1, 7]] {
        assert!(matches!(
            m.release_deferred_write(bad),
            Err(CoreError::NotDeferred(_))
        ));
    }
    assert_eq!(m.num_deferred(), 2);
    m.release_deferred_write(&[1, 0]).unwrap();
    m.validate().unwrap();
    assert_eq!((m.num_write_pending(), m.num_deferred()), (1, 0));
    // Freed in the order given: the last released is reused first (vLLM's free list).
    assert_eq!(m.table().free_list(), &[1, 0]);
    m.try_reset().unwrap();
    m.validate().unwrap();
}

/// A secondary tier's read pins without recording the request's access.
fn reads_pin_without_recording<P: Policy<ChunkId>>() {
    let mut m = manager::<P>(4);
    let bytes = keys(2);
    let ks: Vec<Key<'_>> = bytes.iter().map(|b| m.key(b)).collect();
    let t = m.request(None);
    m.prepare_store(t, &ks, &[None; 2], &mut Vec::new())
        .unwrap()
        .unwrap();
    assert!(matches!(
        m.prepare_read(&ks),
        Err(CoreError::ChunkPending(_))
    ));
    assert_eq!(m.num_evictable(), 0);
    m.complete_store(&ks, true);
    let reader = m.request(None);
    assert_eq!(m.prepare_read(&ks).unwrap(), vec![0, 1]);
    m.validate().unwrap();
    assert_eq!(m.num_evictable(), 0);
    assert_eq!(
        m.unfinished_request_len(reader),
        Some(0),
        "a read is no access"
    );
    m.complete_load(&ks).unwrap();
    assert_eq!(m.num_evictable(), 2);
    m.validate().unwrap();
}

#[test]
fn a_failed_promotion_defers_its_chunks_until_released() {
    deferred_release::<LruPolicy<ChunkId>>();
    deferred_release::<ArcPolicy<ChunkId>>();
    deferred_release::<TurnPolicy<ChunkId>>();
}

#[test]
fn a_secondary_tier_read_pins_without_recording_an_access() {
    reads_pin_without_recording::<LruPolicy<ChunkId>>();
    reads_pin_without_recording::<ArcPolicy<ChunkId>>();
    reads_pin_without_recording::<TurnPolicy<ChunkId>>();
}
