//! The manager harness: [`ManagerProgram`]s of requests on one [`Manager`], validated after
//! each step.

use arbitrary::{Arbitrary, Unstructured};

use super::{hint, ops, run_listed, Program};
use crate::manager::{ChunkId, LookupResult, Manager, ManagerConfig, VllmSemantics};
use crate::policy::Policy;
use crate::registry::RequestToken;
use crate::retention::RetentionHint;
use crate::Key;

/// Distinct keys a manager program uses.
const MANAGER_KEYS: u8 = 24;

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
        run_listed(self)?;
        self.run::<crate::BeladyPolicy<ChunkId>>()
            .map_err(|e| format!("belady: {e}"))
    }
}

impl Program for ManagerProgram {
    type Chunk = ChunkId;

    fn run<P: Policy<ChunkId>>(&self) -> Result<(), String> {
        ManagerProgram::run::<P>(self)
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
