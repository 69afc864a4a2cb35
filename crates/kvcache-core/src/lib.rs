//! kvcache-core: the pure-Rust heart of kvcache (no Python).
//!
//! - [`arc::ArcPolicy`] and [`lru::LruPolicy`]: vLLM 0.33.0's CPU-offloading cache policies,
//!   decision-identical (same victims in the same order, same rank numbers, same ARC target),
//!   with O(1) per-key updates and evictions proportional to the victims plus entries skipped.
//! - [`eviction`]: evictions are transactions: `plan(&self)` then `commit(&mut self, plan)`.
//! - [`manager::Manager`]: vLLM's `CPUOffloadingManager` (chunk pool, ref counts, events,
//!   store threshold, per-request access tracking), generic over the policy.
//! - [`key`], [`slab`], [`index`]: keys stored once inline, hashed once per operation; entries
//!   in index-based slabs threaded by intrusive lists.
//!
//! Policies are generic over the chunk handle `C` and read reference counts through
//! [`chunk::RefCounts`], so the same code serves Python chunk objects (via their buffers) and
//! the manager's contiguous chunk table.
#![deny(unsafe_code)]

pub mod arc;
pub mod chunk;
pub mod error;
pub mod eviction;
pub mod host;
pub mod index;
pub mod key;
pub mod lru;
pub mod manager;
pub mod slab;
#[cfg(any(test, fuzzing, feature = "validate"))]
pub mod testing;

pub use arc::{Access, ArcPolicy, ListId};
pub use chunk::{HasRefCnt, RefCounts, SelfCounted};
pub use error::{CoreError, CoreResult};
pub use eviction::{Evicted, EvictionPlan, Protected};
pub use key::{Key, KeyBuf, KeyHash, KeyHasher};
pub use lru::{InsertRank, LruPolicy, RequestRank};
pub use manager::{LookupResult, Manager, ManagerConfig, RequestToken};
