//! What a copy kernel that computes page addresses itself needs, and the proof that it cannot
//! fault.
//!
//! The kernel (Triton, `python/kvcache/transfer/_kernel.py`) reads, per block of a group, three
//! integers: the device block id `b`, the host address of the chunk holding it `c`, and its
//! slot `s` in that chunk; and per reference of the group five: the tensor's device base,
//! block stride, segment offset in a chunk, page slot bytes, and bytes copied. It then moves
//! `bytes / 8` eight-byte words between `base + b * stride` and `c + offset + s * slot_bytes`.
//! A fault there (an address outside memory, or a misaligned 8-byte access) loses the CUDA
//! context for the whole process, so nothing is launched that has not been proven safe:
//!
//! - [`TransferLayout::kernel_problem`], once per engine and group: every base, stride,
//!   offset, slot size and copy size, the pool's base and the chunk stride are multiples of
//!   8 (so every address the kernel forms from them is), and the copy size is a multiple of 8
//!   (the kernel moves whole words: a tail would be silently left behind);
//! - the layout's construction proved each tensor's blocks `[0, num_blocks)` and each
//!   segment's `blocks_per_chunk` slots lie inside their tensor and chunk, and `bytes <=
//!   page_bytes`;
//! - [`TransferLayout::block_table`], per job: every block id below every referenced tensor's
//!   block count, every chunk id below the pool's, every slot below `blocks_per_chunk` (the
//!   job's validation checked the same; this re-checks exactly what the kernel is handed).
//!
//! Together: every word the kernel touches is aligned and inside a tensor's block or a pool
//! chunk's segment, in `O(blocks + references)` per job, not per page.

use super::{HostError, HostResult, Request, TransferLayout};

/// The kernel's word size: addresses and sizes must be multiples of it.
const WORD: u64 = 8;

impl TransferLayout {
    /// Why the copy kernel cannot serve `group` of this layout (None: it can): the first
    /// address or size it would use that is not a multiple of 8 bytes.
    pub fn kernel_problem(&self, group: usize) -> HostResult<Option<String>> {
        let g = self.groups.get(group).ok_or(HostError::NoSuchGroup {
            group,
            groups: self.groups.len(),
        })?;
        let misaligned = |what: String, v: u64| {
            (v % WORD != 0).then(|| format!("{what} ({v}) is not a multiple of 8 bytes"))
        };
        if let Some(p) = misaligned("the pool's address".into(), self.host.base) {
            return Ok(Some(p));
        }
        if let Some(p) = misaligned("the chunk size".into(), self.host.chunk_stride) {
            return Ok(Some(p));
        }
        for r in &g.refs {
            let l = &self.layers[r.tensor];
            let t = r.tensor;
            let checks = [
                (format!("tensor {t}'s device address"), l.base),
                (format!("tensor {t}'s block stride"), l.block_stride),
                (format!("tensor {t}'s segment offset"), self.host_offsets[t]),
                (format!("tensor {t}'s page slot"), l.page_bytes),
                (format!("tensor {t}'s bytes per block"), r.bytes),
            ];
            for (what, v) in checks {
                if let Some(p) = misaligned(what, v) {
                    return Ok(Some(p));
                }
            }
        }
        Ok(None)
    }

    /// Per-block addressing for the kernel: for `group` of `req`, its blocks' device ids, the
    /// host address of the chunk holding each block, and the block's slot in that chunk
    /// (three arrays of the group's length, appended to `out` in that order). Every index is
    /// re-checked against what the kernel's addresses are proven for (module docs); a value
    /// outside is [`HostError::OutOfRange`] and nothing is appended. Linear in blocks.
    pub fn block_table(&self, req: &Request, group: usize, out: &mut Vec<i64>) -> HostResult<()> {
        let p = req.parts.get(group).ok_or(HostError::NoSuchGroup {
            group,
            groups: req.parts.len(),
        })?;
        let g = &self.groups[group];
        let bpc = self.blocks_per_chunk;
        let ids = &req.gpu_ids[p.gpu..p.gpu + p.blocks];
        let chunks = &req.chunk_ids[p.chunk..p.chunk + p.chunks];
        // Every referenced tensor has at least `g.num_blocks` blocks.
        Self::check_range(ids, g.num_blocks, "block", p.gpu)?;
        Self::check_range(chunks, self.host.num_chunks, "chunk", p.chunk)?;
        if p.blocks > 0 && p.skip + p.blocks > p.chunks * bpc {
            return Err(HostError::Mismatch(format!(
                "group {group}: {} blocks from slot {} do not fit in {} chunks",
                p.blocks, p.skip, p.chunks
            )));
        }
        let signed = |v: u64| i64::try_from(v).map_err(|_| HostError::Unaddressable { value: v });
        let start = out.len();
        out.reserve(p.blocks.saturating_mul(3));
        out.extend_from_slice(ids);
        let filled = (p.skip..p.skip + p.blocks).try_for_each(|slot| {
            // Below num_chunks (checked above), so the address fits (the layout checked the
            // pool's end).
            let chunk = u64::try_from(chunks[slot / bpc]).unwrap_or(0);
            out.push(signed(self.host.base + chunk * self.host.chunk_stride)?);
            Ok(())
        });
        if let Err(e) = filled {
            out.truncate(start);
            return Err(e);
        }
        for slot in p.skip..p.skip + p.blocks {
            out.push(i64::try_from(slot % bpc).unwrap_or(0));
        }
        Ok(())
    }

    /// A group's distinct references as `(device base, block stride, segment offset in the
    /// chunk, page slot bytes, bytes copied)` per tensor, for [`Self::block_table`]'s kernel.
    pub fn group_refs(&self, group: usize) -> HostResult<Vec<[u64; 5]>> {
        let g = self.groups.get(group).ok_or(HostError::NoSuchGroup {
            group,
            groups: self.groups.len(),
        })?;
        Ok(g.refs
            .iter()
            .map(|r| {
                let l = &self.layers[r.tensor];
                [
                    l.base,
                    l.block_stride,
                    self.host_offsets[r.tensor],
                    l.page_bytes,
                    r.bytes,
                ]
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{
        Direction, GroupRef, GroupSpan, HostGeometry, LayerGeometry, PlanScratch, TransferLayout,
    };

    fn layout(page: u64, chunk_stride: u64, host_base: u64) -> TransferLayout {
        let layer = |base: u64| LayerGeometry {
            base,
            block_stride: page,
            page_bytes: page,
            num_blocks: 8,
            segment: base,
        };
        TransferLayout::with_groups(
            vec![layer(1 << 20), layer(1 << 21)],
            vec![0, 2 * page],
            vec![vec![
                GroupRef {
                    tensor: 0,
                    bytes: page,
                },
                GroupRef {
                    tensor: 1,
                    bytes: page,
                },
            ]],
            2,
            HostGeometry {
                base: host_base,
                num_chunks: 4,
                chunk_stride,
                split_bytes: 0,
            },
        )
        .unwrap()
    }

    #[test]
    fn every_address_the_kernel_forms_must_be_word_aligned() {
        assert_eq!(layout(64, 256, 1 << 30).kernel_problem(0).unwrap(), None);
        // A chunk size that is not a multiple of 8 moves every chunk after the first off
        // alignment, although each tensor's own geometry is aligned.
        let odd_chunks = layout(64, 260, 1 << 30).kernel_problem(0).unwrap();
        assert!(odd_chunks.unwrap().contains("chunk size"));
        assert!(layout(64, 256, (1 << 30) + 4)
            .kernel_problem(0)
            .unwrap()
            .unwrap()
            .contains("pool's address"));
        // Pages of 60 bytes: a tail the kernel's whole words would leave behind.
        assert!(layout(60, 256, 1 << 30)
            .kernel_problem(0)
            .unwrap()
            .is_some());
        assert!(layout(64, 256, 1 << 30).kernel_problem(1).is_err());
    }

    #[test]
    fn the_block_table_is_what_the_job_names() {
        let lay = layout(64, 256, 1 << 30);
        let spans = vec![GroupSpan {
            blocks: 3,
            first_index: 1,
        }];
        let req = lay
            .validate(
                Direction::Load,
                vec![5, 2, 7],
                vec![3, 1],
                spans,
                &mut PlanScratch::default(),
            )
            .unwrap();
        let mut out = vec![];
        lay.block_table(&req, 0, &mut out).unwrap();
        let chunk = |c: i64| (1 << 30) + c * 256;
        assert_eq!(out, [5, 2, 7, chunk(3), chunk(1), chunk(1), 1, 0, 1]);
        assert!(lay.block_table(&req, 1, &mut out).is_err());
    }
}
