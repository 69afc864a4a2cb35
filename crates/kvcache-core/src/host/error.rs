//! Errors of the host-memory module. Like the rest of the core, every check runs before any
//! effect, so an `Err` means nothing was mapped, registered, copied or planned. The bindings
//! map each variant to one `KvCacheError` subclass (noted per variant).

use std::fmt;

#[derive(Debug)]
pub enum HostError {
    /// A size, count or layout a region or a transfer layout cannot be built with
    /// (`InvalidArgumentError`).
    Geometry(String),
    /// A transfer whose ids, spans or buffers do not match its layout
    /// (`InvalidArgumentError`).
    Mismatch(String),
    /// One transfer writes the destination `id` (at `position`) more than once
    /// (`InvalidArgumentError`).
    DuplicateDestination {
        what: &'static str,
        id: i64,
        position: usize,
    },
    /// An address or length that does not fit where it must go: int64 for kernels, `usize`
    /// for a CPU copy (`InvalidArgumentError`).
    Unaddressable { value: u64 },
    /// A block or chunk id (at `position` of its list) outside `[0, bound)`
    /// (`OutOfRangeError`).
    OutOfRange {
        what: &'static str,
        id: i64,
        position: usize,
        bound: u64,
    },
    /// A device address (at `position` of a job's pointers, for `reference` of `group`) that
    /// is not inside the blocks `[start, end)` of the tensor that reference names
    /// (`OutOfRangeError`).
    PointerOutOfRange {
        address: u64,
        position: usize,
        group: usize,
        reference: usize,
        start: u64,
        end: u64,
    },
    /// A group index outside the layout's `groups` (`OutOfRangeError`).
    NoSuchGroup { group: usize, groups: usize },
    /// The region is registered already, or a registration is under way
    /// (`InvalidStateError`).
    AlreadyRegistered,
    /// The region was closed; no new transfers or registrations (`InvalidStateError`).
    Closed,
    /// `close()` while transfers still hold leases on the region (`TransferError`).
    Busy { leases: usize },
    /// The operating system refused the mapping (`OutOfMemoryError`).
    Map(std::io::Error),
    /// The registrar failed on the piece at `offset` (all earlier pieces were rolled back)
    /// (`TransferError`).
    Register {
        code: i32,
        offset: usize,
        len: usize,
    },
    /// The operating system refused a helper thread (`TransferError`).
    Spawn(std::io::Error),
    /// The allocator refused `bytes` bytes for `what` (`OutOfMemoryError`).
    Alloc { what: &'static str, bytes: u64 },
}

impl fmt::Display for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostError::Geometry(m) | HostError::Mismatch(m) => write!(f, "{m}"),
            HostError::DuplicateDestination { what, id, position } => write!(
                f,
                "{what} id {id} at position {position} repeats: one job may write each \
                 destination once"
            ),
            HostError::Unaddressable { value } => {
                write!(f, "address or length {value:#x} does not fit (int64 / address space)")
            }
            HostError::OutOfRange {
                what,
                id,
                position,
                bound,
            } => write!(
                f,
                "{what} id {id} at position {position} is out of range [0, {bound})"
            ),
            HostError::PointerOutOfRange {
                address,
                position,
                group,
                reference,
                start,
                end,
            } => write!(
                f,
                "device pointer {address:#x} at position {position} (group {group}, reference \
                 {reference}) is outside its tensor's blocks [{start:#x}, {end:#x})"
            ),
            HostError::NoSuchGroup { group, groups } => {
                write!(f, "group {group} is out of range: the layout has {groups} groups")
            }
            HostError::AlreadyRegistered => write!(f, "the host region is already registered"),
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
            HostError::Spawn(e) => write!(f, "cannot start a host-memory thread: {e}"),
            HostError::Alloc { what, bytes } => {
                write!(f, "cannot allocate {bytes} bytes for {what}")
            }
        }
    }
}

impl std::error::Error for HostError {}

pub type HostResult<T> = Result<T, HostError>;
