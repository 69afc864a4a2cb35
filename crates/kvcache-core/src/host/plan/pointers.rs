//! Device pointers -> block ids.
//!
//! vLLM 0.34's connector hands its worker one device address per `(group, reference, block)`
//! (vLLM's `DevicePointers`: the flat arrays in group, then reference, then block order, and
//! per group its block count and reference count) instead of block ids. The addresses come
//! from another component, so they are not trusted: [`TransferLayout::block_ids_from_pointers`]
//! accepts them only when each one is the start of a block of the tensor its reference names,
//! every reference of a group names the same blocks, every size is the reference's byte count
//! and every count matches the layout. The block ids it returns then go through the ordinary
//! [`TransferLayout::validate`], so a pointer job is planned exactly like the block-id job it
//! stands for.

use super::{mismatch, to_u64, GroupRef, HostError, HostResult, LayerGeometry, TransferLayout};

/// Where one address falls in a tensor: the block it starts, or why it starts none.
enum Place {
    Block(u64),
    Outside,
    Misaligned,
}

fn place(layer: &LayerGeometry, address: u64) -> Place {
    let Some(offset) = address.checked_sub(layer.base) else {
        return Place::Outside;
    };
    // Only for naming what is wrong: the fast pass divides by a reciprocal instead.
    let block = offset / layer.block_stride;
    if block >= layer.num_blocks {
        Place::Outside
    } else if offset % layer.block_stride != 0 {
        Place::Misaligned
    } else {
        Place::Block(block)
    }
}

/// Division by a fixed divisor without a division instruction per call (a few tens of cycles
/// each, the largest cost of a long job otherwise): a multiply by `floor((2^64 - 1) / d)`
/// gives the quotient or up to two less, and the remainder test corrects it.
struct Reciprocal {
    divisor: u64,
    magic: u64,
}

impl Reciprocal {
    fn new(divisor: u64) -> Self {
        Reciprocal {
            divisor,
            magic: u64::MAX / divisor,
        }
    }

    /// `x / divisor`, exactly.
    #[inline(always)]
    fn quotient(&self, x: u64) -> u64 {
        let wide = (u128::from(x) * u128::from(self.magic)) >> 64;
        // The high half of a 128-bit product of two 64-bit values fits in 64 bits.
        let mut q = u64::try_from(wide).unwrap_or(u64::MAX);
        // q <= x / divisor, so q * divisor <= x cannot overflow.
        while x - q * self.divisor >= self.divisor {
            q += 1;
        }
        q
    }
}

/// One group's share of the flat arrays: where its pointers start and how many blocks it has.
struct GroupSlice<'a> {
    group: usize,
    refs: &'a [GroupRef],
    first: usize,
    blocks: usize,
}

/// What a pointer job's counts call for ([`TransferLayout::pointer_counts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PointerCounts {
    /// Entries `ptrs` and `sizes` must each hold.
    pub pointers: usize,
    /// Block ids the job names, all groups together.
    pub blocks: usize,
}

impl PointerCounts {
    /// Arrays of `ptrs` and `sizes` entries hold what the counts call for, else a mismatch.
    pub fn check_lengths(&self, ptrs: usize, sizes: usize) -> HostResult<()> {
        let expected = self.pointers;
        if ptrs != expected || sizes != expected {
            return Err(mismatch(format!(
                "the counts call for {expected} pointers and sizes, got {ptrs} pointers and \
                 {sizes} sizes"
            )));
        }
        Ok(())
    }
}

impl TransferLayout {
    /// The device block ids (group after group) that `ptrs` address, checked completely first:
    ///
    /// - `block_counts` and `ref_counts` have one entry per group, and `ref_counts[g]` is the
    ///   number of references group `g` was built with (repeats included);
    /// - `ptrs` and `sizes` hold exactly `sum(block_counts[g] * ref_counts[g])` entries;
    /// - every size is its reference's byte count;
    /// - every pointer is `base + b * block_stride` of its reference's tensor with
    ///   `0 <= b < num_blocks` (else [`HostError::PointerOutOfRange`], or a mismatch when it
    ///   lies inside the tensor between two block starts);
    /// - every reference of a group names the same block at each position.
    ///
    /// A group without references (a pipeline stage that holds none of its layers) has no
    /// pointers, so its blocks cannot be read back: they come out as block 0, placeholders
    /// that no copy uses, and their count is bounded by what the pool's chunks can hold
    /// (`num_chunks * blocks_per_chunk`), since nothing else bounds a caller's number there.
    ///
    /// Any other failure is [`HostError::Mismatch`]; an output the allocator refuses is
    /// [`HostError::Alloc`]. Linear in the pointers; nothing is kept.
    pub fn block_ids_from_pointers(
        &self,
        ptrs: &[u64],
        sizes: &[u64],
        block_counts: &[u64],
        ref_counts: &[u64],
    ) -> HostResult<Vec<i64>> {
        let (slices, counts) = self.pointer_groups(block_counts, ref_counts)?;
        counts.check_lengths(ptrs.len(), sizes.len())?;
        let total_blocks = counts.blocks;
        // Bounded above by the pointers plus the pool's capacity per reference-less group,
        // which can still be more than the allocator grants.
        let mut ids = Vec::new();
        ids.try_reserve_exact(total_blocks)
            .map_err(|_| HostError::Alloc {
                what: "block ids",
                bytes: to_u64(total_blocks).saturating_mul(8),
            })?;
        ids.resize(total_blocks, 0i64);
        let mut at = 0;
        for s in &slices {
            let out = &mut ids[at..at + s.blocks];
            at += s.blocks;
            self.group_block_ids(s, ptrs, sizes, out)?;
        }
        Ok(ids)
    }

    /// What `block_counts` and `ref_counts` call for, checked against the layout (see
    /// [`Self::block_ids_from_pointers`]): how many pointers (and sizes) the job must hold and
    /// how many block ids it names. Reads no pointer, so a caller can check the arrays' lengths
    /// before it copies or reads any of them.
    pub fn pointer_counts(
        &self,
        block_counts: &[u64],
        ref_counts: &[u64],
    ) -> HostResult<PointerCounts> {
        Ok(self.pointer_groups(block_counts, ref_counts)?.1)
    }

    /// Each group's share of the flat arrays, and what they add up to.
    fn pointer_groups(
        &self,
        block_counts: &[u64],
        ref_counts: &[u64],
    ) -> HostResult<(Vec<GroupSlice<'_>>, PointerCounts)> {
        let groups = self.groups.len();
        if block_counts.len() != groups || ref_counts.len() != groups {
            return Err(mismatch(format!(
                "{} group block counts and {} reference counts for a layout of {groups} groups",
                block_counts.len(),
                ref_counts.len()
            )));
        }
        let mut slices = Vec::with_capacity(groups);
        let (mut first, mut total_blocks) = (0usize, 0usize);
        for (g, (group, (&blocks, &refs))) in self
            .groups
            .iter()
            .zip(block_counts.iter().zip(ref_counts))
            .enumerate()
        {
            if usize::try_from(refs).ok() != Some(group.given.len()) {
                return Err(mismatch(format!(
                    "group {g} has {} references, the pointers give {refs}",
                    group.given.len()
                )));
            }
            let blocks = usize::try_from(blocks)
                .map_err(|_| mismatch(format!("group {g}: {blocks} blocks")))?;
            let most = self.host.num_chunks.saturating_mul(self.bpc);
            if group.given.is_empty() && to_u64(blocks) > most {
                return Err(mismatch(format!(
                    "group {g} has no references here and names {blocks} blocks, more than the \
                     pool's {} chunks of {} blocks hold",
                    self.host.num_chunks, self.bpc
                )));
            }
            let count = blocks.checked_mul(group.given.len());
            let end = count.and_then(|c| c.checked_add(first));
            let (Some(end), Some(total)) = (end, total_blocks.checked_add(blocks)) else {
                return Err(mismatch(format!("group {g}: pointer counts overflow")));
            };
            slices.push(GroupSlice {
                group: g,
                refs: &group.given,
                first,
                blocks,
            });
            first = end;
            total_blocks = total;
        }
        let counts = PointerCounts {
            pointers: first,
            blocks: total_blocks,
        };
        Ok((slices, counts))
    }

    fn group_block_ids(
        &self,
        s: &GroupSlice<'_>,
        ptrs: &[u64],
        sizes: &[u64],
        out: &mut [i64],
    ) -> HostResult<()> {
        let n = s.blocks;
        if n == 0 || s.refs.is_empty() {
            // No reference: no pointer to read a block from; `out` keeps its placeholders.
            return Ok(());
        }
        // The fast pass only accumulates whether anything is wrong (xor-or, no early exit, so
        // the loops vectorise); after a failure, `diagnose` finds and names the first culprit.
        // The first reference's pointers give the blocks: offset from the tensor's base, a
        // multiple of its stride, below its last block.
        let first = &self.layers[s.refs[0].tensor];
        let stride = first.block_stride;
        let last = (first.num_blocks - 1) * stride;
        let inverse = Reciprocal::new(stride);
        let (p0, z0) = (&ptrs[s.first..s.first + n], &sizes[s.first..s.first + n]);
        let bytes0 = s.refs[0].bytes;
        let mut offsets = vec![0u64; n];
        let (mut ok, mut wrong, mut largest) = (true, 0u64, 0u64);
        for (((&address, &size), id), offset) in p0
            .iter()
            .zip(z0)
            .zip(out.iter_mut())
            .zip(offsets.iter_mut())
        {
            let o = address.wrapping_sub(first.base); // below the base: wraps past `last`
            let b = inverse.quotient(o);
            ok &= o <= last && b * stride == o;
            wrong |= size ^ bytes0;
            largest = largest.max(b);
            *offset = o;
            // Below num_blocks when `ok`, which the layout bounded by the address space.
            *id = i64::try_from(b).unwrap_or(i64::MAX);
        }
        ok &= wrong == 0;
        // Every other reference must name the same blocks in its own tensor.
        for (d, r) in s.refs.iter().enumerate().skip(1) {
            if !ok {
                break;
            }
            let start = s.first + d * n;
            let (p, z) = (&ptrs[start..start + n], &sizes[start..start + n]);
            let layer = &self.layers[r.tensor];
            let (base, bytes) = (layer.base, r.bytes);
            let wrong = if largest >= layer.num_blocks {
                1 // the first reference names a block this (smaller) tensor does not have
            } else if layer.block_stride == stride {
                // The usual case (every layer alike): an addition per pointer, no multiply.
                p.iter()
                    .zip(z)
                    .zip(&offsets)
                    .fold(0u64, |acc, ((&a, &size), &o)| {
                        acc | (a ^ (base + o)) | (size ^ bytes)
                    })
            } else {
                // Below num_blocks: the layout checked that such an address fits.
                let at = |id: i64| base + u64::try_from(id).unwrap_or(0) * layer.block_stride;
                p.iter()
                    .zip(z)
                    .zip(out.iter())
                    .fold(0u64, |acc, ((&a, &size), &id)| {
                        acc | (a ^ at(id)) | (size ^ bytes)
                    })
            };
            ok &= wrong == 0;
        }
        if ok {
            Ok(())
        } else {
            Err(self.diagnose(s, ptrs, sizes, out))
        }
    }

    /// The first thing wrong with a group the fast pass refused, in a fixed order: sizes, then
    /// the first reference's pointers, then each other reference's. `out` holds the blocks
    /// the first reference names.
    fn diagnose(&self, s: &GroupSlice<'_>, ptrs: &[u64], sizes: &[u64], out: &[i64]) -> HostError {
        let n = s.blocks;
        for (d, r) in s.refs.iter().enumerate() {
            let start = s.first + d * n;
            let z = &sizes[start..start + n];
            if let Some(i) = z.iter().position(|&size| size != r.bytes) {
                return mismatch(format!(
                    "size {} at position {} (group {}, reference {d}) is not the reference's {} \
                     bytes",
                    z[i],
                    start + i,
                    s.group,
                    r.bytes
                ));
            }
        }
        let first = &self.layers[s.refs[0].tensor];
        let p0 = &ptrs[s.first..s.first + n];
        if let Some(i) = p0
            .iter()
            .position(|&a| !matches!(place(first, a), Place::Block(_)))
        {
            return self.bad_pointer(s, 0, s.first + i, p0[i], None);
        }
        for (d, r) in s.refs.iter().enumerate().skip(1) {
            let start = s.first + d * n;
            let p = &ptrs[start..start + n];
            let layer = &self.layers[r.tensor];
            let named = |id: i64| u64::try_from(id).ok().filter(|&b| b < layer.num_blocks);
            let wrong = p.iter().zip(out).position(|(&a, &id)| {
                // Below num_blocks: the layout checked that such an address fits.
                named(id).is_none_or(|b| a != layer.base + b * layer.block_stride)
            });
            if let Some(i) = wrong {
                return self.bad_pointer(s, d, start + i, p[i], Some(out[i]));
            }
        }
        mismatch(format!("group {}: the pointers are inconsistent", s.group))
    }

    /// The error for the pointer at `position` (reference `d` of the group); `expected` is the
    /// block the group's first reference names there (None for the first reference itself).
    fn bad_pointer(
        &self,
        s: &GroupSlice<'_>,
        d: usize,
        position: usize,
        address: u64,
        expected: Option<i64>,
    ) -> HostError {
        let layer = &self.layers[s.refs[d].tensor];
        let at = format!(
            "device pointer {address:#x} at position {position} (group {}, reference {d})",
            s.group
        );
        match (place(layer, address), expected) {
            (Place::Outside, _) => HostError::PointerOutOfRange {
                address,
                position,
                group: s.group,
                reference: d,
                start: layer.base,
                // The end of its last page (the layout checked that it does not overflow).
                end: layer.base + (layer.num_blocks - 1) * layer.block_stride + layer.page_bytes,
            },
            (Place::Misaligned, _) => mismatch(format!(
                "{at} is inside its tensor but not at a block start ({} bytes apart)",
                layer.block_stride
            )),
            (Place::Block(b), Some(first)) => mismatch(format!(
                "{at} names block {b}, but the group's first reference names block {first} there"
            )),
            (Place::Block(b), None) => mismatch(format!("{at} names block {b}")),
        }
    }
}

#[cfg(test)]
mod tests;
