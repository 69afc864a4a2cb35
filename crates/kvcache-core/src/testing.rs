//! Model-checking harnesses shared by the property tests and the fuzz targets.
//!
//! One generator makes the operation sequences for both: [`PolicyProgram`] and
//! [`ManagerProgram`] implement [`arbitrary::Arbitrary`], so proptest feeds them random bytes
//! (`from_bytes`) and cargo-fuzz feeds them its corpus, through the same code.
//!
//! [`PolicyHarness`] drives any [`Policy`] with manager-shaped calls (keys from a small universe
//! so they collide, reference counts changed only through the manager's transitions) and then
//! checks: `validate()`; the policy holds exactly the model's chunks; every evicted entry was
//! resident, idle and unprotected; a failed eviction or a refused call changed nothing; victims
//! of a ranking policy (LRU) are the smallest eligible ranks. [`ManagerHarness`] drives a
//! [`Manager`] through requests (lookups, loads, stores, completions, finishes, releases,
//! resets) with `validate()` after every step and the same "an error changes nothing" check.

use std::collections::HashMap;

use arbitrary::{Arbitrary, Unstructured};

use crate::chunk::{SelfCounted, TestChunk};
use crate::manager::{ChunkId, LookupResult, Manager, ManagerConfig, VllmSemantics};
use crate::policy::{Access, Policy, PolicyExt};
use crate::registry::RequestToken;
use crate::retention::RetentionHint;
use crate::Key;

/// Policy keys are `[k]` for k in `0..KEYS`.
pub const KEYS: u8 = 12;
/// Request contexts a policy program uses.
const REQUESTS: usize = 4;
/// The last request a policy program names.
const LAST_REQUEST: u8 = 3;
const _: () = assert!(LAST_REQUEST as usize + 1 == REQUESTS);
/// Distinct keys a manager program uses.
const MANAGER_KEYS: u8 = 24;

/// A key of the small universe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct K(pub u8);

impl<'a> Arbitrary<'a> for K {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(K(u.int_in_range(0..=KEYS - 1)?))
    }
}

/// Operations until the input runs out (a program is the whole input).
fn ops<'a, T: Arbitrary<'a>>(u: &mut Unstructured<'a>) -> arbitrary::Result<Vec<T>> {
    let mut ops = Vec::new();
    while !u.is_empty() {
        ops.push(u.arbitrary()?);
    }
    Ok(ops)
}

/// Either retention hint.
fn hint(u: &mut Unstructured<'_>) -> arbitrary::Result<RetentionHint> {
    Ok(*u.choose(&[RetentionHint::Continues, RetentionHint::Ends])?)
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
        macro_rules! run_all {
            ($($(#[$doc:meta])* $module:ident::$policy:ident as $kind:ident = $class:literal;)*) => {
                $(
                    self.run::<crate::$policy<TestChunk>>().map_err(|e| {
                        format!("{}: {e}", <crate::$policy<TestChunk> as Policy<TestChunk>>::NAME)
                    })?;
                )*
            };
        }
        crate::for_each_policy!(run_all);
        // A walk limit of 0 indexes every group as soon as an insertion lands mid-group.
        self.run_from::<crate::LruPolicy<TestChunk>>(|p| p.set_walk_limit(0))
            .map_err(|e| format!("lru, every group indexed: {e}"))?;
        self.run_from::<crate::TurnPolicy<TestChunk>>(crate::TurnPolicy::start_with_dead_tails)
            .map_err(|e| format!("turn, tails dead: {e}"))?;
        self.run::<crate::BeladyPolicy<TestChunk>>()
            .map_err(|e| format!("belady: {e}"))
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

#[derive(Clone, Debug)]
pub enum ManagerOp {
    /// A request arrives, with its retention hint (given right after its state is made).
    NewRequest {
        hint: Option<RetentionHint>,
    },
    /// A request arrives with a retention hint its caller could not read (and ignored).
    IgnoredHint,
    /// Take the stats: the hint counts must be those of the hints given since the last take.
    TakeStats,
    /// Look up the request's keys, load the hit prefix and offer the rest for storing.
    Step {
        req: usize,
        keys: Vec<u8>,
    },
    CompleteLoad {
        req: usize,
    },
    /// Complete a request's pending stores; `twice` names every key two times.
    CompleteStore {
        req: usize,
        success: bool,
        twice: bool,
    },
    Finish {
        req: usize,
    },
    Release {
        req: usize,
    },
    Touch {
        keys: Vec<u8>,
    },
    /// An offline caller's next-use hints (the bound's policy reads them; others ignore them).
    Hint {
        keys: Vec<u8>,
        next: u8,
    },
    Reset,
    /// Take the events; with `requeue`, put them back and check the next take returns them.
    TakeEvents {
        requeue: bool,
    },
    /// vLLM 0.34's primary tier: pin keys for a secondary tier's read (a cascade).
    ReadForTier {
        keys: Vec<u8>,
    },
    /// Unpin every outstanding tier read.
    CompleteReads,
    /// A failed promotion: defer the release of a request's pending stores.
    DeferWrites {
        req: usize,
    },
    /// The tier lets go of the first `count` deferred chunks (and an id never deferred is
    /// refused).
    ReleaseDeferred {
        count: u8,
    },
}

impl<'a> Arbitrary<'a> for ManagerOp {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let req = |u: &mut Unstructured<'_>| u.int_in_range(0..=3usize);
        let keys = |u: &mut Unstructured<'_>| -> arbitrary::Result<Vec<u8>> {
            let n = u.int_in_range(0..=7)?;
            (0..n)
                .map(|_| u.int_in_range(0..=MANAGER_KEYS - 1))
                .collect()
        };
        Ok(match u.int_in_range(0..=22)? {
            0 => ManagerOp::NewRequest {
                // Half the requests carry a hint, as on traffic from a hinting application.
                hint: if u.arbitrary()? { Some(hint(u)?) } else { None },
            },
            1..=4 => ManagerOp::Step {
                req: req(u)?,
                keys: keys(u)?,
            },
            5..=6 => ManagerOp::CompleteLoad { req: req(u)? },
            7..=9 => ManagerOp::CompleteStore {
                req: req(u)?,
                success: u.ratio(4, 5)?,
                twice: u.ratio(1, 10)?,
            },
            10..=11 => ManagerOp::Finish { req: req(u)? },
            12 => ManagerOp::Release { req: req(u)? },
            13 => ManagerOp::Touch { keys: keys(u)? },
            14 => ManagerOp::Reset,
            15 => ManagerOp::Hint {
                keys: keys(u)?,
                next: u.arbitrary()?,
            },
            16 => ManagerOp::TakeEvents {
                requeue: u.ratio(1, 3)?,
            },
            17 => ManagerOp::ReadForTier { keys: keys(u)? },
            18 => ManagerOp::CompleteReads,
            19 => ManagerOp::DeferWrites { req: req(u)? },
            20 => ManagerOp::ReleaseDeferred {
                count: u.int_in_range(0..=4)?,
            },
            21 => ManagerOp::IgnoredHint,
            _ => ManagerOp::TakeStats,
        })
    }
}

/// A manager configuration and the operations to apply.
#[derive(Clone, Debug)]
pub struct ManagerProgram {
    pub num_chunks: usize,
    pub store_threshold: i64,
    pub semantics: VllmSemantics,
    pub ops: Vec<ManagerOp>,
}

impl<'a> Arbitrary<'a> for ManagerProgram {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(ManagerProgram {
            num_chunks: u.int_in_range(1..=11)?,
            store_threshold: u.int_in_range(1..=2)?,
            semantics: *u.choose(&VllmSemantics::ALL)?,
            ops: ops(u)?,
        })
    }
}

impl ManagerProgram {
    /// The program these bytes decode to (every byte string decodes to one).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        Self::arbitrary_take_rest(Unstructured::new(bytes)).unwrap_or(ManagerProgram {
            num_chunks: 1,
            store_threshold: 1,
            semantics: VllmSemantics::default(),
            ops: Vec::new(),
        })
    }

    /// Runs the program on a fresh manager over policy `P`.
    pub fn run<P: Policy<ChunkId>>(&self) -> Result<(), String> {
        let mut h = ManagerHarness::<P>::new(self.num_chunks, self.store_threshold, self.semantics);
        for op in &self.ops {
            h.apply(op).map_err(|e| format!("{op:?}: {e}"))?;
        }
        Ok(())
    }

    /// Runs the program on a manager over every policy of [`crate::for_each_policy!`] and the
    /// replay's offline [`BeladyPolicy`](crate::BeladyPolicy); `Err`
    /// names the policy.
    pub fn run_every_policy(&self) -> Result<(), String> {
        macro_rules! run_all {
            ($($(#[$doc:meta])* $module:ident::$policy:ident as $kind:ident = $class:literal;)*) => {
                $(
                    self.run::<crate::$policy<ChunkId>>().map_err(|e| {
                        format!("{}: {e}", <crate::$policy<ChunkId> as Policy<ChunkId>>::NAME)
                    })?;
                )*
            };
        }
        crate::for_each_policy!(run_all);
        self.run::<crate::BeladyPolicy<ChunkId>>()
            .map_err(|e| format!("belady: {e}"))
    }
}

/// A manager key: 32 bytes of `k` and a 4-byte KV-cache group (two groups).
pub fn manager_key(k: u8) -> Vec<u8> {
    let mut b = vec![k; 32];
    b.extend_from_slice(&u32::from(k % 2).to_be_bytes());
    b
}

struct Req {
    token: RequestToken,
    /// The hint its caller gives whenever the manager asks (a new state after a reset asks
    /// again, as the bindings read the request's context again).
    hint: Option<RetentionHint>,
    loads: Vec<Vec<u8>>,
    stores: Vec<Vec<u8>>,
}

/// Hints given and ignored since the last `take_stats`, as the manager must count them.
#[derive(Default)]
struct HintTally {
    hinted: u64,
    ignored: u64,
}

/// Drives a [`Manager`] with [`ManagerOp`]s and validates it after each.
pub struct ManagerHarness<P: Policy<ChunkId>> {
    m: Manager<P>,
    reqs: Vec<Req>,
    /// Keys pinned by secondary-tier reads, and chunks whose release is deferred.
    reads: Vec<Vec<u8>>,
    deferred: Vec<i64>,
    tally: HintTally,
}

impl<P: Policy<ChunkId>> ManagerHarness<P> {
    pub fn new(num_chunks: usize, store_threshold: i64, semantics: VllmSemantics) -> Self {
        let m = Manager::new(ManagerConfig {
            num_chunks,
            enable_events: true,
            store_threshold,
            max_tracker_size: 16,
            semantics,
        })
        .expect("a small manager");
        ManagerHarness {
            m,
            reqs: Vec::new(),
            reads: Vec::new(),
            deferred: Vec::new(),
            tally: HintTally::default(),
        }
    }

    /// Gives a request whose state was just made its hint, as the bindings do, and checks the
    /// manager takes it once.
    fn give_hint(
        &mut self,
        token: RequestToken,
        hint: Option<RetentionHint>,
    ) -> Result<(), String> {
        if !self.m.wants_retention_hint(token) {
            return Ok(());
        }
        self.m.set_retention_hint(token, hint);
        self.tally.hinted += u64::from(hint.is_some());
        if self.m.wants_retention_hint(token) {
            return Err("a request still waits for the hint it was given".into());
        }
        // A second hint changes nothing (the count included).
        let before = self.snapshot();
        self.m
            .set_retention_hint(token, Some(RetentionHint::Continues));
        if self.snapshot() != before {
            return Err("a request took a second hint".into());
        }
        Ok(())
    }

    fn new_request(&mut self, hint: Option<RetentionHint>) -> Result<(), String> {
        let token = self.m.request(None);
        self.give_hint(token, hint)?;
        self.reqs.push(Req {
            token,
            hint,
            loads: Vec::new(),
            stores: Vec::new(),
        });
        Ok(())
    }

    /// Everything a refused call must leave as it was.
    fn snapshot(&self) -> String {
        let table: Vec<_> = self
            .m
            .table()
            .records()
            .iter()
            .map(|r| (r.chunk_id(), r.ref_cnt()))
            .collect();
        format!(
            "{:?} {table:?} {:?} {} {} {}",
            self.m.policy().inspect(),
            self.m.table().free_list(),
            self.m.num_evictable(),
            self.m.num_write_pending(),
            self.m.num_requests(),
        )
    }

    pub fn apply(&mut self, op: &ManagerOp) -> Result<(), String> {
        let m = &mut self.m;
        match op {
            ManagerOp::NewRequest { hint } => self.new_request(*hint)?,
            ManagerOp::IgnoredHint => {
                m.note_ignored_hint();
                self.tally.ignored += 1;
                self.new_request(None)?;
            }
            ManagerOp::TakeStats => {
                let stats = m.take_stats();
                let tally = std::mem::take(&mut self.tally);
                if (stats.hinted_requests, stats.ignored_hints) != (tally.hinted, tally.ignored) {
                    return Err(format!(
                        "stats count {} hinted requests and {} ignored hints, {} and {} were given",
                        stats.hinted_requests, stats.ignored_hints, tally.hinted, tally.ignored
                    ));
                }
                if P::NAME != "turn" && stats.hint_kept_hits != 0 {
                    return Err(format!("{} counted hint-kept hits", P::NAME));
                }
            }
            ManagerOp::Step { req, keys } => {
                let Some(r) = self.reqs.get_mut(*req) else {
                    return self.validate();
                };
                r.token = m.request(Some(r.token));
                let (token, hint) = (r.token, r.hint);
                self.give_hint(token, hint)?;
                let m = &mut self.m;
                let mut bytes: Vec<Vec<u8>> = Vec::new();
                for &k in keys {
                    let b = manager_key(k);
                    if !bytes.contains(&b) {
                        bytes.push(b);
                    }
                }
                let ks: Vec<Key<'_>> = bytes.iter().map(|b| m.key(b)).collect();
                let pos: Vec<Option<i64>> = (1..=ks.len())
                    .map(|j| Some(16 * i64::try_from(j).expect("few keys")))
                    .collect();
                let hits = ks
                    .iter()
                    .take_while(|&&k| m.lookup(k) == LookupResult::Hit)
                    .count();
                // Calls may be refused (the request finished, its state is stale); a refused
                // call must change nothing.
                if hits > 0 {
                    let before = self.snapshot();
                    let r = &mut self.reqs[*req];
                    let mut observed = Vec::new();
                    match self
                        .m
                        .prepare_load(r.token, &ks[..hits], &pos[..hits], &mut observed)
                    {
                        Ok(ids) if ids.len() != hits => {
                            return Err(format!("{} chunk ids for {hits} loads", ids.len()));
                        }
                        Ok(_) => r.loads.extend(bytes[..hits].iter().cloned()),
                        Err(_) if self.snapshot() != before => {
                            return Err("a refused prepare_load changed state".into());
                        }
                        Err(_) => {}
                    }
                }
                if hits < ks.len() {
                    let before = self.snapshot();
                    let r = &mut self.reqs[*req];
                    let mut observed = Vec::new();
                    match self
                        .m
                        .prepare_store(r.token, &ks[hits..], &pos[hits..], &mut observed)
                    {
                        Ok(Some(out)) if out.stored.len() != out.chunk_ids.len() => {
                            return Err("stored keys and chunk ids differ in number".into());
                        }
                        Ok(Some(out)) => r
                            .stores
                            .extend(out.stored.iter().map(|&i| bytes[hits + i].clone())),
                        Ok(None) => {}
                        Err(_) if self.snapshot() != before => {
                            return Err("a refused prepare_store changed state".into());
                        }
                        Err(_) => {}
                    }
                }
                // Offering a key twice is refused, and changes nothing.
                if let Some(first) = ks.first() {
                    let before = self.snapshot();
                    let m = &mut self.m;
                    let r = &self.reqs[*req];
                    let twice = [*first, *first];
                    if m.prepare_store(r.token, &twice, &[None, None], &mut Vec::new())
                        .is_ok()
                    {
                        return Err("an offer naming a key twice was accepted".into());
                    }
                    if self.snapshot() != before {
                        return Err("a refused prepare_store changed state".into());
                    }
                }
            }
            ManagerOp::CompleteLoad { req } => {
                let Some(r) = self.reqs.get_mut(*req) else {
                    return self.validate();
                };
                let loads = std::mem::take(&mut r.loads);
                let ks: Vec<Key<'_>> = loads.iter().map(|b| m.key(b)).collect();
                let before = self.snapshot();
                // Loads of a reset cache are gone: an error, and nothing changes.
                if self.m.complete_load(&ks).is_err() && self.snapshot() != before {
                    return Err("a failed complete_load changed state".into());
                }
            }
            ManagerOp::CompleteStore {
                req,
                success,
                twice,
            } => {
                let Some(r) = self.reqs.get_mut(*req) else {
                    return self.validate();
                };
                let mut stores = std::mem::take(&mut r.stores);
                if *twice {
                    stores.extend(stores.clone());
                }
                let ks: Vec<Key<'_>> = stores.iter().map(|b| m.key(b)).collect();
                m.complete_store(&ks, *success);
            }
            ManagerOp::Finish { req } => {
                let Some(r) = self.reqs.get(*req) else {
                    return self.validate();
                };
                let n = m.unfinished_request_len(r.token).unwrap_or(0);
                let positions: Vec<Option<i64>> = (1..).map(|i| Some(16 * i)).take(n).collect();
                m.finish_request(r.token, &positions);
            }
            ManagerOp::Release { req } => {
                if *req < self.reqs.len() {
                    let r = self.reqs.remove(*req);
                    m.release_request(r.token);
                }
            }
            ManagerOp::Touch { keys } => {
                let bytes: Vec<Vec<u8>> = keys.iter().map(|&k| manager_key(k)).collect();
                let ks: Vec<Key<'_>> = bytes.iter().map(|b| m.key(b)).collect();
                let before = self.snapshot();
                let has_touch = self.m.config().semantics.has_touch();
                match self.m.touch(&ks) {
                    Ok(()) if !has_touch => {
                        return Err("touch ran under a release without touch".into());
                    }
                    Err(_) if has_touch => return Err("touch was refused".into()),
                    Err(_) if self.snapshot() != before => {
                        return Err("a refused touch changed state".into());
                    }
                    _ => {}
                }
            }
            ManagerOp::Hint { keys, next } => {
                let bytes: Vec<Vec<u8>> = keys.iter().map(|&k| manager_key(k)).collect();
                let ks: Vec<Key<'_>> = bytes.iter().map(|b| m.key(b)).collect();
                // 255 stands for "never used again".
                let next = if *next == u8::MAX {
                    u64::MAX
                } else {
                    u64::from(*next)
                };
                m.hint_next_uses(&ks, &vec![next; ks.len()]);
            }
            ManagerOp::Reset => {
                let before = self.snapshot();
                match self.m.try_reset() {
                    Ok(()) if !self.deferred.is_empty() => {
                        return Err("reset accepted with deferred chunks".into());
                    }
                    Ok(()) => {
                        for r in &mut self.reqs {
                            r.loads.clear();
                            r.stores.clear();
                        }
                        self.reads.clear();
                    }
                    Err(_) if self.deferred.is_empty() => return Err("reset refused".into()),
                    Err(_) if self.snapshot() != before => {
                        return Err("a refused reset changed state".into());
                    }
                    Err(_) => {}
                }
            }
            ManagerOp::ReadForTier { keys } => {
                let bytes: Vec<Vec<u8>> = keys.iter().map(|&k| manager_key(k)).collect();
                let ks: Vec<Key<'_>> = bytes.iter().map(|b| m.key(b)).collect();
                let before = self.snapshot();
                let requests = self.m.num_requests();
                match self.m.prepare_read(&ks) {
                    Ok(ids) if ids.len() != ks.len() => {
                        return Err(format!("{} chunk ids for {} reads", ids.len(), ks.len()));
                    }
                    Ok(_) => self.reads.extend(bytes),
                    Err(_) if self.snapshot() != before => {
                        return Err("a refused prepare_read changed state".into());
                    }
                    Err(_) => {}
                }
                if self.m.num_requests() != requests {
                    return Err("a tier read touched request state".into());
                }
            }
            ManagerOp::CompleteReads => {
                let reads = std::mem::take(&mut self.reads);
                let ks: Vec<Key<'_>> = reads.iter().map(|b| m.key(b)).collect();
                m.complete_load(&ks)
                    .map_err(|e| format!("complete_load of tier reads: {e}"))?;
            }
            ManagerOp::DeferWrites { req } => {
                let Some(r) = self.reqs.get_mut(*req) else {
                    return self.validate();
                };
                let mut stores = std::mem::take(&mut r.stores);
                stores.dedup();
                let ks: Vec<Key<'_>> = stores.iter().map(|b| m.key(b)).collect();
                let before = self.snapshot();
                match self.m.defer_write_release(&ks) {
                    Ok(ids) => {
                        self.deferred.extend(ids.into_iter().map(i64::from));
                        for k in &ks {
                            if self.m.lookup(*k) != LookupResult::Miss {
                                return Err("a deferred key is still in the cache".into());
                            }
                        }
                    }
                    Err(_) if self.snapshot() != before => {
                        return Err("a refused defer_write_release changed state".into());
                    }
                    // Not all pending any more (a reset, a completion): they stay as they are.
                    Err(_) => self.reqs[*req].stores = stores,
                }
            }
            ManagerOp::ReleaseDeferred { count } => {
                let before = self.snapshot();
                if self.m.release_deferred_write(&[1 << 40]).is_ok() || self.snapshot() != before {
                    return Err("an id never deferred was released".into());
                }
                let n = usize::from(*count).min(self.deferred.len());
                let ids: Vec<i64> = self.deferred.drain(..n).collect();
                self.m
                    .release_deferred_write(&ids)
                    .map_err(|e| format!("release_deferred_write: {e}"))?;
            }
            ManagerOp::TakeEvents { requeue } => {
                let events = m.take_events();
                if *requeue {
                    m.requeue_events(events.clone());
                    let again = m.take_events();
                    if again != events {
                        return Err(format!("requeued {events:?}, took back {again:?}"));
                    }
                }
            }
        }
        self.validate()
    }

    fn validate(&self) -> Result<(), String> {
        self.m.validate()
    }
}

#[cfg(test)]
mod proptests {
    use proptest::prelude::*;

    use super::*;

    fn program_bytes() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(any::<u8>(), 0..1536)
    }

    #[test]
    fn programs_use_their_whole_input() {
        let bytes: Vec<u8> = (0..1200u32).map(|i| (i * 97 % 251) as u8).collect();
        assert!(PolicyProgram::from_bytes(&bytes).ops.len() > 100);
        assert!(ManagerProgram::from_bytes(&bytes).ops.len() > 100);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        // Too slow for Miri (and proptest persists failures to files, which Miri's isolation
        // forbids).
        #[cfg_attr(miri, ignore)]
        #[test]
        fn every_policy_keeps_its_invariants(bytes in program_bytes()) {
            PolicyProgram::from_bytes(&bytes).run_every_policy().map_err(TestCaseError::fail)?;
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[cfg_attr(miri, ignore)]
        #[test]
        fn every_manager_keeps_its_invariants(bytes in program_bytes()) {
            ManagerProgram::from_bytes(&bytes).run_every_policy().map_err(TestCaseError::fail)?;
        }
    }

    /// A deterministic sweep of byte programs, as the fuzzers would feed them (also runs under
    /// Miri, with fewer programs).
    #[test]
    fn decoded_byte_programs_run_clean() {
        let programs = if cfg!(miri) { 4 } else { 300 };
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..programs {
            let bytes: Vec<u8> = (0..400)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state.to_le_bytes()[0]
                })
                .collect();
            PolicyProgram::from_bytes(&bytes)
                .run_every_policy()
                .unwrap();
            ManagerProgram::from_bytes(&bytes)
                .run_every_policy()
                .unwrap();
        }
    }
}
