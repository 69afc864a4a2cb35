//! [`HostRegion`]: a page-aligned anonymous mapping with optional piecewise registration.
//!
//! Why not a `Vec<u8>` or the accelerator's pinned allocator: the allocator behind torch's
//! `pin_memory=True` rounds each allocation up to a power of two (an 80 GiB pool costs
//! 128 GiB), and a `Vec` would be zero-filled (fully resident) up front. A private anonymous
//! mapping costs nothing until a page is touched, and can be pinned after the fact.
//!
//! Lifetime rules (why the mapping outlives `close()`): Python views of the region created with
//! `torch.frombuffer` keep the exporting object alive but do not keep a buffer export open,
//! so an exporter cannot know that they exist. `close()` therefore unregisters the region and
//! gives its physical pages back (`MADV_DONTNEED`): stale views then read zeros instead of
//! crashing. The address range itself is unmapped exactly once, when the last owner (the pool
//! object, and any plan or in-flight copy holding an `Arc`) drops it.
#![allow(
    unsafe_code,
    reason = "mmap, munmap, madvise and mincore on the region's own mapping"
)]

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::error::{HostError, HostResult};

/// The operating system's page size (4 KiB on x86-64 Linux), read once.
pub fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf reads a constant of the running system; no memory is passed.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
    })
}

/// Registers host memory with an accelerator runtime (e.g. `cudaHostRegister`). Implemented
/// outside the core (the bindings call the CUDA runtime; tests use mocks).
pub trait HostRegistrar: Send {
    /// Registers `len` bytes starting at `addr`; `Err(code)` on failure.
    fn register(&mut self, addr: usize, len: usize) -> Result<(), i32>;
    /// Undoes a successful `register` of the range starting at `addr`.
    fn unregister(&mut self, addr: usize) -> Result<(), i32>;
    /// Clears the error state a failed call may leave behind. CUDA keeps the last error per
    /// thread and reports it again from unrelated later calls unless it is read and reset.
    fn clear_error(&mut self);
    /// Called first on a thread that is about to register (background pinning): the CUDA
    /// runtime must be told which device the thread works for, or it initialises device 0.
    fn bind_thread(&mut self) -> Result<(), i32> {
        Ok(())
    }
}

/// Background pieces are at most this large: a copy submitted while a piece is being
/// registered waits for that piece (cited at about 0.1 s per GiB), never for the whole pool.
pub const BACKGROUND_PIECE_BYTES: usize = 1 << 30;

/// Copies and registrations exclude each other per stripe of this many bytes of the region:
/// a copy waits only when a chunk it touches shares a stripe with the piece being registered.
const COPY_STRIPE_BYTES: usize = BACKGROUND_PIECE_BYTES;

/// Held while a DMA is submitted on the region ([`HostRegion::copy_guard_for`]): the
/// stripes it covers cannot start registering meanwhile.
pub struct CopyGuard<'a> {
    _stripes: Vec<RwLockReadGuard<'a, ()>>,
}

/// Where pinning stands (see [`HostRegion::pin_status`]).
#[derive(Clone, Debug, PartialEq)]
pub enum PinStatus {
    /// Never registered, or unregistered by `close()`.
    Unpinned,
    /// A background registration is running: `done` of `total` pieces registered.
    Pinning { done: usize, total: usize },
    /// Registered in `pieces` pieces; `seconds` is how long it took (prefault included).
    Pinned { pieces: usize, seconds: f64 },
    /// The background registration failed at `offset`: the pieces before it stay registered
    /// until `close()` (copies may be using them), the rest is pageable. The region is not
    /// "registered": kernels that need every byte pinned must not use it.
    Failed {
        code: i32,
        offset: usize,
        len: usize,
    },
}

/// Prefaults `len` bytes at `addr` (page aligned, inside one mapping) with up to `threads`
/// threads, capped at [`prefault_threads`]: `MADV_POPULATE_WRITE` allocates the pages without
/// changing their contents, so it may run while copies use the memory. `Ok(false)` when the
/// kernel lacks it (< 5.14): the registration then faults the pages in itself.
/// [`HostError::Spawn`] when the system refuses a thread (the threads already started finish
/// their part first).
fn populate(addr: usize, len: usize, threads: usize) -> HostResult<bool> {
    let (threads, part) = prefault_split(len, threads);
    let one = |start: usize, n: usize| {
        // SAFETY: `[start, start + n)` lies inside the caller's mapping (page aligned); the
        // advice only allocates missing pages and never modifies existing contents.
        let rc = unsafe {
            libc::madvise(
                std::ptr::with_exposed_provenance_mut::<libc::c_void>(start),
                n,
                libc::MADV_POPULATE_WRITE,
            )
        };
        rc == 0
    };
    if threads == 1 || len <= part {
        return Ok(one(addr, len));
    }
    std::thread::scope(|scope| {
        let mut handles = Vec::with_capacity(threads);
        for off in (0..len).step_by(part) {
            let n = part.min(len - off);
            let spawned = std::thread::Builder::new()
                .name("kvcache-prefault".into())
                .spawn_scoped(scope, move || one(addr + off, n));
            match spawned {
                Ok(handle) => handles.push(handle),
                Err(e) => return Err(HostError::Spawn(e)),
            }
        }
        // The scope joins whatever `all` leaves unjoined.
        Ok(handles.into_iter().all(|h| h.join().unwrap_or(false)))
    })
}

/// How many threads prefault `len` bytes when `threads` are asked for, and the bytes each
/// takes (whole pages).
fn prefault_split(len: usize, threads: usize) -> (usize, usize) {
    let page = page_size();
    let threads = threads.clamp(1, prefault_threads());
    (
        threads,
        len.div_ceil(threads).next_multiple_of(page).max(page),
    )
}

/// The most threads one prefault uses: the available parallelism, at most 8 (page zeroing
/// saturates memory bandwidth long before it saturates cores, and every thread costs a stack).
pub(crate) fn prefault_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .min(8)
}

/// Bytes per registration piece for a mapping of `total` bytes whose chunks are `unit` bytes.
///
/// One registration call fails beyond a driver limit, so large regions are registered in
/// pieces of at most `max_piece` bytes. Pieces start on chunk boundaries that are also page
/// boundaries, so no chunk straddles two registrations and no page is registered twice.
pub(crate) fn registration_piece_bytes(
    total: usize,
    unit: usize,
    page: usize,
    max_piece: usize,
) -> HostResult<usize> {
    if unit == 0 || page == 0 {
        return Err(HostError::Geometry(
            "chunk and page sizes must be positive".into(),
        ));
    }
    if max_piece < page {
        return Err(HostError::Geometry(format!(
            "registration pieces of at most {max_piece} bytes are smaller than a page ({page})"
        )));
    }
    if total <= max_piece {
        return Ok(total);
    }
    let aligned = lcm(unit, page).filter(|&a| a <= max_piece).ok_or_else(|| {
        HostError::Geometry(format!(
            "chunks of {unit} bytes cannot start registration pieces of at most {max_piece} bytes \
             on page boundaries"
        ))
    })?;
    Ok(max_piece / aligned * aligned)
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn lcm(a: usize, b: usize) -> Option<usize> {
    (a / gcd(a, b)).checked_mul(b)
}

/// `(address, length)` of registered pieces, in registration order.
type Pieces = Vec<(usize, usize)>;

struct Registration {
    registrar: Box<dyn HostRegistrar>,
    pieces: Pieces,
}

impl Registration {
    /// Unregisters every piece (last first); returns how many calls failed.
    fn undo(mut self) -> usize {
        unregister_all(&mut *self.registrar, self.pieces)
    }
}

/// Unregisters `pieces` (last first), clearing the error of each failed call; returns how
/// many failed.
fn unregister_all(registrar: &mut dyn HostRegistrar, mut pieces: Pieces) -> usize {
    let mut failures = 0;
    while let Some((addr, _)) = pieces.pop() {
        if registrar.unregister(addr).is_err() {
            registrar.clear_error();
            failures += 1;
        }
    }
    failures
}

struct State {
    registration: Option<Registration>,
    /// The pieces a failed background registration had registered. Copies submitted while it
    /// ran may still be using them (pinned memory is not safe to unpin under a DMA in flight),
    /// so they stay registered until `close()`, which waits for every lease.
    partial: Option<Registration>,
    leases: usize,
    closed: bool,
    /// Piece size and count of the registration in place or under way (layouts built while
    /// pinning runs must already respect its boundaries).
    planned: Option<(usize, usize)>,
    status: PinStatus,
    pin_thread: Option<JoinHandle<()>>,
}

/// A private anonymous mapping of at least `len` bytes (rounded up to whole pages), never
/// populated eagerly; or ([`HostRegion::borrowed`]) memory someone else mapped and keeps alive.
/// Shared through `Arc`; see the module docs for the lifetime rules.
pub struct HostRegion {
    ptr: NonNull<u8>,
    len: usize,
    map_len: usize,
    /// Set for borrowed memory: keeps its owner's mapping alive for as long as this region
    /// lives (dropped last). Borrowed memory is never unmapped nor emptied here.
    owner: Option<Box<dyn Send + Sync>>,
    /// Set when the borrowed memory is another region's ([`HostRegion::within`]): that one
    /// closing closes this one's use of it, and its `close()` waits for this one's leases.
    parent: Option<Arc<HostRegion>>,
    state: Mutex<State>,
    /// One lock per `stripe_bytes` of the mapping, held for writing while a piece overlapping
    /// it is being registered, for reading by whoever submits DMA on a range overlapping it
    /// ([`HostRegion::copy_guard_for`]): a copy never runs on a range whose registration is
    /// half done, and copies elsewhere never wait. Taken in ascending order by everyone.
    stripes: Box<[RwLock<()>]>,
    stripe_bytes: usize,
    cancel: AtomicBool,
}

// SAFETY: `ptr` designates a mapping owned exclusively by this value and unmapped only in
// `Drop`, or borrowed memory that `owner` keeps mapped for as long as this value lives. The type never creates Rust references into the mapping; it only hands out its
// address, and whoever reads or writes through that address is responsible for ordering its
// accesses (the copy functions document this). All other state sits behind a `Mutex`.
unsafe impl Send for HostRegion {}
// SAFETY: see `Send`: shared access only reads the immutable `ptr`/`len` or locks `state`.
unsafe impl Sync for HostRegion {}

impl HostRegion {
    /// Maps `len` bytes (> 0) of zeroed, non-resident, read-write memory.
    pub fn new(len: usize) -> HostResult<Self> {
        Self::with_stripes(len, COPY_STRIPE_BYTES)
    }

    fn with_stripes(len: usize, stripe_bytes: usize) -> HostResult<Self> {
        if len == 0 {
            return Err(HostError::Geometry(
                "a host region needs at least one byte".into(),
            ));
        }
        let map_len = len
            .checked_next_multiple_of(page_size())
            .filter(|&m| isize::try_from(m).is_ok())
            .ok_or_else(|| HostError::Geometry(format!("{len} bytes cannot be mapped")))?;
        // SAFETY: a fresh private anonymous mapping: no address hint, no file, and the
        // arguments are valid for any length; the result is checked against MAP_FAILED.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(HostError::Map(std::io::Error::last_os_error()));
        }
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| HostError::Map(std::io::Error::other("mmap returned NULL")))?;
        Ok(Self::over(ptr, len, map_len, None, stripe_bytes))
    }

    /// A region over memory `owner` keeps mapped (for example another process's shared
    /// mapping, exported through Python's buffer protocol): `len` bytes from `ptr`, both
    /// page-aligned. It can be registered (pinned) and copied to like an owned region, but is
    /// never unmapped, and `close()` leaves its contents alone. `owner` is dropped after
    /// everything else, when the last `Arc` of the region goes.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be readable and writable memory that stays mapped for as long
    /// as `owner` lives.
    pub unsafe fn borrowed(
        ptr: NonNull<u8>,
        len: usize,
        owner: Box<dyn Send + Sync>,
    ) -> HostResult<Self> {
        let page = page_size();
        if len == 0 || len % page != 0 || ptr.as_ptr().addr() % page != 0 {
            return Err(HostError::Geometry(format!(
                "borrowed host memory must be whole pages at a page boundary ({len} bytes at \
                 {:#x})",
                ptr.as_ptr().addr()
            )));
        }
        Ok(Self::over(ptr, len, len, Some(owner), COPY_STRIPE_BYTES))
    }

    fn over(
        ptr: NonNull<u8>,
        len: usize,
        map_len: usize,
        owner: Option<Box<dyn Send + Sync>>,
        stripe_bytes: usize,
    ) -> Self {
        // At most 2^47 / 2^30 stripes for any mapping the system granted.
        let stripes = (0..map_len.div_ceil(stripe_bytes))
            .map(|_| RwLock::new(()))
            .collect();
        HostRegion {
            ptr,
            len,
            map_len,
            owner,
            parent: None,
            state: Mutex::new(State {
                registration: None,
                partial: None,
                leases: 0,
                closed: false,
                planned: None,
                status: PinStatus::Unpinned,
                pin_thread: None,
            }),
            stripes,
            stripe_bytes,
            cancel: AtomicBool::new(false),
        }
    }

    /// This region, over memory that lies in `parent` (a pool over another pool's buffer):
    /// closed as soon as either is ([`Self::is_closed`]), and each lease on it is a lease on
    /// `parent` too, so `parent` cannot close under a transfer that uses its memory here.
    #[must_use]
    pub fn within(mut self, parent: Arc<HostRegion>) -> Self {
        self.parent = Some(parent);
        self
    }

    /// Whether the memory is borrowed ([`Self::borrowed`]) rather than owned.
    pub fn is_borrowed(&self) -> bool {
        self.owner.is_some()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent even if a holder panicked (every update is one field).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Start of the mapping (page aligned).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Start of the mapping as an integer address.
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Bytes requested (the usable length).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a region holds at least one byte.
    // A public `len` goes with an `is_empty` (clippy's `len_without_is_empty`).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Bytes mapped: `len` rounded up to whole pages.
    pub fn mapped_len(&self) -> usize {
        self.map_len
    }

    /// Whether anything may be reading or writing the memory right now: a transfer holds a
    /// lease (a plan not yet run, a copy in flight), or a registration is prefaulting and
    /// pinning it. (A caller's own synchronous call, `populate` or `register`, is not seen.)
    pub fn is_in_use(&self) -> bool {
        let st = self.lock();
        st.leases > 0 || matches!(st.status, PinStatus::Pinning { .. })
    }

    /// Closed by `close()`, or its memory's region ([`Self::within`]) is.
    pub fn is_closed(&self) -> bool {
        let closed = self.lock().closed;
        closed || self.parent.as_ref().is_some_and(|p| p.is_closed())
    }

    pub fn is_registered(&self) -> bool {
        self.lock().registration.is_some()
    }

    /// Bytes per registration piece while registered or being registered in the background
    /// (the last piece may be shorter).
    pub fn registration_piece_bytes(&self) -> Option<usize> {
        self.lock().planned.map(|(bytes, _)| bytes)
    }

    /// Number of pieces of the registration in place or under way (0 when none).
    pub fn registration_piece_count(&self) -> usize {
        self.lock().planned.map_or(0, |(_, count)| count)
    }

    /// Number of registered pieces: of the registration in place, or those a failed
    /// background registration left registered (0 when none).
    pub fn registered_pieces(&self) -> usize {
        let st = self.lock();
        st.registration
            .as_ref()
            .or(st.partial.as_ref())
            .map_or(0, |r| r.pieces.len())
    }

    pub fn pin_status(&self) -> PinStatus {
        self.lock().status.clone()
    }

    /// Taken around every DMA submission on the region, naming the `(address, length)`
    /// ranges the copies touch: waits while a background registration is registering a piece
    /// that shares a stripe with one of them (never longer than one piece takes). Ranges
    /// outside the region are clamped to it.
    pub fn copy_guard_for(
        &self,
        ranges: impl IntoIterator<Item = (usize, usize)>,
    ) -> CopyGuard<'_> {
        CopyGuard {
            _stripes: self
                .stripes_of(ranges)
                .into_iter()
                .map(|i| self.stripes[i].read().unwrap_or_else(|e| e.into_inner()))
                .collect(),
        }
    }

    /// The stripes overlapping `ranges`, ascending, each once.
    fn stripes_of(&self, ranges: impl IntoIterator<Item = (usize, usize)>) -> Vec<usize> {
        let mut wanted = Vec::new();
        for (addr, len) in ranges {
            if let Some((first, last)) = self.stripe_span(addr, len) {
                wanted.extend(first..=last);
            }
        }
        wanted.sort_unstable();
        wanted.dedup();
        wanted
    }

    /// The first and last stripe overlapping `len > 0` bytes at address `addr`, clamped to
    /// the region.
    fn stripe_span(&self, addr: usize, len: usize) -> Option<(usize, usize)> {
        let last_byte = addr.saturating_add(len.checked_sub(1)?);
        let stripe = |a: usize| {
            (a.saturating_sub(self.addr()) / self.stripe_bytes).min(self.stripes.len() - 1)
        };
        Some((stripe(addr), stripe(last_byte)))
    }

    /// Write-locks the stripes of `len` bytes at `offset` into the region, in ascending order.
    fn lock_stripes(&self, offset: usize, len: usize) -> Vec<RwLockWriteGuard<'_, ()>> {
        self.stripe_span(self.addr() + offset, len)
            .map(|(first, last)| {
                (first..=last)
                    .map(|i| self.stripes[i].write().unwrap_or_else(|e| e.into_inner()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Prefaults the whole mapping with `threads` threads, at most the available parallelism
    /// (capped at 8; see [`populate`]); `Ok(false)` when the kernel does not support
    /// `MADV_POPULATE_WRITE`, [`HostError::Spawn`] when the system refuses a thread.
    pub fn populate(&self, threads: usize) -> HostResult<bool> {
        populate(self.addr(), self.map_len, threads)
    }

    /// Registers the whole mapping in pieces (see [`registration_piece_bytes`]); `unit` is the
    /// chunk size pieces must align to. Each piece is prefaulted by several threads first
    /// (the part of pinning that parallelises). On failure every piece registered so far is
    /// unregistered, the registrar's error state is cleared, and the region stays as it was.
    /// Returns the number of pieces.
    pub fn register(
        &self,
        mut registrar: Box<dyn HostRegistrar>,
        unit: usize,
        max_piece: usize,
    ) -> HostResult<usize> {
        let piece = {
            let mut st = self.lock();
            let piece = self.check_can_register(&mut st, unit, max_piece)?;
            st.planned = Some((piece, self.map_len.div_ceil(piece)));
            st.status = PinStatus::Pinning {
                done: 0,
                total: self.map_len.div_ceil(piece),
            };
            piece
        };
        let started = Instant::now();
        // Nothing can copy from the region before this returns: a failure is undone at once.
        let outcome = self
            .register_pieces(&mut *registrar, piece, None)
            .map_err(|(e, pieces)| {
                unregister_all(&mut *registrar, pieces);
                e
            });
        let mut st = self.lock();
        match outcome {
            Ok(pieces) if st.closed => {
                // Closed by another thread meanwhile: give the registration back.
                drop(st);
                Registration { registrar, pieces }.undo();
                Err(HostError::Closed)
            }
            Ok(pieces) => {
                let count = pieces.len();
                st.registration = Some(Registration { registrar, pieces });
                st.status = PinStatus::Pinned {
                    pieces: count,
                    seconds: started.elapsed().as_secs_f64(),
                };
                Ok(count)
            }
            Err(e) => {
                st.planned = None;
                st.status = PinStatus::Unpinned;
                Err(e)
            }
        }
    }

    /// Starts registering the mapping on a background thread, in pieces of at most
    /// `min(max_piece, BACKGROUND_PIECE_BYTES)`, each prefaulted by several threads first.
    /// Returns at once with the number of pieces planned; [`Self::pin_status`] reports the
    /// progress and the outcome. Copies may run meanwhile (on pageable memory); a DMA
    /// submission holding [`Self::copy_guard_for`] waits while a piece overlapping its stripes
    /// is being registered. `close()` stops the thread after its current piece and rolls back.
    pub fn register_background(
        self: &Arc<Self>,
        mut registrar: Box<dyn HostRegistrar>,
        unit: usize,
        max_piece: usize,
    ) -> HostResult<usize> {
        let mut st = self.lock();
        let piece =
            self.check_can_register(&mut st, unit, max_piece.min(BACKGROUND_PIECE_BYTES))?;
        let total = self.map_len.div_ceil(piece);
        let region = Arc::clone(self);
        let handle = std::thread::Builder::new()
            .name("kvcache-pin".into())
            .spawn(move || {
                let started = Instant::now();
                let bound = registrar.bind_thread();
                let outcome = match bound {
                    Ok(()) => region.register_pieces(&mut *registrar, piece, Some(&region.cancel)),
                    Err(code) => {
                        registrar.clear_error();
                        let e = HostError::Register {
                            code,
                            offset: 0,
                            len: 0,
                        };
                        Err((e, Vec::new()))
                    }
                };
                let mut st = region.lock();
                match outcome {
                    Ok(pieces) if !region.cancel.load(Ordering::Acquire) => {
                        st.status = PinStatus::Pinned {
                            pieces: pieces.len(),
                            seconds: started.elapsed().as_secs_f64(),
                        };
                        st.registration = Some(Registration { registrar, pieces });
                    }
                    Ok(pieces) => {
                        // Cancelled by close(): give back what was registered.
                        drop(st);
                        Registration { registrar, pieces }.undo();
                        let mut st = region.lock();
                        st.planned = None;
                        st.status = PinStatus::Unpinned;
                    }
                    Err((e, pieces)) => {
                        st.status = match e {
                            HostError::Register { code, offset, len } => {
                                PinStatus::Failed { code, offset, len }
                            }
                            _ => PinStatus::Unpinned,
                        };
                        if pieces.is_empty() {
                            st.planned = None;
                        } else {
                            // Copies may be using them: kept (boundaries included) until close.
                            st.partial = Some(Registration { registrar, pieces });
                        }
                    }
                }
            })
            .map_err(HostError::Spawn)?;
        st.planned = Some((piece, total));
        st.status = PinStatus::Pinning { done: 0, total };
        st.pin_thread = Some(handle);
        Ok(total)
    }

    /// The piece size of a registration that may start now.
    fn check_can_register(
        &self,
        st: &mut State,
        unit: usize,
        max_piece: usize,
    ) -> HostResult<usize> {
        if st.pin_thread.as_ref().is_some_and(JoinHandle::is_finished) {
            // A finished background attempt (it failed, or it succeeded and is registered).
            if let Some(done) = st.pin_thread.take() {
                let _ = done.join();
            }
        }
        if st.closed || self.parent.as_ref().is_some_and(|p| p.is_closed()) {
            return Err(HostError::Closed);
        }
        if st.registration.is_some() || st.partial.is_some() || st.pin_thread.is_some() {
            return Err(HostError::AlreadyRegistered);
        }
        registration_piece_bytes(self.map_len, unit, page_size(), max_piece)
    }

    /// Prefaults and registers every piece in address order, stopping early when `cancel` is
    /// set. On failure, clears the registrar's error and returns the error with the pieces
    /// registered so far, still registered: whether they can be given back at once depends
    /// on whether copies may be using them. The state lock is not held meanwhile.
    fn register_pieces(
        &self,
        registrar: &mut dyn HostRegistrar,
        piece: usize,
        cancel: Option<&AtomicBool>,
    ) -> Result<Pieces, (HostError, Pieces)> {
        let total = self.map_len.div_ceil(piece);
        let mut pieces = Vec::with_capacity(total);
        let base = self.addr();
        let threads = prefault_threads();
        for offset in (0..self.map_len).step_by(piece) {
            if cancel.is_some_and(|c| c.load(Ordering::Acquire)) {
                break;
            }
            let len = piece.min(self.map_len - offset);
            // Prefaulting only speeds the registration up (it faults missing pages in itself),
            // so a refused thread or an old kernel is no reason to fail.
            let _prefaulted = populate(base + offset, len, threads);
            let rc = {
                let _exclusive = self.lock_stripes(offset, len);
                registrar.register(base + offset, len)
            };
            if let Err(code) = rc {
                registrar.clear_error();
                return Err((HostError::Register { code, offset, len }, pieces));
            }
            pieces.push((base + offset, len));
            let mut st = self.lock();
            st.status = PinStatus::Pinning {
                done: pieces.len(),
                total,
            };
        }
        Ok(pieces)
    }

    /// Blocks until a background registration has finished (or `timeout` passed); returns
    /// the status then.
    pub fn wait_pinned(&self, timeout: Duration) -> PinStatus {
        // A timeout beyond what an `Instant` can represent means no deadline.
        let deadline = Instant::now().checked_add(timeout);
        loop {
            let status = self.pin_status();
            let expired = deadline.is_some_and(|d| Instant::now() >= d);
            if !matches!(status, PinStatus::Pinning { .. }) || expired {
                return status;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Takes a lease that keeps `close()` from running while a transfer uses the region.
    pub fn lease(self: &Arc<Self>) -> HostResult<Lease> {
        // The memory's region first (released, on a refusal below, when `parent` drops).
        let parent = self.parent.as_ref().map(HostRegion::lease).transpose()?;
        let mut st = self.lock();
        if st.closed {
            return Err(HostError::Closed);
        }
        st.leases += 1;
        Ok(Lease {
            region: Arc::clone(self),
            _parent: parent.map(Box::new),
        })
    }

    /// Unregisters the region and returns its physical pages to the system. Idempotent.
    /// Refused (`Busy`) while leases are out. Returns how many unregister calls failed
    /// (their errors were cleared; the caller may log them).
    pub fn close(&self) -> HostResult<usize> {
        let mut st = self.lock();
        if st.closed {
            return Ok(0);
        }
        if st.leases > 0 {
            return Err(HostError::Busy { leases: st.leases });
        }
        if let Some(thread) = st.pin_thread.take() {
            // Stop a background registration after its current piece; it rolls back. New
            // leases cannot start meanwhile: the join happens with the state unlocked, but
            // `closed` is set first.
            st.closed = true;
            self.cancel.store(true, Ordering::Release);
            drop(st);
            let _ = thread.join();
            st = self.lock();
        }
        let failures = st.registration.take().map_or(0, Registration::undo)
            + st.partial.take().map_or(0, Registration::undo);
        st.planned = None;
        st.status = PinStatus::Unpinned;
        if self.owner.is_none() {
            // SAFETY: the range is exactly our own private anonymous mapping. MADV_DONTNEED
            // only drops its pages: later accesses through stale views see fresh zero pages,
            // so no access can fault. No transfer is running (no leases). Borrowed memory
            // holds its owner's data and is left alone.
            let rc =
                unsafe { libc::madvise(self.as_ptr().cast(), self.map_len, libc::MADV_DONTNEED) };
            debug_assert_eq!(rc, 0, "madvise(MADV_DONTNEED) on our own mapping failed");
        }
        st.closed = true;
        Ok(failures)
    }

    /// Bytes of the mapping currently resident in RAM (via `mincore`).
    pub fn resident_bytes(&self) -> std::io::Result<usize> {
        let page = page_size();
        // Query at most this many pages per call, to keep the vector small for huge regions.
        const WINDOW_PAGES: usize = 1 << 18;
        let mut vec = vec![0u8; WINDOW_PAGES.min(self.map_len / page)];
        let mut resident = 0;
        let mut offset = 0;
        while offset < self.map_len {
            let len = (self.map_len - offset).min(WINDOW_PAGES * page);
            let pages = len / page;
            // SAFETY: `offset..offset+len` lies inside our mapping, page aligned; `vec` holds
            // at least `pages` bytes for the kernel to fill.
            let rc = unsafe {
                libc::mincore(
                    self.as_ptr().add(offset).cast(),
                    len,
                    vec.as_mut_ptr().cast(),
                )
            };
            if rc != 0 {
                return Err(std::io::Error::last_os_error());
            }
            resident += vec[..pages].iter().filter(|&&b| b & 1 != 0).count() * page;
            offset += len;
        }
        Ok(resident)
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for reg in [st.registration.take(), st.partial.take()]
            .into_iter()
            .flatten()
        {
            reg.undo();
        }
        if self.owner.is_none() {
            // SAFETY: we own the mapping and this is its only unmap; no `Arc` (hence no
            // lease, plan or copy) refers to it any more.
            let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.map_len) };
            debug_assert_eq!(rc, 0, "munmap of our own mapping failed");
        }
        // Borrowed memory: `owner` (dropped with the fields, after the registrations were
        // undone above) lets its mapping go.
    }
}

/// Proof that a transfer is using the region; `close()` is refused until it is dropped.
pub struct Lease {
    region: Arc<HostRegion>,
    /// The lease on the region whose memory this one uses ([`HostRegion::within`]), given back
    /// after this one.
    _parent: Option<Box<Lease>>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut st = self.region.lock();
        st.leases -= 1;
    }
}

#[cfg(test)]
mod tests;
