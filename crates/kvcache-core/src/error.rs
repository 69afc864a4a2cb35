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
    /// An eviction plan was committed after the policy changed since it was made.
    StalePlan,
    /// An argument outside its domain (the message says which).
    InvalidArgument(String),
    /// A manager call that contradicts the chunk's state (e.g. loading a pending chunk).
    InvalidState(String),
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::KeyNotFound(k) => write!(f, "key not found: {k:?}"),
            CoreError::DuplicateKey(k) => write!(f, "key is already present: {k:?}"),
            CoreError::NotEvictable(k) => write!(f, "key is not evictable: {k:?}"),
            CoreError::StalePlan => write!(
                f,
                "eviction plan is stale: the policy changed since it was made"
            ),
            CoreError::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            CoreError::InvalidState(m) => write!(f, "invalid state: {m}"),
        }
    }
}

impl std::error::Error for CoreError {}

pub type CoreResult<T> = Result<T, CoreError>;
