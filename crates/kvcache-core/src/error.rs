//! Errors of the core. Every fallible operation checks before it mutates, so an `Err` always
//! means "nothing changed".

use std::fmt;

use crate::key::KeyBuf;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CoreError {
    /// The key is not resident (remove, mark_*), or not known to the manager.
    KeyNotFound(KeyBuf),
    /// `insert` of a key that is already resident.
    DuplicateKey(KeyBuf),
    /// `mark_non_evictable` of a key that is not currently evictable.
    NotEvictable(KeyBuf),
    /// One `prepare_store` offer names the same key twice (vLLM would store it twice).
    DuplicateInOffer(KeyBuf),
    /// A request token from before a reset, or of a request already released.
    StaleRequest,
    /// New keys observed for a request after it finished.
    RequestFinished,
    /// A load of a chunk whose store is still in flight.
    ChunkPending(KeyBuf),
    /// `complete_load` of a chunk no load is reading.
    NoLoadPending(KeyBuf),
    /// A cache larger than the manager can address.
    TooManyChunks { requested: usize, max: usize },
    /// Memory for `what` could not be allocated.
    OutOfMemory { what: &'static str },
    /// An operation the configured vLLM release's protocol does not have.
    Unsupported {
        what: &'static str,
        semantics: &'static str,
    },
    /// `defer_write_release` of a key whose write is not pending.
    NotWritePending(KeyBuf),
    /// `release_deferred_write` of an id that is not a deferred chunk (or is named twice).
    NotDeferred(i64),
    /// `reset_cache` while this many chunks' release is deferred.
    DeferredWrites(usize),
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::KeyNotFound(k) => write!(f, "key not found: {k:?}"),
            CoreError::DuplicateKey(k) => write!(f, "key is already present: {k:?}"),
            CoreError::NotEvictable(k) => write!(f, "key is not evictable: {k:?}"),
            CoreError::DuplicateInOffer(k) => {
                write!(f, "prepare_store names key {k:?} more than once")
            }
            CoreError::StaleRequest => write!(
                f,
                "the request's state is gone (released, or from before a cache reset)"
            ),
            CoreError::RequestFinished => {
                write!(f, "new cache keys observed after the request finished")
            }
            CoreError::ChunkPending(k) => write!(
                f,
                "chunk of {k:?} is not ready for reading (its store is in flight)"
            ),
            CoreError::NoLoadPending(k) => write!(f, "chunk of {k:?} has no load to complete"),
            CoreError::TooManyChunks { requested, max } => {
                write!(f, "num_chunks {requested} exceeds the maximum {max}")
            }
            CoreError::OutOfMemory { what } => write!(f, "out of memory allocating {what}"),
            CoreError::Unsupported { what, semantics } => write!(
                f,
                "{what} is not part of vLLM {semantics}'s offloading manager protocol"
            ),
            CoreError::NotWritePending(k) => write!(f, "key {k:?} is not a pending write"),
            CoreError::NotDeferred(id) => write!(
                f,
                "chunk {id} is not a chunk whose release was deferred (or is named twice)"
            ),
            CoreError::DeferredWrites(n) => write!(
                f,
                "reset_cache refused: {n} chunk(s) of failed writes are still deferred (a tier \
                 may still write to them); release them first"
            ),
        }
    }
}

impl std::error::Error for CoreError {}

pub type CoreResult<T> = Result<T, CoreError>;
