use std::ops::RangeInclusive;

use super::*;
use crate::chunk::{SelfCounted, TestChunk};
use crate::policy::{PolicyExt, Protected};

#[test]
fn an_entry_takes_64_bytes() {
    // The crate docs quote this size as the memory per key.
    assert_eq!(std::mem::size_of::<TurnEntry<u32>>(), 64);
}

type P = TurnPolicy<TestChunk>;

/// Inserts `keys` for `request` as ready, evictable chunks (a completed store).
fn store(p: &mut P, request: &mut TurnRequest, keys: &[&[u8]]) {
    for &k in keys {
        let key = p.key(k);
        p.insert_key(request, key, TestChunk::new(0, 0), None, true)
            .unwrap();
    }
    p.validate().unwrap();
}

/// Shows `keys` to the policy as a request's first observation of them.
fn access(p: &mut P, request: &mut TurnRequest, keys: &[&[u8]]) {
    let observed: Vec<_> = keys
        .iter()
        .map(|&k| {
            let key = p.key(k);
            Observed {
                key,
                id: p.find_resident(key),
                position: None,
            }
        })
        .collect();
    p.on_request_access(request, &observed);
}

/// Finishes a request over `keys` (head to tail); `reused` were read while ready.
fn finish(p: &mut P, r: &mut TurnRequest, keys: &[&[u8]], reused: &[&[u8]]) {
    let entries: Vec<_> = keys
        .iter()
        .map(|&k| {
            let access = if reused.contains(&k) {
                Access::Reused
            } else {
                Access::InsertionOnly
            };
            (p.find_resident(p.key(k)), access)
        })
        .collect();
    p.on_request_finished(r, &entries);
    p.validate().unwrap();
}

fn evict(p: &mut P, n: usize) -> Vec<Vec<u8>> {
    let out = p.evict(n, &Protected::new(), &SelfCounted).unwrap();
    p.validate().unwrap();
    out.into_iter().map(|e| e.key.as_slice().to_vec()).collect()
}

/// A request that reuses `reused` (resident) and stores `new`, then finishes.
fn turn(p: &mut P, reused: &[&[u8]], new: &[&[u8]]) {
    let mut r = TurnRequest::default();
    let all: Vec<&[u8]> = reused.iter().chain(new).copied().collect();
    access(p, &mut r, &all);
    store(p, &mut r, new);
    finish(p, &mut r, &all, reused);
}

fn keys(v: &[&[u8]]) -> Vec<Vec<u8>> {
    v.iter().map(|k| k.to_vec()).collect()
}

#[test]
fn a_fresh_request_goes_first_and_its_ghosts_mark_the_next_turn() {
    let mut p = P::new(100);
    // A returning request (it reuses "s", a shared prefix) stores "a1"; a fresh one, later,
    // stores "f1", "f2".
    store(&mut p, &mut TurnRequest::default(), &[b"s"]);
    turn(&mut p, &[b"s"], &[b"a1", b"a2"]);
    turn(&mut p, &[], &[b"f1", b"f2"]);
    assert_eq!(p.inspect().lists[Class::Fresh as usize].1.len(), 2);
    // The fresh chunks go first although they are the newest, the deeper one first.
    assert_eq!(evict(&mut p, 2), keys(&[b"f2", b"f1"]));
    // The conversation comes back: its first key to store is a ghost, so it is not fresh,
    // and the ghost's key returns with a reuse counted.
    let mut r = TurnRequest::default();
    access(&mut p, &mut r, &[b"f1", b"f2", b"f3"]);
    assert!(r.returning);
    store(&mut p, &mut r, &[b"f1", b"f2", b"f3"]);
    let f1 = p.find(p.key(b"f1")).unwrap();
    assert_eq!(p.entries.get(f1.0).reuses, 1);
    let f3 = p.find(p.key(b"f3")).unwrap();
    assert_eq!(p.entries.get(f3.0).list, Class::Reused0 as u8);
    assert_eq!(p.stats()[0], ("fresh", Stat::Count(0)));
}

#[test]
fn a_request_that_was_not_observed_is_never_fresh() {
    let mut p = P::new(10);
    store(&mut p, &mut TurnRequest::default(), &[b"x"]);
    let x = p.find(p.key(b"x")).unwrap();
    assert_eq!(p.entries.get(x.0).list, Class::Reused0 as u8);
}

#[test]
fn reuse_earns_credit_against_newer_chunks() {
    let mut p = P::new(100);
    // "old" is stored, then reused twice; 30 newer chunks follow, none reused.
    turn(&mut p, &[], &[b"old"]);
    turn(&mut p, &[b"old"], &[b"x"]);
    turn(&mut p, &[b"old"], &[b"y"]);
    let newer: Vec<Vec<u8>> = (0..30u8).map(|i| vec![b'n', i]).collect();
    let refs: Vec<&[u8]> = newer.iter().map(Vec::as_slice).collect();
    turn(&mut p, &[b"x"], &refs);
    // Two reuses are worth 0.45 × 100 × log2(3) ≈ 71 key visits: more than the 30 chunks
    // re-ranked since, so every newer unreused chunk goes first.
    let victims = evict(&mut p, 31);
    assert!(victims[..30].iter().all(|k| k[0] == b'n' || k == b"y"));
    assert!(!victims[..30].contains(&b"old".to_vec()));
}

#[test]
fn the_unreused_tail_of_a_finished_request_is_demoted() {
    let mut p = P::new(4);
    store(&mut p, &mut TurnRequest::default(), &[b"s"]);
    // Two returning requests (both reuse "s"), each storing a head and a tail. Finishes
    // re-rank tail to head: q 1, o 2, s 3, then t 4, h 5, s 6.
    turn(&mut p, &[b"s"], &[b"o", b"q"]);
    turn(&mut p, &[b"s"], &[b"h", b"t"]);
    let t = p.find(p.key(b"t")).unwrap();
    assert_eq!(p.entries.get(t.0).list, Class::Tail as u8);
    // Scores: q 1, t 4 (tails: no offset), o 2 + 4, h 5 + 4; without the demotion by the
    // capacity, "o" (older) would go before "t".
    assert_eq!(evict(&mut p, 3), keys(&[b"q", b"t", b"o"]));
}

#[test]
fn a_requests_new_chunks_are_evicted_deepest_first() {
    let mut p = P::new(10);
    store(&mut p, &mut TurnRequest::default(), &[b"s"]);
    let mut r = TurnRequest::default();
    access(&mut p, &mut r, &[b"s", b"a", b"b", b"c"]);
    // Stored head to tail, not finished yet: the list holds them tail first.
    store(&mut p, &mut r, &[b"a", b"b", b"c"]);
    let lists = p.inspect().lists;
    let reused0 = &lists[Class::Reused0 as usize].1;
    assert_eq!(reused0, &[&b"s"[..], b"c", b"b", b"a"]);
    assert_eq!(evict(&mut p, 3), keys(&[b"s", b"c", b"b"]));
}

#[test]
fn failed_stores_leave_no_ghost_and_evictions_do() {
    let mut p = P::new(10);
    turn(&mut p, &[], &[b"a", b"b"]);
    p.remove_key(p.key(b"a")).unwrap();
    assert_eq!(p.ghosts.len(), 0);
    evict(&mut p, 1);
    assert_eq!(p.ghosts.len(), 1);
    assert!(p.ghosts.contains(p.key(b"b").hash.0));
    p.clear();
    assert_eq!((p.len(), p.ghosts.len()), (0, 0));
    p.validate().unwrap();
}

#[test]
fn pinned_protected_and_unmarked_chunks_are_skipped() {
    let mut p = P::new(10);
    let mut r = TurnRequest::default();
    for (k, ref_cnt, evictable) in [(b"a", 1, false), (b"b", 0, false), (b"c", 0, true)] {
        let key = p.key(k);
        p.insert_key(&mut r, key, TestChunk::new(0, ref_cnt), None, evictable)
            .unwrap();
    }
    let c = p.find(p.key(b"c")).unwrap();
    assert!(p
        .evict(1, &Protected::from_ids([c]), &SelfCounted)
        .is_none());
    assert_eq!(p.len(), 3);
    assert_eq!(evict(&mut p, 1), keys(&[b"c"]));
    assert!(p.evict(1, &Protected::new(), &SelfCounted).is_none());
    p.validate().unwrap();
}

#[test]
fn victims_come_in_the_order_inspect_ranks_them() {
    let mut p = P::new(8);
    // Chunks on several lists: reused ones (credit), tails, plain ones and fresh ones.
    turn(&mut p, &[], &[b"r", b"r2"]);
    turn(&mut p, &[b"r"], &[b"a", b"b"]);
    turn(&mut p, &[b"r", b"a"], &[b"c"]);
    turn(&mut p, &[], &[b"f"]);
    let order: Vec<Vec<u8>> = p
        .inspect()
        .ranks
        .unwrap()
        .iter()
        .map(|e| e.key.to_vec())
        .collect();
    assert_eq!(order.len(), 6);
    assert_eq!(order[0], b"r2", "fresh and never reused: first");
    assert_eq!(evict(&mut p, 6), order);
}

#[test]
fn a_huge_capacity_holding_few_chunks_keeps_a_small_ghost_table() {
    // Capacity is a caller's number: it must not size the ghost tables by itself.
    let mut p = P::new(1 << 40);
    let keys: Vec<[u8; 2]> = (0..20u8).map(|i| [b'k', i]).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    turn(&mut p, &[], &refs);
    evict(&mut p, 10);
    assert_eq!(p.ghosts.len(), 10);
    assert!(p.ghosts.heap_bytes() <= 2 * 64 * 8, "{} bytes", p.ghosts.heap_bytes());
}

/// Returning requests `ids` of `round` (each reuses "s"), each storing a head and a tail chunk;
/// with `read_tails`, each but the first also reads the previous request's tail (a next turn
/// re-reading it).
fn tails(p: &mut P, round: u8, ids: RangeInclusive<u8>, read_tails: bool) {
    let first = *ids.start();
    for i in ids {
        let (head, tail) = ([b'h', round, i], [b't', round, i]);
        let previous = [b't', round, i.wrapping_sub(1)];
        let mut reused: Vec<&[u8]> = vec![b"s"];
        if read_tails && i > first {
            reused.push(&previous);
        }
        turn(p, &reused, &[&head, &tail]);
    }
}

#[test]
fn tails_rarely_read_again_are_dead_and_go_first() {
    let mut p = P::new(1000);
    store(&mut p, &mut TurnRequest::default(), &[b"s"]);
    tails(&mut p, 0, 0..=62, false);
    // 63 marks: too few to judge, so tails are only demoted.
    assert!(!p.tails_dead());
    assert_eq!(p.list_len(Class::Tail), 63);
    tails(&mut p, 0, 63..=63, false);
    assert!(p.tails_dead(), "64 tails, none read again");
    assert_eq!(p.list_len(Class::Dead), 1);
    // The dead tail, the newest chunk, goes before every older one, demoted tails included.
    assert_eq!(evict(&mut p, 2), keys(&[&[b't', 0, 63], &[b't', 0, 0]]));
}

#[test]
fn tails_read_again_are_kept_demoted() {
    let mut p = P::new(1000);
    store(&mut p, &mut TurnRequest::default(), &[b"s"]);
    tails(&mut p, 0, 0..=99, true);
    assert!(!p.tails_dead());
    assert_eq!((p.tails_marked, p.tails_read), (100, 99));
    assert_eq!(p.list_len(Class::Dead), 0);
    assert_eq!(p.list_len(Class::Tail), 1);
}

#[test]
fn a_tail_stored_again_from_its_ghost_counts_as_read() {
    let mut p = P::new(10);
    store(&mut p, &mut TurnRequest::default(), &[b"s"]);
    turn(&mut p, &[b"s"], &[b"h", b"t"]);
    assert_eq!((p.tails_marked, p.tails_read), (1, 0));
    assert_eq!(evict(&mut p, 1), keys(&[b"t"]));
    // The next turn reads the tail again: it is a ghost now, and comes back reused once.
    turn(&mut p, &[b"s", b"h"], &[b"t", b"u"]);
    assert_eq!((p.tails_marked, p.tails_read), (2, 1));
    let t = p.find(p.key(b"t")).unwrap();
    assert_eq!(p.entries.get(t.0).reuses, 1);
    assert!(!p.entries.get(t.0).has(TAIL));
}

#[test]
fn the_tail_estimate_follows_the_traffic() {
    let mut p = P::new(1000);
    store(&mut p, &mut TurnRequest::default(), &[b"s"]);
    // Tails read again at first, then never: the halving window forgets the old reads.
    for round in 0..40u8 {
        tails(&mut p, round, 0..=255, round < 10);
        if round == 9 {
            assert!(!p.tails_dead());
        }
        // Everything but "s" goes, so the next round's keys are new.
        let n = p.len() - 1;
        evict(&mut p, n);
        assert!(p.find(p.key(b"s")).is_some());
    }
    assert!(p.tails_dead());
    assert!(p.tails_marked < TAIL_WINDOW && p.tails_marked >= TAIL_WINDOW / 2);
}
