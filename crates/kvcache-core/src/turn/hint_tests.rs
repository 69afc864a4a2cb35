//! Retention hints in the turn policy: what it learns from them, and what it must not do.

use super::hints::{Group, HintStats};
use super::*;
use crate::chunk::{SelfCounted, TestChunk};
use crate::policy::{PolicyExt, Protected};

type P = TurnPolicy<TestChunk>;

/// How a conversation's requests are hinted.
#[derive(Clone, Copy, PartialEq)]
enum Hints {
    None,
    Exact,
    Inverted,
    /// A coin from the generator, unrelated to what happens.
    Random,
}

/// A small deterministic generator (64-bit LCG, high bits).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

struct Conversation {
    id: u32,
    len: u8,
    turns_left: u8,
}

/// Multi-turn traffic through a policy of `capacity` chunks, driven as the manager would
/// (prefix hits, then a store of the rest, evicting what must go first, then the finish):
/// 32 conversations in flight, each turn extending the prefix by two keys, 1–6 turns each.
/// Returns the prefix hits.
fn replay(p: &mut P, requests: usize, hints: Hints, seed: u64) -> usize {
    replay_salted(p, requests, hints, seed, 0)
}

/// [`replay`] with `salt` appended to every key: the same traffic under other key hashes.
fn replay_salted(p: &mut P, requests: usize, hints: Hints, seed: u64, salt: u8) -> usize {
    let mut rng = Lcg(seed);
    let mut next_id = 0;
    let mut conversation = |rng: &mut Lcg| {
        next_id += 1;
        Conversation {
            id: next_id,
            len: 0,
            turns_left: u8::try_from(1 + rng.below(6)).unwrap(),
        }
    };
    let mut active: Vec<Conversation> = (0..32).map(|_| conversation(&mut rng)).collect();
    let mut hits = 0;
    for _ in 0..requests {
        let slot = usize::try_from(rng.below(32)).unwrap();
        let c = &mut active[slot];
        c.len += 2;
        let keys: Vec<Vec<u8>> = (0..c.len)
            .map(|i| [&c.id.to_be_bytes()[..], &[i, salt]].concat())
            .collect();
        let continues = c.turns_left > 1;
        let coin = rng.below(2) == 0;
        let hint = match hints {
            Hints::None => None,
            Hints::Exact => Some(continues),
            Hints::Inverted => Some(!continues),
            Hints::Random => Some(coin),
        };
        let mut r = TurnRequest::default();
        if let Some(continues) = hint {
            let hint = if continues {
                RetentionHint::Continues
            } else {
                RetentionHint::Ends
            };
            p.on_request_hint(&mut r, hint);
        }
        let ks: Vec<Key<'_>> = keys.iter().map(|k| p.key(k)).collect();
        let found: Vec<_> = ks.iter().map(|&k| p.find_resident(k)).collect();
        let prefix = found.iter().take_while(|f| f.is_some()).count();
        hits += prefix;
        let observed: Vec<_> = ks
            .iter()
            .zip(&found)
            .map(|(&key, &id)| Observed {
                key,
                id,
                position: None,
            })
            .collect();
        p.on_request_access(&mut r, &observed);
        let new = keys.len() - prefix;
        let room = p.capacity() - p.len();
        if new > room {
            let hit_ids = found[..prefix].iter().flatten().copied();
            let evicted = p.evict(new - room, &Protected::from_ids(hit_ids), &SelfCounted);
            assert!(evicted.is_some(), "a full cache of idle chunks can always make room");
        }
        for k in &keys[prefix..] {
            let key = p.key(k);
            // Past the first miss, a deeper key may still be resident: it is not stored again.
            if p.find_resident(key).is_none() {
                p.insert_key(&mut r, key, TestChunk::new(0, 0), None, true)
                    .unwrap();
            }
        }
        let finished: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                let access = if i < prefix {
                    Access::Reused
                } else {
                    Access::InsertionOnly
                };
                (p.find_resident(p.key(k)), access)
            })
            .collect();
        p.on_request_finished(&mut r, &finished);
        p.validate().unwrap();
        c.turns_left -= 1;
        if c.turns_left == 0 {
            active[slot] = conversation(&mut rng);
        }
    }
    hits
}

fn shift(p: &P, group: Group) -> i64 {
    p.shift_milli[group as usize]
}

#[test]
fn without_hints_the_policy_keeps_no_hint_state() {
    let mut p = P::new(60);
    replay(&mut p, 2000, Hints::None, 1);
    assert!(!p.hinted);
    assert_eq!(p.hints.marked(Group::Unhinted), 0, "no sample is kept");
    assert_eq!(p.shift_milli, [0; 3]);
    for group in [Group::Continues, Group::Ends] {
        let lists = (0..GROUP_LISTS).map(|c| p.list_len_at(in_group(Class::Tail as usize + c, group)));
        assert_eq!(lists.sum::<usize>(), 0);
    }
}

#[test]
fn a_hint_that_predicts_returns_ranks_its_chunks_apart_and_keeps_more() {
    let mut hinted = P::new(60);
    let with = replay(&mut hinted, 4000, Hints::Exact, 7);
    assert!(shift(&hinted, Group::Continues) > 0, "{:?}", hinted.shift_milli);
    assert!(shift(&hinted, Group::Ends) < 0, "{:?}", hinted.shift_milli);
    let mut blind = P::new(60);
    let without = replay(&mut blind, 4000, Hints::None, 7);
    assert!(with > without, "{with} hits with exact hints, {without} without");
    assert!(hinted.hint_kept_hits() > 0);
}

#[test]
fn an_inverted_hint_is_learned_the_other_way_round() {
    let mut p = P::new(60);
    let inverted = replay(&mut p, 4000, Hints::Inverted, 7);
    assert!(shift(&p, Group::Continues) < 0, "{:?}", p.shift_milli);
    assert!(shift(&p, Group::Ends) > 0, "{:?}", p.shift_milli);
    let without = replay(&mut P::new(60), 4000, Hints::None, 7);
    assert!(inverted > without, "{inverted} hits with inverted hints, {without} without");
}

#[test]
fn a_hint_that_says_nothing_earns_no_shift() {
    let mut p = P::new(60);
    let random = replay(&mut p, 4000, Hints::Random, 7);
    assert_eq!(p.shift_milli, [0; 3], "random hints earned a shift");
    assert!(p.hints.marked(Group::Continues) > 100 && p.hints.marked(Group::Ends) > 100);
    // Chunks still sit on their hint's lists, so ties between lists may break differently
    // than without hints: close, not identical.
    let without = replay(&mut P::new(60), 4000, Hints::None, 7);
    assert!(random.abs_diff(without) * 100 <= without, "{random} vs {without}");
}

#[test]
fn hinted_decisions_do_not_depend_on_key_hashes() {
    // Key hashes are seeded per process; the sample must not be chosen by them, or a replay
    // would decide differently in every process. Other keys, same traffic: same hits.
    let hits: Vec<usize> = (0..3)
        .map(|salt| replay_salted(&mut P::new(60), 3000, Hints::Exact, 7, salt))
        .collect();
    assert!(hits.windows(2).all(|w| w[0] == w[1]), "{hits:?}");
}

#[test]
fn a_kept_chunk_is_still_evicted_when_nothing_else_can_go() {
    let mut p = P::new(60);
    replay(&mut p, 4000, Hints::Exact, 7);
    assert!(shift(&p, Group::Continues) > 0);
    // Every resident chunk can go, the kept ones last; the policy empties completely.
    let n = p.len();
    let victims = p.evict(n, &Protected::new(), &SelfCounted).unwrap();
    assert_eq!(victims.len(), n);
    assert!(p.is_empty());
    p.validate().unwrap();
}

#[test]
fn chunks_of_a_trusted_hint_rank_by_their_shift() {
    let mut p = P::new(100);
    p.hinted = true;
    p.hints.force_rates([(0, 0), (400, 200), (400, 10)]);
    p.refresh_offsets();
    assert!(p.trusted(Group::Continues) && !p.trusted(Group::Ends));
    // Three requests, each storing two new keys: ends, unhinted, continues, in that order,
    // so the continues chunks are the newest and the ends chunks the oldest.
    for (hint, name) in [
        (Some(RetentionHint::Ends), b'e'),
        (None, b'u'),
        (Some(RetentionHint::Continues), b'c'),
    ] {
        let mut r = TurnRequest::default();
        if let Some(hint) = hint {
            p.on_request_hint(&mut r, hint);
        }
        let keys: Vec<[u8; 2]> = (0..2).map(|i| [name, i]).collect();
        let ks: Vec<Key<'_>> = keys.iter().map(|k| p.key(k)).collect();
        for &k in &ks {
            p.insert_key(&mut r, k, TestChunk::new(0, 0), None, true)
                .unwrap();
        }
        let finished: Vec<_> = ks
            .iter()
            .map(|&k| (p.find_resident(k), Access::InsertionOnly))
            .collect();
        p.on_request_finished(&mut r, &finished);
    }
    let order: Vec<u8> = p
        .evict(6, &Protected::new(), &SelfCounted)
        .unwrap()
        .iter()
        .map(|e| e.key.as_slice()[0])
        .collect();
    assert_eq!(order, b"eeuucc", "ends first, continues last");
    p.validate().unwrap();
}

#[test]
fn the_shadow_sample_counts_returns_within_the_horizon_only() {
    let mut stats = HintStats::new(10); // horizon: 40 ticks
    let keys: Vec<u64> = (0..4).map(|i| i << 40).collect();
    stats.mark(keys[0], Group::Continues, 0);
    stats.mark(keys[1], Group::Continues, 0);
    stats.came_back(keys[0], 40);
    stats.came_back(keys[1], 41);
    assert_eq!(
        (stats.marked(Group::Continues), stats.returned(Group::Continues)),
        (2, 1)
    );
    // A key marked twice counts from its latest mark.
    stats.mark(keys[2], Group::Ends, 50);
    stats.mark(keys[2], Group::Ends, 80);
    stats.came_back(keys[2], 115);
    assert_eq!(stats.returned(Group::Ends), 1);
    // Expired marks are forgotten: memory follows the horizon, not the traffic.
    for t in 0..1000u64 {
        stats.mark(keys[3] + t + 1, Group::Unhinted, 200 + t);
    }
    assert!(stats.pending_len() <= 41, "{}", stats.pending_len());
    stats.check().unwrap();
}
