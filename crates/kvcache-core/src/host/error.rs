//! Errors of the host-memory module. Like the rest of the core, every check runs before any
//! effect, so an `Err` means nothing was mapped, registered, copied or planned.

use std::fmt;

#[derive(Debug)]
pub enum HostError {
    /// A size, count or geometry outside its domain (Python: `ValueError`).
    InvalidArgument(String),
    /// A block or chunk id outside `[0, count)` (Python: `IndexError`).
    OutOfRange(String),
    /// The region was closed; no new transfers or registrations (Python: `ValueError`).
    Closed,
    /// `close()` while transfers still hold leases on the region (Python: `RuntimeError`).
    Busy { leases: usize },
    /// The operating system refused the mapping (Python: `MemoryError`).
    Map(std::io::Error),
    /// The registrar failed on the piece at `offset` (all earlier pieces were rolled back).
    Register {
        code: i32,
        offset: usize,
        len: usize,
    },
}

impl fmt::Display for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostError::InvalidArgument(m) => write!(f, "{m}"),
            HostError::OutOfRange(m) => write!(f, "{m}"),
            HostError::Closed => write!(f, "the host chunk pool is closed"),
            HostError::Busy { leases } => write!(
                f,
                "the host chunk pool has {leases} transfer(s) in flight; wait for them first"
            ),
            HostError::Map(e) => write!(f, "mapping host memory failed: {e}"),
            HostError::Register { code, offset, len } => write!(
                f,
                "host memory registration failed with code {code} for {len} bytes at offset {offset}"
            ),
        }
    }
}

impl std::error::Error for HostError {}

pub type HostResult<T> = Result<T, HostError>;
