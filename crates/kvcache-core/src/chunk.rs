//! How a policy reads a chunk's reference count.
//!
//! vLLM's `ChunkStatus` carries `ref_cnt`: −1 while the store is in flight, 0 when the chunk is
//! idle and may be evicted, > 0 while loads read it. The manager owns and mutates the counts;
//! policies only read them (ARC to pick victims and to tell a pending chunk from a ready one,
//! LRU to decide whether a new entry starts evictable). Where the count lives depends on the
//! chunk type: inside a Python object, or in the manager's contiguous table. [`RefCounts`]
//! abstracts that without a per-entry callback into Python.

/// Reads the reference count of a chunk handle of type `C`.
pub trait RefCounts<C> {
    fn ref_cnt(&self, chunk: &C) -> i32;

    #[inline]
    fn is_ready(&self, chunk: &C) -> bool {
        self.ref_cnt(chunk) >= 0
    }

    /// Hints that `chunk`'s count will be read soon (see [`crate::prefetch`]).
    #[inline]
    fn prefetch(&self, chunk: &C) {
        let _ = chunk;
    }
}

/// A chunk handle that knows its own count.
pub trait HasRefCnt {
    fn ref_cnt(&self) -> i32;

    /// Hints that the count will be read soon.
    #[inline]
    fn prefetch(&self) {}
}

/// [`RefCounts`] for handles that carry their count ([`HasRefCnt`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct SelfCounted;

impl<C: HasRefCnt> RefCounts<C> for SelfCounted {
    #[inline]
    fn ref_cnt(&self, chunk: &C) -> i32 {
        chunk.ref_cnt()
    }

    #[inline]
    fn prefetch(&self, chunk: &C) {
        chunk.prefetch()
    }
}

/// A plain chunk for tests and fuzzing: an id and a shared, mutable count.
#[cfg(any(test, feature = "testing"))]
#[derive(Clone, Debug)]
pub struct TestChunk {
    pub id: u64,
    pub ref_cnt: std::rc::Rc<std::cell::Cell<i32>>,
}

#[cfg(any(test, feature = "testing"))]
impl TestChunk {
    pub fn new(id: u64, ref_cnt: i32) -> Self {
        TestChunk {
            id,
            ref_cnt: std::rc::Rc::new(std::cell::Cell::new(ref_cnt)),
        }
    }
    pub fn set(&self, ref_cnt: i32) {
        self.ref_cnt.set(ref_cnt)
    }
}

#[cfg(any(test, feature = "testing"))]
impl HasRefCnt for TestChunk {
    fn ref_cnt(&self) -> i32 {
        self.ref_cnt.get()
    }
}
