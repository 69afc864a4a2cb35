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

use super::{mismatch, GroupRef, HostError, HostResult, LayerGeometry, TransferLayout};

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
    // A division per block of the group's first reference only: the other references are
    // checked by multiplying back, which is what keeps a job linear at a few cycles a pointer.
    let block = offset / layer.block_stride;
    if block >= layer.num_blocks {
        Place::Outside
    } else if offset % layer.block_stride != 0 {
        Place::Misaligned
    } else {
        Place::Block(block)
    }
}

/// One group's share of the flat arrays: where its pointers start and how many blocks it has.
struct GroupSlice<'a> {
    group: usize,
    refs: &'a [GroupRef],
    first: usize,
    blocks: usize,
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
    /// Any other failure is [`HostError::Mismatch`]. Linear in the pointers; nothing is kept.
    pub fn block_ids_from_pointers(
        &self,
        ptrs: &[u64],
        sizes: &[u64],
        block_counts: &[u64],
        ref_counts: &[u64],
    ) -> HostResult<Vec<i64>> {
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
        if ptrs.len() != first || sizes.len() != first {
            return Err(mismatch(format!(
                "the counts call for {first} pointers and sizes, got {} pointers and {} sizes",
                ptrs.len(),
                sizes.len()
            )));
        }
        let mut ids = vec![0i64; total_blocks];
        let mut at = 0;
        for s in &slices {
            let out = &mut ids[at..at + s.blocks];
            at += s.blocks;
            self.group_block_ids(s, ptrs, sizes, out)?;
        }
        Ok(ids)
    }

    fn group_block_ids(
        &self,
        s: &GroupSlice<'_>,
        ptrs: &[u64],
        sizes: &[u64],
        out: &mut [i64],
    ) -> HostResult<()> {
        if s.blocks == 0 {
            return Ok(());
        }
        let n = s.blocks;
        let mut largest = 0u64;
        for (d, r) in s.refs.iter().enumerate() {
            let start = s.first + d * n;
            let (p, z) = (&ptrs[start..start + n], &sizes[start..start + n]);
            if let Some(i) = z.iter().position(|&size| size != r.bytes) {
                return Err(mismatch(format!(
                    "size {} at position {} (group {}, reference {d}) is not the reference's {} \
                     bytes",
                    z[i],
                    start + i,
                    s.group,
                    r.bytes
                )));
            }
            let layer = &self.layers[r.tensor];
            if d == 0 {
                for (i, (&address, id)) in p.iter().zip(out.iter_mut()).enumerate() {
                    match place(layer, address) {
                        Place::Block(b) => {
                            largest = largest.max(b);
                            // Below num_blocks, which the layout bounded by the address space.
                            *id = i64::try_from(b).unwrap_or(i64::MAX);
                        }
                        _ => return Err(self.bad_pointer(s, d, start + i, address, None)),
                    }
                }
                continue;
            }
            let wrong = if largest < layer.num_blocks {
                p.iter().zip(out.iter()).position(|(&address, &id)| {
                    // Below num_blocks: the layout checked that such an address fits.
                    let b = u64::try_from(id).unwrap_or(0);
                    address != layer.base + b * layer.block_stride
                })
            } else {
                // The first reference names a block this (smaller) tensor does not have.
                out.iter()
                    .position(|&id| u64::try_from(id).map_or(true, |b| b >= layer.num_blocks))
            };
            if let Some(i) = wrong {
                return Err(self.bad_pointer(s, d, start + i, p[i], Some(out[i])));
            }
        }
        Ok(())
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
