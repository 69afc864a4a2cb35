//! kvcache-core: the pure-Rust heart of kvcache (no Python).
//!
//! - [`Policy`]: the one interface of a cache policy, over typed entry handles ([`EntryId`]).
//!   [`LruPolicy`] and [`ArcPolicy`] implement vLLM 0.33.0's CPU-offloading cache policies,
//!   decision-identical (same victims in the same order, same rank numbers, same ARC target),
//!   with O(1) per-key updates and evictions proportional to the victims plus entries skipped.
//!   Evictions are transactions ([`PolicyExt::evict`]), planned on `&self` and committed on
//!   `&mut self`, written once for every policy. [`for_each_policy!`] lists the policies; the
//!   tests, the fuzz targets and the Python bindings are built from that list.
//! - [`Manager`]: vLLM's `CPUOffloadingManager` (chunk pool, ref counts, events, store
//!   threshold, per-request access tracking), generic over the policy.
//! - [`host`]: host memory for chunks and the copy plans that move them.
//!
//! Keys are stored once, inline in their entry, and hashed once per operation ([`Key`]);
//! entries live in index-based slabs threaded by intrusive lists. Policies are generic over the
//! chunk handle `C` and read reference counts through [`RefCounts`], so the same code serves
//! Python chunk objects (through their buffers) and the manager's chunk table.
//!
//! Memory per key, for the manager's `u32` chunk handles (keys up to 40 bytes live inline;
//! longer ones add their length on the heap):
//! - LRU: one 80-byte slab entry plus ~5 bytes of hash table, and one anchor entry and one
//!   group per live request.
//! - ARC: one 64-byte, cache-line aligned slab entry plus ~5 bytes of hash table, for resident
//!   and ghost keys alike (at most `2 × capacity` ghosts).
//!
//! (The entry sizes are pinned by a test in each policy's module.)
#![deny(unsafe_code)]

/// Every policy the crate offers, in one list. `for_each_policy!(callback)` expands to
/// `callback! { … }` with one line per policy:
///
/// ```text
/// /// docs
/// module::PolicyType as Kind = "vLLMClassName";
/// ```
///
/// `module` is the file that implements the policy (declared and re-exported from it here),
/// `Kind` an identifier for enum variants and classes generated from the list, and the
/// literal vLLM's class name for the policy (the Python class's name). The policy's short
/// name is its [`Policy::NAME`]. Adding a policy is one new module implementing [`Policy`]
/// and one line here (see `docs/policies.md`).
#[macro_export]
macro_rules! for_each_policy {
    ($callback:ident) => {
        $callback! {
            /// Least-recently-used eviction with logical recency independent of pinning
            /// (vLLM's LRU).
            lru::LruPolicy as Lru = "LRUCachePolicy";
            /// Adaptive replacement (T1/T2 with ghost lists B1/B2), as vLLM's ARC.
            arc::ArcPolicy as Arc = "ARCCachePolicy";
            /// Recency with credit for reuse, fresh requests first, ghosts of evicted keys:
            /// kvcache's policy for multi-turn traffic.
            turn::TurnPolicy as Turn = "TurnCachePolicy";
        }
    };
}

/// Declares the module of every policy and re-exports its type.
macro_rules! declare_policies {
    ($($(#[$doc:meta])* $module:ident::$policy:ident as $kind:ident = $class:literal;)*) => {
        $(
            mod $module;
            pub use $module::$policy;
        )*
    };
}
for_each_policy!(declare_policies);

mod belady;
mod chunk;
mod entries;
mod error;
pub mod host;
mod index;
mod key;
pub mod manager;
mod policy;
mod registry;
mod retention;
mod semantics;
mod slab;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use belady::BeladyPolicy;
#[cfg(any(test, feature = "testing"))]
pub use chunk::TestChunk;
pub use chunk::{HasRefCnt, RefCounts, SelfCounted};
pub use error::{CoreError, CoreResult};
pub use key::{Key, KeyBuf, KeyHash, KeyHasher};
pub use lru::RequestGroup;
pub use manager::{LookupResult, Manager, ManagerConfig};
pub use policy::{
    Access, EntryId, Evicted, Inspection, Observed, Policy, PolicyExt, Protected, RankedEntry, Stat,
};
pub use registry::{Registry, RequestToken};
pub use retention::RetentionHint;
pub use semantics::VllmSemantics;
pub use slab::prefetch;
pub use turn::TurnRequest;
