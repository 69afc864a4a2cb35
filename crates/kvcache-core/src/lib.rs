//! kvcache-core: the pure-Rust heart of kvcache (no Python).
//!
//! - [`Policy`]: the one interface of a cache policy, over typed entry handles ([`EntryId`]).
//!   [`LruPolicy`] and [`ArcPolicy`] implement vLLM 0.33.0's CPU-offloading cache policies,
//!   decision-identical (same victims in the same order, same rank numbers, same ARC target),
//!   with O(1) per-key updates and evictions proportional to the victims plus entries skipped.
//! - [`eviction`]: evictions are transactions, planned on `&self` and committed on `&mut self`,
//!   written once for every policy.
//! - [`Manager`]: vLLM's `CPUOffloadingManager` (chunk pool, ref counts, events, store
//!   threshold, per-request access tracking), generic over the policy.
//! - [`host`]: host memory for chunks and the copy plans that move them.
//!
//! Keys are stored once, inline in their entry, and hashed once per operation ([`Key`]);
//! entries live in index-based slabs threaded by intrusive lists. Policies are generic over the
//! chunk handle `C` and read reference counts through [`RefCounts`], so the same code serves
//! Python chunk objects (through their buffers) and the manager's chunk table.
#![deny(unsafe_code)]

pub mod arc;
pub mod chunk;
mod entries;
mod error;
pub mod eviction;
pub mod host;
mod index;
mod key;
pub mod lru;
pub mod manager;
mod policy;
mod registry;
mod slab;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

pub use arc::{ArcPolicy, ListId};
pub use chunk::{HasRefCnt, RefCounts, SelfCounted};
pub use error::{CoreError, CoreResult};
pub use eviction::{Evicted, Protected};
pub use key::{Key, KeyBuf, KeyHash, KeyHasher};
pub use lru::{LruPolicy, RequestGroup};
pub use manager::{LookupResult, Manager, ManagerConfig};
pub use policy::{Access, EntryId, Inspection, Policy, RankedEntry, Stat};
pub use registry::{Registry, RequestToken};
pub use slab::prefetch;
