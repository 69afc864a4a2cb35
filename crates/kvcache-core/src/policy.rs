//! [`Policy`]: the one interface every cache policy implements. The manager drives policies
//! through it, and so do the Python bindings; adding a policy means implementing it in one new
//! file (see `docs/policies.md`).
//!
//! A policy keeps chunks of type `C` under byte keys. Callers resolve keys to [`EntryId`]s
//! once ([`Policy::find`], [`Policy::find_many`]) and then change the policy through those
//! handles only; the key-level methods ([`PolicyExt::get`], [`PolicyExt::insert_key`], …) are
//! written once in [`PolicyExt`], which every policy gets and none can override.
//!
//! Evictions are transactions, written once here for every policy: [`PolicyExt::evict`] plans on
//! `&P` (so "no plan" cannot have changed anything: the compiler enforces the atomicity vLLM's
//! `evict` promises) and only then commits on `&mut P`. A plan never leaves this module, so it
//! cannot be applied to a policy that changed since it was made.

use hashbrown::HashSet;

use crate::chunk::RefCounts;
use crate::error::{CoreError, CoreResult};
use crate::key::{Key, KeyBuf, KeyHasher};
use crate::retention::RetentionHint;
use crate::semantics::VllmSemantics;
use crate::slab::Idx;

/// A handle to one entry of a policy: valid until that entry is removed (after which its slot
/// may be reused, so handles kept across calls are checked with [`Policy::is_entry_of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EntryId(pub(crate) Idx);

/// How a finished request used a key, for [`Policy::on_request_finished`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Only stored by the request: restores recency, is not a frequency hit.
    InsertionOnly,
    /// Read by the request while ready: one frequency hit.
    Reused,
    /// Neither (e.g. a store miss that was not stored).
    Other,
}

/// A key a request observed for the first time, for [`Policy::on_request_access`].
#[derive(Clone, Copy, Debug)]
pub struct Observed<'a> {
    pub key: Key<'a>,
    /// The policy's resident entry for the key (`None`: not resident).
    pub id: Option<EntryId>,
    /// The key's token position in the request (`None`: unknown, or not read).
    pub position: Option<i64>,
}

/// A number a policy reports about itself.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Stat {
    Count(usize),
    Value(f64),
}

impl Stat {
    /// The figure as a float (counts are exact below 2^53).
    pub fn as_f64(self) -> f64 {
        match self {
            #[allow(clippy::cast_precision_loss, reason = "counts are far below 2^53")]
            Stat::Count(n) => n as f64,
            Stat::Value(v) => v,
        }
    }
}

/// One resident key with its LRU-style rank (eviction order is ascending `(rank, -position)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankedEntry<'a> {
    pub key: &'a [u8],
    pub rank: u64,
    pub position: i64,
    pub evictable: bool,
}

/// A policy's internal state, for tests and debugging.
#[derive(Debug, Default)]
pub struct Inspection<'a> {
    /// Named key lists, each from least to most recently used (ARC: `t1`, `t2`, `b1`, `b2`).
    pub lists: Vec<(&'static str, Vec<&'a [u8]>)>,
    /// Every resident key with its rank, in eviction order, for policies that rank keys.
    pub ranks: Option<Vec<RankedEntry<'a>>>,
    /// Named figures (ARC: `target_t1_size`; LRU: `request_groups`).
    pub stats: Vec<(&'static str, Stat)>,
}

pub trait Policy<C>: Sized {
    /// What the policy keeps per live request (LRU: the request's shared rank; ARC: nothing).
    /// The caller stores it with the request (the manager in its request table, the bindings
    /// per request context), passes it to the calls that take it, and hands it back through
    /// [`release_request`](Self::release_request) once the request is gone.
    type Request: Default;

    /// The policy's short name (`"lru"`, `"arc"`).
    const NAME: &'static str;
    /// Whether [`insert`](Self::insert) and [`on_request_access`](Self::on_request_access) use
    /// token positions (callers skip reading them otherwise).
    const READS_POSITIONS: bool;
    /// Whether [`on_request_finished`](Self::on_request_finished) tells [`Access`] kinds apart
    /// (callers pass [`Access::Other`] for every key otherwise).
    const READS_ACCESS: bool;
    /// Whether [`on_request_access`](Self::on_request_access) wants the keys that are not
    /// resident too, and [`insert`](Self::insert) the request's state even where no token
    /// position is known (callers that can skip either otherwise do).
    const READS_ABSENT: bool = false;

    /// An empty policy for a cache of `capacity` chunks.
    fn new(capacity: usize) -> Self;
    fn capacity(&self) -> usize;
    /// Resident entries.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The hasher keys must be hashed with (one per process: see [`KeyHasher::global`]).
    fn hasher(&self) -> &KeyHasher;

    /// The entry the policy keeps for `key`: resident, or a ghost for policies that keep them.
    fn find(&self, key: Key<'_>) -> Option<EntryId>;
    /// [`find`](Self::find) for a batch, in one pass whose cache misses overlap.
    fn find_many(&self, keys: &[Key<'_>]) -> Vec<Option<EntryId>>;
    /// The chunk of a resident entry; `None` for a ghost.
    fn chunk(&self, id: EntryId) -> Option<&C>;
    /// Whether `id` still names the entry kept for `key`.
    fn is_entry_of(&self, id: EntryId, key: &[u8]) -> bool;
    /// Resident keys and chunks, in no particular order.
    fn resident<'a>(&'a self) -> impl Iterator<Item = (&'a [u8], &'a C)>
    where
        C: 'a;

    /// Adds `chunk` under `key`, which is not resident. `found` is what [`find`](Self::find)
    /// returned for it (a ghost, or `None`); it may have gone stale since and is checked.
    /// `position` is the key's token position in the storing request (`None`: unknown), and
    /// `evictable` whether the chunk's `ref_cnt` is 0 now.
    fn insert(
        &mut self,
        request: &mut Self::Request,
        found: Option<EntryId>,
        key: Key<'_>,
        chunk: C,
        position: Option<i64>,
        evictable: bool,
    ) -> EntryId;
    /// Drops a resident entry without a trace (a failed store).
    fn remove(&mut self, id: EntryId) -> C;
    /// The keys were used; given head to tail, applied tail to head (so the head ends most
    /// recent). `None` entries are skipped.
    fn touch(&mut self, ids: &[Option<EntryId>], counts: &impl RefCounts<C>);
    /// Store misses, head to tail, seen before their keys are inserted. By default what
    /// vLLM's protocol does by default: a touch (which only moves resident keys) under 0.33,
    /// nothing under 0.34.
    fn on_store_miss(
        &mut self,
        ids: &[Option<EntryId>],
        counts: &impl RefCounts<C>,
        semantics: VllmSemantics,
    ) {
        if semantics.store_miss_touches() {
            self.touch(ids, counts);
        }
    }
    /// A request observed keys for the first time, with their token positions: the resident
    /// ones always, the others too where [`READS_ABSENT`](Self::READS_ABSENT) asks for them.
    fn on_request_access(&mut self, request: &mut Self::Request, entries: &[Observed<'_>]) {
        let _ = (request, entries);
    }
    /// The application's retention hint for a request, given once, before the request's
    /// first key reaches the policy. Policies that ignore hints (vLLM's LRU and ARC: their
    /// decisions stay vLLM's whatever arrives) keep the default, which does nothing.
    fn on_request_hint(&mut self, request: &mut Self::Request, hint: RetentionHint) {
        let _ = (request, hint);
    }
    /// A finished request's keys in head-to-tail order, each with how the request used it.
    fn on_request_finished(
        &mut self,
        request: &mut Self::Request,
        entries: &[(Option<EntryId>, Access)],
    );
    /// Whether a resident entry is marked evictable; `None` for policies that keep no mark
    /// (they read `ref_cnt` when evicting).
    fn evictable(&self, id: EntryId) -> Option<bool> {
        let _ = id;
        None
    }
    /// Sets or clears a resident entry's evictable mark (if the policy keeps one).
    fn set_evictable(&mut self, id: EntryId, evictable: bool) {
        let _ = (id, evictable);
    }
    /// An offline caller's knowledge that a resident entry's key is next used at `next_use`
    /// (a request index; `u64::MAX`: never). Only the replay's bound reads it
    /// ([`BeladyPolicy`](crate::BeladyPolicy)); online policies ignore it.
    fn hint_next_use(&mut self, id: EntryId, next_use: u64) {
        let _ = (id, next_use);
    }
    /// Reads, since the policy was built or cleared, of chunks it kept only because a
    /// retention hint said their conversation continues (0 for policies that ignore hints).
    fn hint_kept_hits(&self) -> u64 {
        0
    }
    /// The request is gone: no key will be ranked on its behalf any more.
    fn release_request(&mut self, request: Self::Request) {
        let _ = request;
    }
    /// Forgets every entry and all adaptive and per-request state.
    fn clear(&mut self);

    /// Candidate victims in the order the policy evicts them. `idle(id, chunk)` tells whether
    /// a resident entry may go (its `ref_cnt` is 0 and it is not protected); the iterator yields
    /// only such entries, each at most once, and must change nothing.
    fn victims<'a>(
        &'a self,
        idle: impl Fn(EntryId, &C) -> bool + 'a,
    ) -> impl Iterator<Item = EntryId> + 'a;
    /// Takes one planned victim out of the cache.
    fn evict_entry(&mut self, id: EntryId) -> Evicted<C>;
    /// Runs once after a batch of [`evict_entry`](Self::evict_entry) (ARC trims its ghosts).
    fn after_eviction(&mut self) {}

    /// Heap bytes held by the policy's own structures.
    fn heap_bytes(&self) -> usize;
    /// The policy's internal state, for tests and debugging.
    fn inspect(&self) -> Inspection<'_>;
    /// The named figures of [`inspect`](Self::inspect), without its key lists (cheap).
    fn stats(&self) -> Vec<(&'static str, Stat)>;
    /// Checks every structural invariant; `Err` names the first one broken.
    #[cfg(any(test, feature = "validate"))]
    fn validate(&self) -> Result<(), String>;
}

/// Key-level operations every policy gets, written once over [`Policy`]'s entry-level
/// methods: resolve the key, then call. Implemented for every policy by the blanket impl below
/// and for no type otherwise, so no policy can override one; in particular
/// [`evict`](Self::evict) always plans on `&P` and commits on `&mut P`.
pub trait PolicyExt<C>: Policy<C> {
    #[inline]
    fn key<'a>(&self, bytes: &'a [u8]) -> Key<'a> {
        Key::new(self.hasher(), bytes)
    }

    /// The resident entry of `key`.
    #[inline]
    fn find_resident(&self, key: Key<'_>) -> Option<EntryId> {
        self.find(key).filter(|&id| self.chunk(id).is_some())
    }

    /// The chunk stored under `key`.
    #[inline]
    fn get(&self, key: Key<'_>) -> Option<&C> {
        self.find(key).and_then(|id| self.chunk(id))
    }

    /// The resident entry of `key`, or [`CoreError::KeyNotFound`].
    fn resident_or_err(&self, key: Key<'_>) -> CoreResult<EntryId> {
        self.find_resident(key)
            .ok_or_else(|| CoreError::KeyNotFound(KeyBuf::new(key.bytes)))
    }

    /// What [`insert`](Policy::insert) takes as `found` for `key` (its ghost, or `None`), or
    /// [`CoreError::DuplicateKey`] if `key` is resident. Callers that must do more between
    /// the check and the insertion (read a position) check with this first.
    #[inline]
    fn find_vacant(&self, key: Key<'_>) -> CoreResult<Option<EntryId>> {
        match self.find(key) {
            Some(id) if self.chunk(id).is_some() => {
                Err(CoreError::DuplicateKey(KeyBuf::new(key.bytes)))
            }
            found => Ok(found),
        }
    }

    /// [`insert`](Policy::insert) with the lookup; [`CoreError::DuplicateKey`] if resident.
    fn insert_key(
        &mut self,
        request: &mut Self::Request,
        key: Key<'_>,
        chunk: C,
        position: Option<i64>,
        evictable: bool,
    ) -> CoreResult<EntryId> {
        let found = self.find_vacant(key)?;
        Ok(self.insert(request, found, key, chunk, position, evictable))
    }

    /// [`remove`](Policy::remove) of a resident key.
    fn remove_key(&mut self, key: Key<'_>) -> CoreResult<C> {
        let id = self.resident_or_err(key)?;
        Ok(self.remove(id))
    }

    fn touch_keys(&mut self, keys: &[Key<'_>], counts: &impl RefCounts<C>) {
        let ids = self.find_many(keys);
        self.touch(&ids, counts);
    }

    fn on_store_miss_keys(
        &mut self,
        keys: &[Key<'_>],
        counts: &impl RefCounts<C>,
        semantics: VllmSemantics,
    ) {
        let ids = self.find_many(keys);
        self.on_store_miss(&ids, counts, semantics);
    }

    /// The chunk's `ref_cnt` went to 0. [`CoreError::KeyNotFound`] if not resident.
    fn mark_evictable(&mut self, key: Key<'_>) -> CoreResult<()> {
        let id = self.resident_or_err(key)?;
        self.set_evictable(id, true);
        Ok(())
    }

    /// The chunk's `ref_cnt` left 0. [`CoreError::KeyNotFound`] if not resident,
    /// [`CoreError::NotEvictable`] if the policy keeps marks and this key was not marked.
    fn mark_non_evictable(&mut self, key: Key<'_>) -> CoreResult<()> {
        let id = self.resident_or_err(key)?;
        if self.evictable(id) == Some(false) {
            return Err(CoreError::NotEvictable(KeyBuf::new(key.bytes)));
        }
        self.set_evictable(id, false);
        Ok(())
    }

    /// The resident entries of `keys` (absent keys need no protection).
    fn protect<'k>(&self, keys: impl IntoIterator<Item = Key<'k>>) -> Protected {
        Protected::from_ids(keys.into_iter().filter_map(|k| self.find_resident(k)))
    }

    /// Evicts exactly `n` idle (`ref_cnt == 0`), unprotected chunks in the policy's order, or
    /// returns `None` and changes nothing.
    fn evict(
        &mut self,
        n: usize,
        protected: &Protected,
        counts: &impl RefCounts<C>,
    ) -> Option<Vec<Evicted<C>>> {
        if n == 0 {
            // vLLM's policies return at once; nothing to plan or tidy.
            return Some(Vec::new());
        }
        let plan = plan(&*self, n, protected, counts)?;
        Some(commit(self, plan))
    }
}

impl<C, P: Policy<C>> PolicyExt<C> for P {}

/// An evicted entry: its key and the chunk that was stored under it.
#[derive(Debug)]
pub struct Evicted<C> {
    pub key: KeyBuf,
    pub chunk: C,
}

/// Entries an eviction must skip: the resident keys the caller is about to use. Keys that
/// are not resident need no entry, so the set is at most as large as the offer.
#[derive(Default, Debug)]
pub struct Protected {
    entries: HashSet<EntryId, foldhash::fast::FixedState>,
}

impl Protected {
    pub fn new() -> Self {
        Self::default()
    }

    pub(crate) fn from_ids(ids: impl IntoIterator<Item = EntryId>) -> Self {
        Protected {
            entries: ids.into_iter().collect(),
        }
    }

    #[inline]
    fn contains(&self, id: EntryId) -> bool {
        !self.entries.is_empty() && self.entries.contains(&id)
    }
}

/// Victims chosen by [`plan`], in eviction order.
struct EvictionPlan {
    victims: Vec<EntryId>,
}

/// Chooses exactly `n` victims without changing anything, or `None` if fewer than `n` resident
/// chunks are idle and unprotected. The victim list is sized by the policy's resident count,
/// never by `n` alone.
fn plan<C, P: Policy<C>>(
    policy: &P,
    n: usize,
    protected: &Protected,
    counts: &impl RefCounts<C>,
) -> Option<EvictionPlan> {
    if n > policy.len() {
        return None;
    }
    let mut victims = Vec::with_capacity(n);
    victims.extend(
        policy
            .victims(|id, chunk| counts.ref_cnt(chunk) == 0 && !protected.contains(id))
            .take(n),
    );
    (victims.len() == n).then_some(EvictionPlan { victims })
}

/// Takes the planned victims out, in plan order, then lets the policy tidy up once.
fn commit<C, P: Policy<C>>(policy: &mut P, plan: EvictionPlan) -> Vec<Evicted<C>> {
    let evicted = plan
        .victims
        .into_iter()
        .map(|id| policy.evict_entry(id))
        .collect();
    policy.after_eviction();
    evicted
}
