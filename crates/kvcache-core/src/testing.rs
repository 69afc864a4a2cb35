//! A model-checking harness shared by the property tests and the fuzz target.
//!
//! An [`Op`] is one protocol call, shaped like the manager's use (keys from a small universe so
//! they collide, reference counts changed only through the manager's transitions). [`Harness`]
//! applies it to a policy and then checks: `validate()`; every evicted entry was resident, idle,
//! unprotected (and, for LRU, marked evictable); a failed eviction changed nothing; LRU victims
//! are the smallest ranks among the eligible entries.

use std::collections::HashMap;

use crate::arc::{Access, ArcPolicy, ListId};
use crate::chunk::{SelfCounted, TestChunk};
use crate::lru::{InsertRank, LruPolicy, RequestRank};
use crate::Key;

/// Keys are `[k]` for k in `0..KEYS`.
pub const KEYS: u8 = 12;
const REQUESTS: usize = 4;

#[derive(Clone, Debug)]
pub enum Op {
    /// Insert a pending chunk (ref_cnt −1); `request` gives LRU a request rank at `pos`.
    Insert {
        key: u8,
        request: Option<(u8, i64)>,
    },
    /// The store completed (−1 → 0, mark_evictable) or failed (remove).
    FinishStore {
        key: u8,
        ok: bool,
    },
    /// A load pins (0 → 1 … mark_non_evictable) or unpins a ready chunk.
    Pin {
        key: u8,
        load: bool,
    },
    Touch {
        keys: Vec<u8>,
    },
    StoreMiss {
        keys: Vec<u8>,
    },
    Access {
        request: u8,
        keys: Vec<(u8, i64)>,
    },
    Finish {
        keys: Vec<u8>,
        access: Vec<u8>,
    },
    Evict {
        n: u8,
        protected: Vec<u8>,
    },
    /// The request's state dies (LRU releases its rank).
    EndRequest {
        request: u8,
    },
    Clear,
}

impl Op {
    /// Decodes ops from raw fuzzer bytes; every byte string is a valid program.
    pub fn decode(mut data: &[u8]) -> Vec<Op> {
        let mut next = move || -> Option<u8> {
            let (&b, rest) = data.split_first()?;
            data = rest;
            Some(b)
        };
        let mut ops = Vec::new();
        while let Some(tag) = next() {
            let mut arg = || next().unwrap_or(0);
            let key = |b: u8| b % KEYS;
            let list = |bytes: &mut dyn FnMut() -> u8| -> Vec<u8> {
                let n = bytes() % 6;
                (0..n).map(|_| key(bytes())).collect()
            };
            let op = match tag % 10 {
                0 => {
                    let (k, r, p) = (key(arg()), arg(), arg());
                    Op::Insert {
                        key: k,
                        request: (r % 2 == 0).then_some((r / 2 % 4, i64::from(p % 8))),
                    }
                }
                1 => Op::FinishStore {
                    key: key(arg()),
                    ok: arg() % 4 != 0,
                },
                2 => Op::Pin {
                    key: key(arg()),
                    load: arg() % 2 == 0,
                },
                3 => Op::Touch {
                    keys: list(&mut arg),
                },
                4 => Op::StoreMiss {
                    keys: list(&mut arg),
                },
                5 => {
                    let request = arg() % 4;
                    let keys = list(&mut arg)
                        .into_iter()
                        .map(|k| (k, i64::from(k % 5)))
                        .collect();
                    Op::Access { request, keys }
                }
                6 => Op::Finish {
                    keys: list(&mut arg),
                    access: list(&mut arg),
                },
                7 => Op::Evict {
                    n: arg() % 5,
                    protected: list(&mut arg),
                },
                8 => Op::EndRequest { request: arg() % 4 },
                _ => {
                    if arg() % 16 == 0 {
                        Op::Clear
                    } else {
                        Op::Touch { keys: vec![] }
                    }
                }
            };
            ops.push(op);
        }
        ops
    }
}

enum Policy {
    Lru(LruPolicy<TestChunk>),
    Arc(ArcPolicy<TestChunk>),
}

/// Drives one policy with [`Op`]s and checks it after each.
pub struct Harness {
    policy: Policy,
    chunks: HashMap<u8, TestChunk>,
    requests: [Option<RequestRank>; REQUESTS],
    next_id: u64,
}

fn bytes(k: u8) -> [u8; 1] {
    [k]
}

impl Harness {
    /// An LRU harness; small capacities also shrink the group walk so that position indexes
    /// get built and exercised.
    pub fn lru(capacity: usize) -> Self {
        let mut policy = LruPolicy::new(capacity);
        if capacity < 4 {
            policy.set_walk_limit(capacity.saturating_sub(1));
        }
        Self::new(Policy::Lru(policy))
    }

    pub fn arc(capacity: usize) -> Self {
        Self::new(Policy::Arc(ArcPolicy::new(capacity)))
    }

    fn new(policy: Policy) -> Self {
        Harness {
            policy,
            chunks: HashMap::new(),
            requests: [None; REQUESTS],
            next_id: 0,
        }
    }

    fn key<'a>(&self, k: &'a [u8; 1]) -> Key<'a> {
        match &self.policy {
            Policy::Lru(p) => p.key(k),
            Policy::Arc(p) => p.key(k),
        }
    }

    fn snapshot(&self) -> String {
        match &self.policy {
            Policy::Lru(p) => format!("{:?}", p.entries().collect::<Vec<_>>()),
            Policy::Arc(p) => {
                let lists: Vec<Vec<&[u8]>> = ListId::ALL
                    .iter()
                    .map(|&l| p.list_keys(l).collect())
                    .collect();
                format!("{lists:?} {}", p.target_t1_size())
            }
        }
    }

    fn request_rank(&mut self, r: u8) -> RequestRank {
        let Policy::Lru(p) = &mut self.policy else {
            unreachable!()
        };
        let slot = &mut self.requests[r as usize % REQUESTS];
        let rank = p.request_rank(*slot);
        *slot = Some(rank);
        rank
    }

    /// Applies `op`; `Err` describes the first violated property.
    pub fn apply(&mut self, op: &Op) -> Result<(), String> {
        match op {
            Op::Insert { key, request } => {
                if self.chunks.contains_key(key) {
                    return Ok(());
                }
                self.next_id += 1;
                let chunk = TestChunk::new(self.next_id, -1);
                let kb = bytes(*key);
                let k = self.key(&kb);
                match request {
                    Some((r, pos)) if matches!(self.policy, Policy::Lru(_)) => {
                        let rank = self.request_rank(*r);
                        let Policy::Lru(p) = &mut self.policy else {
                            unreachable!()
                        };
                        p.insert(k, chunk.clone(), InsertRank::Request(rank, *pos), false)
                    }
                    _ => match &mut self.policy {
                        Policy::Lru(p) => p.insert(k, chunk.clone(), InsertRank::Fresh, false),
                        Policy::Arc(p) => p.insert(k, chunk.clone()),
                    },
                }
                .map_err(|e| e.to_string())?;
                self.chunks.insert(*key, chunk);
            }
            Op::FinishStore { key, ok } => {
                let Some(chunk) = self.chunks.get(key).filter(|c| c.ref_cnt.get() == -1) else {
                    return Ok(());
                };
                let kb = bytes(*key);
                let k = self.key(&kb);
                if *ok {
                    chunk.set(0);
                    if let Policy::Lru(p) = &mut self.policy {
                        p.mark_evictable(k).map_err(|e| e.to_string())?;
                    }
                } else {
                    match &mut self.policy {
                        Policy::Lru(p) => p.remove(k).map(drop),
                        Policy::Arc(p) => p.remove(k).map(drop),
                    }
                    .map_err(|e| e.to_string())?;
                    self.chunks.remove(key);
                }
            }
            Op::Pin { key, load } => {
                let Some(chunk) = self.chunks.get(key) else {
                    return Ok(());
                };
                let cnt = chunk.ref_cnt.get();
                let kb = bytes(*key);
                let k = self.key(&kb);
                if *load && cnt >= 0 {
                    if cnt == 0 {
                        if let Policy::Lru(p) = &mut self.policy {
                            p.mark_non_evictable(k).map_err(|e| e.to_string())?;
                        }
                    }
                    chunk.set(cnt + 1);
                } else if !*load && cnt > 0 {
                    chunk.set(cnt - 1);
                    if cnt == 1 {
                        if let Policy::Lru(p) = &mut self.policy {
                            p.mark_evictable(k).map_err(|e| e.to_string())?;
                        }
                    }
                }
            }
            Op::Touch { keys } | Op::StoreMiss { keys } => {
                let kbs: Vec<[u8; 1]> = keys.iter().map(|&k| bytes(k)).collect();
                let ks: Vec<Key<'_>> = kbs.iter().map(|k| self.key(k)).collect();
                match (&mut self.policy, op) {
                    (Policy::Lru(p), _) => p.touch(&ks),
                    (Policy::Arc(p), Op::Touch { .. }) => p.touch(&ks, &SelfCounted),
                    (Policy::Arc(p), _) => p.on_store_miss(&ks),
                }
            }
            Op::Access { request, keys } => {
                if matches!(self.policy, Policy::Lru(_)) {
                    let rank = self.request_rank(*request);
                    let kbs: Vec<([u8; 1], i64)> =
                        keys.iter().map(|&(k, p)| (bytes(k), p)).collect();
                    let ks: Vec<(Key<'_>, Option<i64>)> =
                        kbs.iter().map(|(k, p)| (self.key(k), Some(*p))).collect();
                    let Policy::Lru(p) = &mut self.policy else {
                        unreachable!()
                    };
                    p.on_request_access(rank, &ks).map_err(|e| e.to_string())?;
                }
            }
            Op::Finish { keys, access } => {
                let kbs: Vec<[u8; 1]> = keys.iter().map(|&k| bytes(k)).collect();
                let ks: Vec<Key<'_>> = kbs.iter().map(|k| self.key(k)).collect();
                match &mut self.policy {
                    Policy::Lru(p) => p.touch(&ks),
                    Policy::Arc(p) => {
                        let entries = p.resolve(&ks);
                        let accesses: Vec<(u32, Access)> = keys
                            .iter()
                            .zip(entries)
                            .map(|(k, idx)| {
                                let a = match access.iter().position(|x| x == k).map(|i| i % 2) {
                                    Some(0) => Access::InsertionOnly,
                                    Some(_) => Access::Reused,
                                    None => Access::Other,
                                };
                                (idx, a)
                            })
                            .collect();
                        p.on_request_finished(&accesses);
                    }
                }
            }
            Op::Evict { n, protected } => self.evict(*n as usize, protected)?,
            Op::EndRequest { request } => {
                if let (Policy::Lru(p), Some(rank)) = (
                    &mut self.policy,
                    self.requests[*request as usize % REQUESTS].take(),
                ) {
                    p.release_request_rank(rank);
                }
            }
            Op::Clear => {
                match &mut self.policy {
                    Policy::Lru(p) => p.clear(),
                    Policy::Arc(p) => p.clear(),
                }
                self.chunks.clear();
            }
        }
        self.validate()
    }

    fn evict(&mut self, n: usize, protected: &[u8]) -> Result<(), String> {
        let before = self.snapshot();
        let pkbs: Vec<[u8; 1]> = protected.iter().map(|&k| bytes(k)).collect();
        let pks: Vec<Key<'_>> = pkbs.iter().map(|k| self.key(k)).collect();
        // For LRU, the expected victims: eligible entries in ascending (rank, -pos, key).
        let expected: Option<Vec<Vec<u8>>> = match &self.policy {
            Policy::Lru(p) => {
                let mut eligible: Vec<_> = p
                    .entries()
                    .filter(|e| {
                        e.evictable
                            && !protected.contains(&e.key[0])
                            && self.chunks[&e.key[0]].ref_cnt.get() == 0
                    })
                    .map(|e| (e.rank, std::cmp::Reverse(e.position), e.key.to_vec()))
                    .collect();
                eligible.sort();
                Some(eligible.into_iter().take(n).map(|e| e.2).collect())
            }
            Policy::Arc(_) => None,
        };
        let evicted = match &mut self.policy {
            Policy::Lru(p) => {
                let guard = p.protect(pks.iter().copied());
                p.evict(n, &guard, &SelfCounted)
            }
            Policy::Arc(p) => {
                let guard = p.protect(pks.iter().copied());
                p.evict(n, &guard, &SelfCounted)
            }
        };
        let Some(evicted) = evicted else {
            if self.snapshot() != before {
                return Err("a failed eviction changed the policy".into());
            }
            if let Some(expected) = expected {
                if expected.len() == n {
                    return Err(format!(
                        "eviction of {n} failed with {} eligible",
                        expected.len()
                    ));
                }
            }
            return Ok(());
        };
        if evicted.len() != n {
            return Err(format!("asked for {n} victims, got {}", evicted.len()));
        }
        for e in &evicted {
            let k = e.key.as_slice()[0];
            if protected.contains(&k) {
                return Err(format!("evicted protected key {k}"));
            }
            if e.chunk.ref_cnt.get() != 0 {
                return Err(format!(
                    "evicted key {k} with ref_cnt {}",
                    e.chunk.ref_cnt.get()
                ));
            }
            if self.chunks.remove(&k).map(|c| c.id) != Some(e.chunk.id) {
                return Err(format!("evicted key {k} with a chunk it did not hold"));
            }
        }
        if let Some(expected) = expected {
            let got: Vec<Vec<u8>> = evicted.iter().map(|e| e.key.as_slice().to_vec()).collect();
            if got != expected {
                return Err(format!("LRU victims {got:?}, expected {expected:?}"));
            }
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), String> {
        let resident = match &self.policy {
            Policy::Lru(p) => {
                p.validate()?;
                p.len()
            }
            Policy::Arc(p) => {
                p.validate(&SelfCounted)?;
                p.len()
            }
        };
        if resident != self.chunks.len() {
            return Err(format!(
                "policy holds {resident} chunks, the model {}",
                self.chunks.len()
            ));
        }
        for (k, chunk) in &self.chunks {
            let kb = bytes(*k);
            let got = match &self.policy {
                Policy::Lru(p) => p.get(p.key(&kb)).map(|c| c.id),
                Policy::Arc(p) => p.get(p.key(&kb)).map(|c| c.id),
            };
            if got != Some(chunk.id) {
                return Err(format!("get({k}) = {got:?}, expected chunk {}", chunk.id));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod proptests {
    use proptest::prelude::*;

    use super::*;

    fn key() -> impl Strategy<Value = u8> {
        0..KEYS
    }

    fn keys() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(key(), 0..6)
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (key(), prop::option::of((0..4u8, 0..8i64))).prop_map(|(key, request)| Op::Insert { key, request }),
            3 => (key(), prop::bool::weighted(0.85)).prop_map(|(key, ok)| Op::FinishStore { key, ok }),
            2 => (key(), any::<bool>()).prop_map(|(key, load)| Op::Pin { key, load }),
            2 => keys().prop_map(|keys| Op::Touch { keys }),
            1 => keys().prop_map(|keys| Op::StoreMiss { keys }),
            2 => (0..4u8, prop::collection::vec((key(), 0..8i64), 0..6)).prop_map(|(request, keys)| Op::Access { request, keys }),
            2 => (keys(), keys()).prop_map(|(keys, access)| Op::Finish { keys, access }),
            3 => (0..5u8, keys()).prop_map(|(n, protected)| Op::Evict { n, protected }),
            1 => (0..4u8).prop_map(|request| Op::EndRequest { request }),
            1 => Just(Op::Clear),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn lru_keeps_its_invariants(capacity in 1usize..8, ops in prop::collection::vec(op(), 1..120)) {
            let mut h = Harness::lru(capacity);
            for op in &ops {
                h.apply(op).map_err(|e| TestCaseError::fail(format!("{op:?}: {e}")))?;
            }
        }

        #[test]
        fn arc_keeps_its_invariants(capacity in 1usize..8, ops in prop::collection::vec(op(), 1..120)) {
            let mut h = Harness::arc(capacity);
            for op in &ops {
                h.apply(op).map_err(|e| TestCaseError::fail(format!("{op:?}: {e}")))?;
            }
        }
    }

    #[test]
    fn decoded_fuzz_programs_run_clean() {
        // A deterministic sweep of byte programs, as the fuzzer would feed them.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..300 {
            let bytes: Vec<u8> = (0..200)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect();
            for mut h in [Harness::lru(3), Harness::arc(3)] {
                for op in Op::decode(&bytes) {
                    h.apply(&op).unwrap_or_else(|e| panic!("{op:?}: {e}"));
                }
            }
        }
    }
}
