//! The manager's chunk pool: `ChunkStatus` records in one table, and vLLM's allocation order.
//!
//! vLLM hands out fresh chunk ids in order (0, 1, 2, …) until every chunk was used once, then
//! reuses freed ids last-freed-first (a Python list used as a stack). Matching that order is what
//! makes our chunk ids identical to vLLM's. The table grows with the ids handed out, as vLLM's
//! chunk objects do: a cache of many chunks costs nothing until it fills, and growth that the
//! system cannot back is an error ([`CoreError::OutOfMemory`]) reported before anything
//! changed, never an abort. Records use atomics only for interior mutability (`Relaxed` is a
//! plain load or store): policies read counts through a shared reference while the manager
//! updates them.

use std::sync::atomic::{AtomicI32, AtomicI64, Ordering::Relaxed};

use crate::chunk::RefCounts;
use crate::error::{CoreError, CoreResult};

/// `ref_cnt` of a slot that holds no chunk.
pub const FREE: i32 = -2;
/// `ref_cnt` of a chunk whose store is in flight.
pub(crate) const PENDING: i32 = -1;

/// vLLM's `ChunkStatus` layout: int32 `ref_cnt` at 0, int64 `chunk_id` at 8, 16 bytes.
#[repr(C)]
pub struct ChunkRecord {
    pub ref_cnt: AtomicI32,
    _pad: AtomicI32,
    pub chunk_id: AtomicI64,
}

const _: () = assert!(std::mem::size_of::<ChunkRecord>() == 16);

impl ChunkRecord {
    pub fn new(chunk_id: i64, ref_cnt: i32) -> Self {
        ChunkRecord {
            ref_cnt: AtomicI32::new(ref_cnt),
            _pad: AtomicI32::new(0),
            chunk_id: AtomicI64::new(chunk_id),
        }
    }

    #[inline]
    pub(crate) fn ref_cnt(&self) -> i32 {
        self.ref_cnt.load(Relaxed)
    }

    #[inline]
    pub(crate) fn set_ref_cnt(&self, value: i32) {
        self.ref_cnt.store(value, Relaxed)
    }

    #[inline]
    pub(crate) fn chunk_id(&self) -> i64 {
        self.chunk_id.load(Relaxed)
    }
}

/// A record of the manager's table: readable by anyone, written only by the manager (so
/// nothing outside it can change a count behind its bookkeeping).
#[repr(transparent)]
pub struct TableRecord(ChunkRecord);

impl TableRecord {
    #[inline]
    pub fn ref_cnt(&self) -> i32 {
        self.0.ref_cnt()
    }

    #[inline]
    pub fn chunk_id(&self) -> i64 {
        self.0.chunk_id()
    }

    #[inline]
    pub(crate) fn set_ref_cnt(&self, value: i32) {
        self.0.set_ref_cnt(value);
    }
}

/// Chunk id: an index into the table.
pub type ChunkId = u32;

/// The largest cache the manager addresses: chunk ids reach vLLM as `np.int32` arrays
/// (`CPULoadStoreSpec.block_ids`), so every id must fit in an `i32`.
pub const MAX_CHUNKS: usize = i32::MAX as usize;

pub struct ChunkTable {
    /// The records of every id handed out since the last reset (index = chunk id).
    records: Vec<TableRecord>,
    num_chunks: usize,
    free_list: Vec<ChunkId>,
}

impl ChunkTable {
    /// A table for `num_chunks` chunks; no record exists until its id is first handed out.
    pub(crate) fn new(num_chunks: usize) -> CoreResult<Self> {
        if num_chunks > MAX_CHUNKS {
            return Err(CoreError::TooManyChunks {
                requested: num_chunks,
                max: MAX_CHUNKS,
            });
        }
        Ok(ChunkTable {
            records: Vec::new(),
            num_chunks,
            free_list: Vec::new(),
        })
    }

    pub(crate) fn num_chunks(&self) -> usize {
        self.num_chunks
    }

    /// Fresh ids never handed out plus freed ids waiting for reuse.
    pub(crate) fn num_free(&self) -> usize {
        self.free_list.len() + self.num_chunks - self.records.len()
    }

    /// Ids handed out since the last reset (in use or freed).
    pub fn num_allocated(&self) -> usize {
        self.records.len()
    }

    /// Chunks holding data (pending, ready or pinned).
    pub(crate) fn num_resident(&self) -> usize {
        self.records.len() - self.free_list.len()
    }

    /// Freed ids in the order they will be reused last-to-first (vLLM's `_free_list`).
    pub fn free_list(&self) -> &[ChunkId] {
        &self.free_list
    }

    #[inline]
    pub fn record(&self, id: ChunkId) -> &TableRecord {
        &self.records[id as usize]
    }

    /// The records of the ids handed out so far (index = chunk id); every later id is free.
    pub fn records(&self) -> &[TableRecord] {
        &self.records
    }

    /// Makes sure [`allocate`](Self::allocate)`(n)` will not need memory it cannot get.
    /// `n <= num_free()`.
    pub(crate) fn reserve(&mut self, n: usize) -> CoreResult<()> {
        let len = self.records.len();
        let fresh = n.min(self.num_chunks - len);
        if fresh <= self.records.capacity() - len {
            return Ok(());
        }
        // Doubling keeps growth amortised; the cap keeps a full table exactly `num_chunks`
        // records long, so a full cache pays 16 bytes per chunk, as a table allocated up
        // front would.
        let target = (len + fresh)
            .max(len.saturating_mul(2))
            .min(self.num_chunks);
        self.records
            .try_reserve_exact(target - len)
            .map_err(|_| CoreError::OutOfMemory {
                what: "the chunk table",
            })
    }

    /// Hands out `n` pending chunks: fresh ids first, then the most recently freed. The caller
    /// checked `n <= num_free()` and [`reserve`](Self::reserve)d room.
    pub(crate) fn allocate(&mut self, n: usize) -> Vec<ChunkId> {
        debug_assert!(n <= self.num_free());
        let fresh = n.min(self.num_chunks - self.records.len());
        let mut ids = Vec::with_capacity(n);
        for _ in 0..fresh {
            let id = ChunkId::try_from(self.records.len()).expect("ids fit: num_chunks <= MAX");
            self.records
                .push(TableRecord(ChunkRecord::new(i64::from(id), PENDING)));
            ids.push(id);
        }
        for _ in fresh..n {
            let id = self.free_list.pop().expect("caller checked the free count");
            self.record(id).set_ref_cnt(PENDING);
            ids.push(id);
        }
        ids
    }

    pub(crate) fn free(&mut self, id: ChunkId) {
        self.record(id).set_ref_cnt(FREE);
        self.free_list.push(id);
    }

    /// Every chunk becomes fresh again, as after vLLM's `reset_cache`.
    pub(crate) fn reset(&mut self) {
        self.records.clear();
        self.free_list.clear();
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.records.capacity() * std::mem::size_of::<TableRecord>()
            + self.free_list.capacity() * std::mem::size_of::<ChunkId>()
    }
}

impl RefCounts<ChunkId> for ChunkTable {
    #[inline]
    fn ref_cnt(&self, chunk: &ChunkId) -> i32 {
        self.record(*chunk).ref_cnt()
    }

    #[inline]
    fn prefetch(&self, chunk: &ChunkId) {
        crate::slab::prefetch(self.record(*chunk));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_follows_vllm_order() {
        let mut t = ChunkTable::new(4).unwrap();
        t.reserve(3).unwrap();
        assert_eq!(t.allocate(3), [0, 1, 2]);
        t.free(1);
        t.free(0);
        assert_eq!(t.num_free(), 3);
        // One fresh id, then the last freed first.
        t.reserve(3).unwrap();
        assert_eq!(t.allocate(3), [3, 0, 1]);
        assert_eq!(t.num_free(), 0);
        assert_eq!(t.record(3).ref_cnt(), PENDING);
        t.reset();
        assert_eq!(t.allocate(1), [0]);
    }

    #[test]
    fn a_full_table_holds_exactly_num_chunks_records() {
        let mut t = ChunkTable::new(1000).unwrap();
        for _ in 0..100 {
            t.reserve(10).unwrap();
            t.allocate(10);
        }
        assert_eq!(t.records.capacity(), 1000);
        assert_eq!(t.num_free(), 0);
    }

    #[test]
    fn a_huge_table_costs_nothing_until_used() {
        let t = ChunkTable::new(MAX_CHUNKS).unwrap();
        assert_eq!(t.heap_bytes(), 0);
        assert_eq!(t.num_free(), MAX_CHUNKS);
        assert!(matches!(
            ChunkTable::new(MAX_CHUNKS + 1),
            Err(CoreError::TooManyChunks { .. })
        ));
    }
}
