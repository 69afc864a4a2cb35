//! The policy harness: [`PolicyProgram`]s of manager-shaped calls on one policy, checked
//! after each.

use std::collections::HashMap;

use arbitrary::{Arbitrary, Unstructured};

use super::{hint, ops, run_listed, Program};
use crate::chunk::{SelfCounted, TestChunk};
use crate::manager::VllmSemantics;
use crate::policy::{Access, Policy, PolicyExt};
use crate::retention::RetentionHint;
use crate::Key;

/// Policy keys are `[k]` for k in `0..KEYS`.
pub const KEYS: u8 = 12;
/// Request contexts a policy program uses.
const REQUESTS: usize = 4;
/// The last request a policy program names.
const LAST_REQUEST: u8 = 3;
const _: () = assert!(LAST_REQUEST as usize + 1 == REQUESTS);

/// A key of the small universe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct K(pub u8);

impl<'a> Arbitrary<'a> for K {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(K(u.int_in_range(0..=KEYS - 1)?))
    }
}

/// Up to five keys.
fn keys(u: &mut Unstructured<'_>) -> arbitrary::Result<Vec<K>> {
    let n = u.int_in_range(0..=5)?;
    (0..n).map(|_| u.arbitrary()).collect()
}

#[derive(Clone, Debug)]
pub enum PolicyOp {
    /// Insert a pending chunk (ref_cnt −1), for request `r` at position `pos` when given.
    Insert {
        key: K,
        request: Option<(u8, i64)>,
    },
    /// The store completed (−1 → 0, mark_evictable) or failed (remove).
    FinishStore {
        key: K,
        ok: bool,
    },
    /// A load pins (0 → 1 … mark_non_evictable) or unpins a ready chunk.
    Pin {
        key: K,
        load: bool,
    },
    Touch {
        keys: Vec<K>,
    },
    /// Store misses, with the default `on_store_miss` of one vLLM release.
    StoreMiss {
        keys: Vec<K>,
        semantics: VllmSemantics,
    },
    Access {
        request: u8,
        keys: Vec<(K, i64)>,
    },
    Finish {
        request: u8,
        keys: Vec<K>,
        access: Vec<K>,
    },
    /// The request's retention hint.
    Hint {
        request: u8,
        hint: RetentionHint,
    },
    Evict {
        n: u8,
        protected: Vec<K>,
    },
    /// The request's context dies.
    EndRequest {
        request: u8,
    },
    Clear,
}

impl<'a> Arbitrary<'a> for PolicyOp {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let request = |u: &mut Unstructured<'_>| u.int_in_range(0..=LAST_REQUEST);
        Ok(match u.int_in_range(0..=21)? {
            0..=3 => PolicyOp::Insert {
                key: u.arbitrary()?,
                request: if u.arbitrary()? {
                    Some((request(u)?, u.int_in_range(0..=7)?))
                } else {
                    None
                },
            },
            4..=6 => PolicyOp::FinishStore {
                key: u.arbitrary()?,
                ok: u.ratio(17, 20)?,
            },
            7..=8 => PolicyOp::Pin {
                key: u.arbitrary()?,
                load: u.arbitrary()?,
            },
            9..=10 => PolicyOp::Touch { keys: keys(u)? },
            11 => PolicyOp::StoreMiss {
                keys: keys(u)?,
                semantics: *u.choose(&VllmSemantics::ALL)?,
            },
            12..=13 => PolicyOp::Access {
                request: request(u)?,
                keys: keys(u)?
                    .into_iter()
                    .map(|k| Ok((k, u.int_in_range(0..=7)?)))
                    .collect::<arbitrary::Result<_>>()?,
            },
            14..=15 => PolicyOp::Finish {
                request: request(u)?,
                keys: keys(u)?,
                access: keys(u)?,
            },
            16..=18 => PolicyOp::Evict {
                n: u.int_in_range(0..=4)?,
                protected: keys(u)?,
            },
            19 => PolicyOp::EndRequest {
                request: request(u)?,
            },
            20 => PolicyOp::Hint {
                request: request(u)?,
                hint: hint(u)?,
            },
            _ => PolicyOp::Clear,
        })
    }
}

/// A policy capacity and the operations to apply.
#[derive(Clone, Debug)]
pub struct PolicyProgram {
    pub capacity: usize,
    pub ops: Vec<PolicyOp>,
}

impl<'a> Arbitrary<'a> for PolicyProgram {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(PolicyProgram {
            capacity: u.int_in_range(1..=8)?,
            ops: ops(u)?,
        })
    }
}

impl PolicyProgram {
    /// The program these bytes decode to (every byte string decodes to one).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        Self::arbitrary_take_rest(Unstructured::new(bytes)).unwrap_or(PolicyProgram {
            capacity: 1,
            ops: Vec::new(),
        })
    }

    /// Runs the program on a fresh policy of type `P`; `Err` names the op and the violation.
    pub fn run<P: Policy<TestChunk>>(&self) -> Result<(), String> {
        self.run_from::<P>(|_| {})
    }

    /// Runs the program on a fresh policy of type `P` that `setup` first puts in a state the
    /// program alone would not reach.
    pub fn run_from<P: Policy<TestChunk>>(&self, setup: impl FnOnce(&mut P)) -> Result<(), String> {
        let mut h = PolicyHarness::<P>::new(self.capacity);
        setup(h.policy_mut());
        for op in &self.ops {
            h.apply(op).map_err(|e| format!("{op:?}: {e}"))?;
        }
        Ok(())
    }

    /// Runs the program on every policy of [`crate::for_each_policy!`], on the states of LRU and
    /// turn that short programs do not reach (every group indexed; tails judged dead), and on
    /// the offline [`BeladyPolicy`](crate::BeladyPolicy); `Err` names the policy.
    pub fn run_every_policy(&self) -> Result<(), String> {
        run_listed(self)?;
        // A walk limit of 0 indexes every group as soon as an insertion lands mid-group.
        self.run_from::<crate::LruPolicy<TestChunk>>(|p| p.set_walk_limit(0))
            .map_err(|e| format!("lru, every group indexed: {e}"))?;
        self.run_from::<crate::TurnPolicy<TestChunk>>(crate::TurnPolicy::start_with_dead_tails)
            .map_err(|e| format!("turn, tails dead: {e}"))?;
        self.run::<crate::BeladyPolicy<TestChunk>>()
            .map_err(|e| format!("belady: {e}"))
    }
}

impl Program for PolicyProgram {
    type Chunk = TestChunk;

    fn run<P: Policy<TestChunk>>(&self) -> Result<(), String> {
        PolicyProgram::run::<P>(self)
    }
}

/// Drives one policy with [`PolicyOp`]s and checks it after each.
pub struct PolicyHarness<P: Policy<TestChunk>> {
    policy: P,
    chunks: HashMap<u8, TestChunk>,
    requests: [P::Request; REQUESTS],
    next_id: u64,
}

impl<P: Policy<TestChunk>> PolicyHarness<P> {
    pub fn new(capacity: usize) -> Self {
        PolicyHarness {
            policy: P::new(capacity),
            chunks: HashMap::new(),
            requests: std::array::from_fn(|_| P::Request::default()),
            next_id: 0,
        }
    }

    pub fn policy_mut(&mut self) -> &mut P {
        &mut self.policy
    }

    fn snapshot(&self) -> String {
        format!("{:?}", self.policy.inspect())
    }

    /// Applies `op`; `Err` describes the first violated property.
    pub fn apply(&mut self, op: &PolicyOp) -> Result<(), String> {
        let p = &mut self.policy;
        match op {
            PolicyOp::Insert { key, request } => {
                if self.chunks.contains_key(&key.0) {
                    let before = format!("{:?}", p.inspect());
                    let kb = [key.0];
                    let k = p.key(&kb);
                    let dup = p.insert_key(&mut P::Request::default(), k, chunk(0, 0), None, true);
                    if dup.is_ok() || self.snapshot() != before {
                        return Err("a duplicate insert was accepted or changed state".into());
                    }
                    return self.validate();
                }
                self.next_id += 1;
                let c = chunk(self.next_id, -1);
                let kb = [key.0];
                let k = p.key(&kb);
                let mut none = P::Request::default();
                let (req, pos) = match request {
                    Some((r, pos)) => (&mut self.requests[usize::from(*r)], Some(*pos)),
                    None => (&mut none, None),
                };
                p.insert_key(req, k, c.clone(), pos, false)
                    .map_err(|e| e.to_string())?;
                self.chunks.insert(key.0, c);
            }
            PolicyOp::FinishStore { key, ok } => {
                let kb = [key.0];
                let k = p.key(&kb);
                let Some(c) = self.chunks.get(&key.0).filter(|c| c.ref_cnt.get() == -1) else {
                    if !self.chunks.contains_key(&key.0) {
                        let before = format!("{:?}", p.inspect());
                        if p.remove_key(k).is_ok() || p.mark_evictable(k).is_ok() {
                            return Err("a call on an absent key succeeded".into());
                        }
                        if self.snapshot() != before {
                            return Err("a refused call changed state".into());
                        }
                    }
                    return self.validate();
                };
                if *ok {
                    c.set(0);
                    p.mark_evictable(k).map_err(|e| e.to_string())?;
                } else {
                    p.remove_key(k).map_err(|e| e.to_string())?;
                    self.chunks.remove(&key.0);
                }
            }
            PolicyOp::Pin { key, load } => {
                let Some(c) = self.chunks.get(&key.0) else {
                    return self.validate();
                };
                let cnt = c.ref_cnt.get();
                let kb = [key.0];
                let k = p.key(&kb);
                if *load && cnt >= 0 {
                    if cnt == 0 {
                        p.mark_non_evictable(k).map_err(|e| e.to_string())?;
                    }
                    c.set(cnt + 1);
                } else if !*load && cnt > 0 {
                    c.set(cnt - 1);
                    if cnt == 1 {
                        p.mark_evictable(k).map_err(|e| e.to_string())?;
                    }
                }
            }
            PolicyOp::Touch { keys } | PolicyOp::StoreMiss { keys, .. } => {
                let raw: Vec<[u8; 1]> = keys.iter().map(|k| [k.0]).collect();
                let ks: Vec<Key<'_>> = raw.iter().map(|k| p.key(k)).collect();
                if let PolicyOp::StoreMiss { semantics, .. } = op {
                    p.on_store_miss_keys(&ks, &SelfCounted, *semantics);
                } else {
                    p.touch_keys(&ks, &SelfCounted);
                }
            }
            PolicyOp::Access { request, keys } => {
                let raw: Vec<[u8; 1]> = keys.iter().map(|(k, _)| [k.0]).collect();
                let entries: Vec<_> = raw
                    .iter()
                    .zip(keys)
                    .map(|(kb, &(_, pos))| {
                        let key = p.key(kb);
                        crate::Observed {
                            key,
                            id: p.find_resident(key),
                            position: Some(pos),
                        }
                    })
                    .collect();
                p.on_request_access(&mut self.requests[usize::from(*request)], &entries);
            }
            PolicyOp::Hint { request, hint } => {
                p.on_request_hint(&mut self.requests[usize::from(*request)], *hint);
            }
            PolicyOp::Finish {
                request,
                keys,
                access,
            } => {
                let raw: Vec<[u8; 1]> = keys.iter().map(|k| [k.0]).collect();
                let ks: Vec<Key<'_>> = raw.iter().map(|k| p.key(k)).collect();
                let ids = p.find_many(&ks);
                let accesses: Vec<_> = keys
                    .iter()
                    .zip(ids)
                    .map(|(k, id)| {
                        let kind = match access.iter().position(|a| a == k).map(|i| i % 2) {
                            Some(0) => Access::InsertionOnly,
                            Some(_) => Access::Reused,
                            None => Access::Other,
                        };
                        (id, kind)
                    })
                    .collect();
                p.on_request_finished(&mut self.requests[usize::from(*request)], &accesses);
            }
            PolicyOp::Evict { n, protected } => self.evict(usize::from(*n), protected)?,
            PolicyOp::EndRequest { request } => {
                let state = std::mem::take(&mut self.requests[usize::from(*request)]);
                p.release_request(state);
            }
            PolicyOp::Clear => {
                p.clear();
                self.chunks.clear();
            }
        }
        self.validate()
    }

    fn evict(&mut self, n: usize, protected: &[K]) -> Result<(), String> {
        let before = self.snapshot();
        let is_protected = |k: u8| protected.iter().any(|p| p.0 == k);
        let raw: Vec<[u8; 1]> = protected.iter().map(|k| [k.0]).collect();
        let guard = self
            .policy
            .protect(raw.iter().map(|k| Key::new(self.policy.hasher(), k)));
        // For a ranking policy, the expected victims: eligible keys in ascending
        // (rank, -position, key).
        let expected: Option<Vec<Vec<u8>>> = self.policy.inspect().ranks.map(|ranks| {
            let mut eligible: Vec<_> = ranks
                .into_iter()
                .filter(|e| {
                    e.evictable
                        && !is_protected(e.key[0])
                        && self.chunks[&e.key[0]].ref_cnt.get() == 0
                })
                .map(|e| (e.rank, std::cmp::Reverse(e.position), e.key.to_vec()))
                .collect();
            eligible.sort();
            eligible.into_iter().take(n).map(|e| e.2).collect()
        });
        let Some(evicted) = self.policy.evict(n, &guard, &SelfCounted) else {
            if self.snapshot() != before {
                return Err("a failed eviction changed the policy".into());
            }
            if expected.is_some_and(|e| e.len() == n) {
                return Err(format!("eviction of {n} failed with {n} eligible"));
            }
            return Ok(());
        };
        if evicted.len() != n {
            return Err(format!("asked for {n} victims, got {}", evicted.len()));
        }
        for e in &evicted {
            let k = e.key.as_slice()[0];
            if is_protected(k) {
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
                return Err(format!("victims {got:?}, expected {expected:?}"));
            }
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), String> {
        self.policy.validate()?;
        if self.policy.len() != self.chunks.len() {
            return Err(format!(
                "policy holds {} chunks, the model {}",
                self.policy.len(),
                self.chunks.len()
            ));
        }
        for (k, c) in &self.chunks {
            let got = self.policy.get(self.policy.key(&[*k])).map(|c| c.id);
            if got != Some(c.id) {
                return Err(format!("get({k}) = {got:?}, expected chunk {}", c.id));
            }
        }
        Ok(())
    }
}

fn chunk(id: u64, ref_cnt: i32) -> TestChunk {
    TestChunk::new(id, ref_cnt)
}
