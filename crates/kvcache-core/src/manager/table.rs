//! The manager's chunk pool: one contiguous table of `ChunkStatus` records and vLLM's
//! allocation order.
//!
//! vLLM hands out fresh chunk ids in order (0, 1, 2, …) until every chunk was used once, then
//! reuses freed ids last-freed-first (a Python list used as a stack). Matching that order is what
//! makes our chunk ids identical to vLLM's. Records use atomics only for interior mutability:
//! the bindings export the table to Python as a read-only array while the manager keeps
//! updating it through shared references (all under the GIL; `Relaxed` costs a plain load or
//! store).

use std::sync::atomic::{AtomicI32, AtomicI64, Ordering::Relaxed};

use crate::chunk::RefCounts;

/// `ref_cnt` of a slot that holds no chunk.
pub const FREE: i32 = -2;
/// `ref_cnt` of a chunk whose store is in flight.
pub const PENDING: i32 = -1;

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
    pub fn ref_cnt(&self) -> i32 {
        self.ref_cnt.load(Relaxed)
    }

    #[inline]
    pub fn set_ref_cnt(&self, value: i32) {
        self.ref_cnt.store(value, Relaxed)
    }
}

/// Chunk id: an index into the table.
pub type ChunkId = u32;

pub struct ChunkTable {
    records: Box<[ChunkRecord]>,
    num_allocated: usize,
    free_list: Vec<ChunkId>,
}

impl ChunkTable {
    pub fn new(num_chunks: usize) -> Self {
        let records = (0..num_chunks)
            .map(|i| ChunkRecord::new(i as i64, FREE))
            .collect();
        ChunkTable {
            records,
            num_allocated: 0,
            free_list: Vec::new(),
        }
    }

    pub fn num_chunks(&self) -> usize {
        self.records.len()
    }

    /// Fresh ids never handed out plus freed ids waiting for reuse.
    pub fn num_free(&self) -> usize {
        self.free_list.len() + self.records.len() - self.num_allocated
    }

    pub fn num_allocated(&self) -> usize {
        self.num_allocated
    }

    pub fn free_list_len(&self) -> usize {
        self.free_list.len()
    }

    /// Freed ids in the order they will be reused last-to-first (vLLM's `_free_list`).
    pub fn free_list(&self) -> &[ChunkId] {
        &self.free_list
    }

    #[inline]
    pub fn record(&self, id: ChunkId) -> &ChunkRecord {
        &self.records[id as usize]
    }

    /// The whole table, for export (index = chunk id).
    pub fn records(&self) -> &[ChunkRecord] {
        &self.records
    }

    /// Hands out `n` pending chunks: fresh ids first, then the most recently freed.
    /// The caller checked `n <= num_free()`.
    pub fn allocate(&mut self, n: usize) -> Vec<ChunkId> {
        debug_assert!(n <= self.num_free());
        let fresh = n.min(self.records.len() - self.num_allocated);
        let mut ids = Vec::with_capacity(n);
        for _ in 0..fresh {
            ids.push(self.num_allocated as ChunkId);
            self.num_allocated += 1;
        }
        for _ in fresh..n {
            ids.push(self.free_list.pop().expect("caller checked the free count"));
        }
        for &id in &ids {
            self.record(id).set_ref_cnt(PENDING);
        }
        ids
    }

    pub fn free(&mut self, id: ChunkId) {
        self.record(id).set_ref_cnt(FREE);
        self.free_list.push(id);
    }

    /// Every chunk becomes fresh again, as after vLLM's `reset_cache`.
    pub fn reset(&mut self) {
        for r in self.records.iter() {
            r.set_ref_cnt(FREE);
        }
        self.num_allocated = 0;
        self.free_list.clear();
    }

    pub fn heap_bytes(&self) -> usize {
        self.records.len() * std::mem::size_of::<ChunkRecord>()
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
        let mut t = ChunkTable::new(4);
        assert_eq!(t.allocate(3), [0, 1, 2]);
        t.free(1);
        t.free(0);
        assert_eq!(t.num_free(), 3);
        // One fresh id, then the last freed first.
        assert_eq!(t.allocate(3), [3, 0, 1]);
        assert_eq!(t.num_free(), 0);
        assert_eq!(t.record(3).ref_cnt(), PENDING);
        t.reset();
        assert_eq!(t.allocate(1), [0]);
    }
}
