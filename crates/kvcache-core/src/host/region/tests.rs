use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

#[derive(Default)]
struct Log {
    registered: Mutex<Vec<(usize, usize)>>,
    unregistered: Mutex<Vec<usize>>,
    cleared: AtomicUsize,
}

struct Mock {
    log: Arc<Log>,
    fail_at_call: Option<usize>,
    calls: usize,
    /// Time each registration takes, and a flag raised while one is in progress.
    delay: Duration,
    inside: Arc<AtomicBool>,
    /// The call that announces itself, then blocks until released.
    gate: Option<(usize, mpsc::Sender<()>, mpsc::Receiver<()>)>,
}

impl HostRegistrar for Mock {
    fn register(&mut self, addr: usize, len: usize) -> Result<(), i32> {
        self.calls += 1;
        if Some(self.calls) == self.fail_at_call {
            return Err(2);
        }
        self.inside.store(true, Ordering::SeqCst);
        if let Some((call, entered, release)) = &self.gate {
            if *call == self.calls {
                entered.send(()).unwrap();
                release.recv().unwrap();
            }
        }
        std::thread::sleep(self.delay);
        self.inside.store(false, Ordering::SeqCst);
        self.log.registered.lock().unwrap().push((addr, len));
        Ok(())
    }
    fn unregister(&mut self, addr: usize) -> Result<(), i32> {
        self.log.unregistered.lock().unwrap().push(addr);
        Ok(())
    }
    fn clear_error(&mut self) {
        self.log.cleared.fetch_add(1, Ordering::Relaxed);
    }
}

fn mock(fail_at_call: Option<usize>) -> (Box<Mock>, Arc<Log>) {
    let log = Arc::new(Log::default());
    let m = Box::new(Mock {
        log: Arc::clone(&log),
        fail_at_call,
        calls: 0,
        delay: Duration::ZERO,
        inside: Arc::new(AtomicBool::new(false)),
        gate: None,
    });
    (m, log)
}

impl HostRegion {
    /// [`Self::copy_guard_for`] the whole region.
    fn copy_guard(&self) -> CopyGuard<'_> {
        self.copy_guard_for([(self.addr(), self.map_len)])
    }

    /// Whether a copy on `ranges` could start now without waiting.
    fn copy_could_start(&self, ranges: impl IntoIterator<Item = (usize, usize)>) -> bool {
        let stripes = self.stripes_of(ranges);
        let held: Vec<_> = stripes
            .iter()
            .filter_map(|&i| self.stripes[i].try_read().ok())
            .collect();
        held.len() == stripes.len()
    }
}

#[test]
fn copies_wait_only_for_the_stripe_being_registered() {
    let page = page_size();
    let r = Arc::new(HostRegion::with_stripes(4 * page, page).unwrap());
    let (mut m, log) = mock(None);
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel();
    m.gate = Some((3, entered_tx, release_rx));
    r.register_background(m, page, page).unwrap();
    entered.recv().unwrap(); // the third piece, [2 pages, 3 pages), is being registered
    let base = r.addr();
    assert!(r.copy_could_start([(base, page), (base + 3 * page, 8)]));
    assert!(!r.copy_could_start([(base + 2 * page + 100, 8)]));
    // A range reaching into the piece, and the whole region, wait for it.
    assert!(!r.copy_could_start([(base, page), (base + 2 * page - 1, 2)]));
    assert!(!r.copy_could_start([(base, 4 * page)]));
    // Ranges outside the region are clamped to its first and last stripes.
    assert!(r.copy_could_start([(base - 64, 8), (base + 9 * page, 8)]));
    assert!(r.copy_could_start([(base, 0)]));
    release.send(()).unwrap();
    assert!(matches!(
        r.wait_pinned(Duration::from_secs(5)),
        PinStatus::Pinned { pieces: 4, .. }
    ));
    assert!(r.copy_could_start([(base, 4 * page)]));
    drop(r.copy_guard());
    assert_eq!(log.registered.lock().unwrap().len(), 4);
}

#[test]
fn background_pinning_reports_progress_and_excludes_copies_from_a_piece_in_progress() {
    let page = page_size();
    let r = Arc::new(HostRegion::new(6 * page).unwrap());
    let (mut m, log) = mock(None);
    m.delay = Duration::from_millis(15);
    let inside = Arc::clone(&m.inside);
    assert_eq!(r.register_background(m, page, 2 * page).unwrap(), 3);
    // Boundaries are known at once, before any piece is registered.
    assert_eq!(r.registration_piece_bytes(), Some(2 * page));
    assert!(matches!(
        r.pin_status(),
        PinStatus::Pinning { total: 3, .. }
    ));
    assert!(!r.is_registered());
    // A copy submitted meanwhile never overlaps a registration in progress.
    let mut overlaps = 0;
    while matches!(r.pin_status(), PinStatus::Pinning { .. }) {
        let _guard = r.copy_guard();
        if inside.load(Ordering::SeqCst) {
            overlaps += 1;
        }
    }
    assert_eq!(overlaps, 0);
    assert!(matches!(
        r.wait_pinned(Duration::from_secs(5)),
        PinStatus::Pinned { pieces: 3, .. }
    ));
    assert!(r.is_registered());
    // A timeout no `Instant` can hold is no deadline, not an overflow.
    assert!(matches!(
        r.wait_pinned(Duration::MAX),
        PinStatus::Pinned { pieces: 3, .. }
    ));
    assert_eq!(r.registered_pieces(), 3);
    assert_eq!(log.registered.lock().unwrap().len(), 3);
    assert!(
        r.resident_bytes().unwrap() >= 6 * page,
        "prefaulted before registering"
    );
    r.close().unwrap();
    assert_eq!(log.unregistered.lock().unwrap().len(), 3);
    assert_eq!(r.pin_status(), PinStatus::Unpinned);
}

#[test]
fn a_failed_background_registration_keeps_its_pieces_until_close() {
    let page = page_size();
    let r = Arc::new(HostRegion::new(8 * page).unwrap());
    let (m, log) = mock(Some(3));
    r.register_background(m, page, 2 * page).unwrap();
    // A transfer started while pinning ran: its copies may use the registered pieces.
    let lease = r.lease().unwrap();
    let status = r.wait_pinned(Duration::from_secs(5));
    assert_eq!(
        status,
        PinStatus::Failed {
            code: 2,
            offset: 4 * page,
            len: 2 * page
        }
    );
    assert!(!r.is_registered(), "not every byte is pinned");
    assert_eq!(log.cleared.load(Ordering::Relaxed), 1);
    assert_eq!(log.unregistered.lock().unwrap().len(), 0);
    assert_eq!(r.registered_pieces(), 2);
    // Layouts must keep respecting the boundaries of the pieces still registered.
    assert_eq!(r.registration_piece_bytes(), Some(2 * page));
    assert!(matches!(
        r.register_background(mock(None).0, page, 2 * page),
        Err(HostError::AlreadyRegistered)
    ));
    assert!(matches!(r.close(), Err(HostError::Busy { leases: 1 })));
    assert_eq!(log.unregistered.lock().unwrap().len(), 0);
    drop(lease);
    assert_eq!(r.close().unwrap(), 0);
    assert_eq!(log.unregistered.lock().unwrap().len(), 2);
    assert_eq!(r.registered_pieces(), 0);
    assert_eq!(r.pin_status(), PinStatus::Unpinned);
}

#[test]
fn a_failed_first_piece_leaves_nothing_to_give_back() {
    let page = page_size();
    let r = Arc::new(HostRegion::new(4 * page).unwrap());
    let (m, log) = mock(Some(1));
    r.register_background(m, page, page).unwrap();
    assert!(matches!(
        r.wait_pinned(Duration::from_secs(5)),
        PinStatus::Failed { offset: 0, .. }
    ));
    assert_eq!(r.registered_pieces(), 0);
    assert_eq!(r.registration_piece_bytes(), None);
    // Nothing is registered: another attempt may follow.
    r.register_background(mock(None).0, page, page).unwrap();
    assert!(matches!(
        r.wait_pinned(Duration::from_secs(5)),
        PinStatus::Pinned { pieces: 4, .. }
    ));
    r.close().unwrap();
    assert_eq!(log.unregistered.lock().unwrap().len(), 0);
}

#[test]
fn close_cancels_a_background_registration_and_rolls_it_back() {
    let page = page_size();
    let r = Arc::new(HostRegion::new(8 * page).unwrap());
    let (mut m, log) = mock(None);
    m.delay = Duration::from_millis(50); // 8 pieces: 400 ms unless close() stops it
    r.register_background(m, page, page).unwrap();
    assert!(matches!(
        r.register_background(mock(None).0, page, page),
        Err(HostError::AlreadyRegistered)
    ));
    std::thread::sleep(Duration::from_millis(30));
    r.close().unwrap();
    let registered = log.registered.lock().unwrap().len();
    assert!(
        registered < 8,
        "cancelled before the end ({registered} pieces)"
    );
    assert_eq!(log.unregistered.lock().unwrap().len(), registered);
    assert!(!r.is_registered());
    assert!(r.register_background(mock(None).0, page, page).is_err());
}

#[test]
fn prefaulting_never_asks_for_more_threads_than_the_cap() {
    let page = page_size();
    for (len, asked) in [
        (1 << 28, 1 << 16),
        (16 * page, usize::MAX),
        (page, 4),
        (0, 0),
    ] {
        let (threads, part) = prefault_split(len, asked);
        assert!(threads <= prefault_threads() && threads >= 1);
        assert_eq!(part % page, 0);
        assert!(
            len.div_ceil(part) <= threads,
            "{len} bytes in parts of {part}"
        );
    }
    let r = HostRegion::new(64 * page).unwrap();
    let populated = r.populate(usize::MAX).unwrap();
    if populated {
        assert_eq!(r.resident_bytes().unwrap(), 64 * page);
    }
}

#[test]
fn pieces_align_to_chunks_and_pages() {
    let page = 4096;
    assert_eq!(
        registration_piece_bytes(100, 10, page, 1 << 20).unwrap(),
        100
    );
    // Pieces must be multiples of both 3 KiB chunks and 4 KiB pages (12 KiB).
    let p = registration_piece_bytes(1 << 30, 3 * 1024, page, 1 << 20).unwrap();
    assert_eq!(p % (3 * 1024), 0);
    assert_eq!(p % page, 0);
    assert!(p <= 1 << 20 && p > (1 << 20) - 12 * 1024);
    assert!(registration_piece_bytes(1 << 30, (1 << 20) + 1, page, 1 << 20).is_err());
    assert!(registration_piece_bytes(1 << 30, 8, page, 100).is_err());
}

#[test]
fn region_is_lazy_and_exact() {
    let r = HostRegion::new(10 * page_size() + 1).unwrap();
    assert_eq!(r.len(), 10 * page_size() + 1);
    assert_eq!(r.mapped_len(), 11 * page_size());
    assert_eq!(r.as_ptr() as usize % page_size(), 0);
    assert_eq!(r.resident_bytes().unwrap(), 0);
    assert!(HostRegion::new(0).is_err());
    assert!(HostRegion::new(usize::MAX).is_err());
}

#[test]
fn registration_rolls_back_and_clears_errors() {
    let page = page_size();
    let r = HostRegion::new(8 * page).unwrap();
    let (m, log) = mock(Some(3));
    let err = r.register(m, page, 2 * page).unwrap_err();
    assert!(matches!(err, HostError::Register { code: 2, offset, .. } if offset == 4 * page));
    assert_eq!(log.registered.lock().unwrap().len(), 2);
    let mut undone = log.unregistered.lock().unwrap().clone();
    undone.reverse();
    let done: Vec<usize> = log.registered.lock().unwrap().iter().map(|p| p.0).collect();
    assert_eq!(undone, done);
    assert_eq!(log.cleared.load(Ordering::Relaxed), 1);
    assert!(!r.is_registered());
}

#[test]
fn unregistered_exactly_once_on_close_then_drop() {
    let page = page_size();
    let r = Arc::new(HostRegion::new(5 * page).unwrap());
    let (m, log) = mock(None);
    assert_eq!(r.register(m, page, 2 * page).unwrap(), 3);
    assert_eq!(r.registration_piece_bytes(), Some(2 * page));
    let lease = r.lease().unwrap();
    assert!(matches!(r.close(), Err(HostError::Busy { leases: 1 })));
    drop(lease);
    assert_eq!(r.close().unwrap(), 0);
    assert_eq!(r.close().unwrap(), 0);
    assert!(matches!(r.lease(), Err(HostError::Closed)));
    drop(r);
    assert_eq!(log.unregistered.lock().unwrap().len(), 3);
}

#[test]
fn unregistered_on_drop() {
    let page = page_size();
    let r = HostRegion::new(3 * page).unwrap();
    let (m, log) = mock(None);
    r.register(m, page, 1 << 30).unwrap();
    drop(r);
    assert_eq!(log.unregistered.lock().unwrap().len(), 1);
}

#[test]
fn close_releases_pages() {
    let page = page_size();
    let r = HostRegion::new(16 * page).unwrap();
    // SAFETY: the first 4 pages are inside the mapping and nothing else accesses them.
    unsafe { std::ptr::write_bytes(r.as_ptr(), 7, 4 * page) };
    assert!(r.resident_bytes().unwrap() >= 4 * page);
    r.close().unwrap();
    assert_eq!(r.resident_bytes().unwrap(), 0);
    // SAFETY: the mapping is still in place after close; the page reads back as zeros.
    let first = unsafe { r.as_ptr().read() };
    assert_eq!(first, 0);
}

#[test]
fn borrowed_memory_is_registered_copied_and_never_emptied_or_unmapped() {
    let page = page_size();
    // The owner: another region whose mapping the borrowed one uses.
    let owner = Arc::new(HostRegion::new(4 * page).unwrap());
    let base = owner.as_ptr();
    // SAFETY: the owner's mapping, written through its own pointer only here.
    unsafe { std::ptr::write_bytes(base, 0xA5, 4 * page) };
    let ptr = NonNull::new(base).unwrap();
    // Misaligned or partial pages are refused.
    // SAFETY: the memory is the owner's, kept alive by the box (not used on an error).
    let odd = unsafe { HostRegion::borrowed(ptr, page + 1, Box::new(Arc::clone(&owner))) };
    assert!(matches!(odd, Err(HostError::Geometry(_))));
    // SAFETY: as above.
    let region = Arc::new(
        unsafe { HostRegion::borrowed(ptr, 4 * page, Box::new(Arc::clone(&owner))) }.unwrap(),
    );
    assert!(region.is_borrowed());
    let (mock, log) = mock(None);
    region.register(mock, page, 2 * page).unwrap();
    assert_eq!(log.registered.lock().unwrap().len(), 2);
    assert_eq!(region.close().unwrap(), 0);
    assert_eq!(log.unregistered.lock().unwrap().len(), 2);
    drop(region);
    // Neither emptied by close() nor unmapped by drop: the owner's bytes are all there.
    // SAFETY: the owner's mapping is still alive (we hold `owner`).
    let bytes = unsafe { std::slice::from_raw_parts(base, 4 * page) };
    assert!(bytes.iter().all(|&b| b == 0xA5));
    assert_eq!(
        Arc::strong_count(&owner),
        1,
        "the borrowed region let its owner go"
    );
}

#[test]
fn a_region_within_another_closes_with_it_and_holds_it_open_while_leased() {
    let page = page_size();
    let parent = Arc::new(HostRegion::new(4 * page).unwrap());
    let ptr = NonNull::new(parent.as_ptr()).unwrap();
    let child = |parent: &Arc<HostRegion>| {
        // SAFETY: the parent's mapping, kept alive by the box and by `within`.
        let region = unsafe { HostRegion::borrowed(ptr, 2 * page, Box::new(Arc::clone(parent))) };
        Arc::new(region.unwrap().within(Arc::clone(parent)))
    };
    let inner = child(&parent);
    // A transfer on the child leases the parent too: the parent cannot close under it.
    let lease = inner.lease().unwrap();
    assert!(matches!(parent.close(), Err(HostError::Busy { leases: 1 })));
    drop(lease);
    // The parent closes; the child is closed with it and refuses leases and pinning.
    assert_eq!(parent.close().unwrap(), 0);
    assert!(inner.is_closed());
    assert!(matches!(inner.lease(), Err(HostError::Closed)));
    let (mock, _log) = mock(None);
    assert!(matches!(
        inner.register(mock, page, page),
        Err(HostError::Closed)
    ));
    // Closing the child alone leaves the parent open.
    let open = Arc::new(HostRegion::new(4 * page).unwrap());
    let ptr = NonNull::new(open.as_ptr()).unwrap();
    // SAFETY: as above.
    let region = unsafe { HostRegion::borrowed(ptr, 2 * page, Box::new(Arc::clone(&open))) };
    let inner = Arc::new(region.unwrap().within(Arc::clone(&open)));
    assert_eq!(inner.close().unwrap(), 0);
    assert!(inner.is_closed() && !open.is_closed());
    assert!(matches!(inner.lease(), Err(HostError::Closed)));
    drop(open.lease().unwrap());
}
