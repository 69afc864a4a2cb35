//! Copy plans: `(block ids, chunk ids, group spans)` -> `(src, dst, len)` runs.
//!
//! # Chunk layout
//! A chunk holds, for every KV tensor, a *segment* of `blocks_per_chunk` page slots of
//! `page_bytes` (the tensor's padded page) each, at the tensor's `host_offset` inside the
//! chunk: by default the tensors back to back, `[T0: b0 | b1 | ...][T1: b0 | ...]...`
//! (tensor-major, as vLLM's worker lays out each rank's slot). Tensor-major because device
//! memory is tensor-major too (one tensor per layer, block-indexed): when a chunk's blocks are
//! consecutive on the device, each segment is a single copy instead of one per block.
//!
//! # Groups
//! A layout has one or more KV-cache *groups*; a group copies, for each of its blocks, a
//! prefix of `bytes <= page_bytes` of the page slot of each tensor it references (a padded
//! page moves only its payload). A job lists its blocks group by group; for each group its
//! span gives the number of blocks and the logical index of the first one. The first block
//! enters its first chunk at slot `first_index % blocks_per_chunk` (the *skip*), and the last
//! chunk may be short: a group of `n` blocks with skip `s` spans `ceil((s + n) / bpc)` chunks.
//! This is vLLM 0.33.0's `GPULoadStoreSpec(group_sizes, block_indices)` contract.
//!
//! # Coalescing
//! Pages are enumerated group by group, chunk by chunk, tensor by tensor, block by block, and a
//! page is merged into the previous run when it continues it on *both* sides. That merges,
//! with no special cases: consecutive blocks within a segment; consecutive chunks when there
//! is a single tensor; and whole chunks when the tensors are interleaved views of one
//! allocation (a "cross-layer" block layout) and `blocks_per_chunk == 1`. Runs never cross a
//! host registration boundary, nor join two tensors that live in different device allocations
//! (copy engines may reject a range that spans two allocations even when they are adjacent).
//!
//! # Validation
//! Every id and span is checked (range, counts, and no destination written twice in one job)
//! before the plan is built, so a bad request has no effect at all.

use super::error::{HostError, HostResult};

/// One KV tensor's device-side geometry: block `b`'s page slot is `page_bytes` bytes at
/// `base + b * block_stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerGeometry {
    pub base: u64,
    pub block_stride: u64,
    pub page_bytes: u64,
    pub num_blocks: u64,
    /// Identifies the allocation the tensor lives in; runs join two tensors only when equal.
    pub segment: u64,
}

/// One reference of a group to a tensor: each block copies the first `bytes` of its page slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupRef {
    pub tensor: usize,
    pub bytes: u64,
}

/// Where chunks live in host memory: `num_chunks` chunks, `chunk_stride` bytes apart, from
/// `base`. `split_bytes` is the host registration piece size (0 if unregistered or one piece);
/// it must be a multiple of `chunk_stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostGeometry {
    pub base: u64,
    pub num_chunks: u64,
    pub chunk_stride: u64,
    pub split_bytes: u64,
}

/// One group's part of a job: `blocks` device blocks, the first at logical block index
/// `first_index` (only `first_index % blocks_per_chunk` matters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupSpan {
    pub blocks: usize,
    pub first_index: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Device blocks -> host chunks.
    Store,
    /// Host chunks -> device blocks.
    Load,
}

/// Reusable bitmaps for duplicate detection, kept between plans to avoid reallocating.
#[derive(Default)]
pub struct PlanScratch {
    bits: Vec<u64>,
}

/// Bit `id % 64` of word `id / 64`. Ids are validated non-negative and below the universe
/// (whose words fit in memory), so the conversions cannot fail.
#[inline(always)]
fn word_bit(id: i64) -> (usize, u64) {
    let id = u64::try_from(id).unwrap_or(0);
    (usize::try_from(id / 64).unwrap_or(0), 1 << (id % 64))
}

impl PlanScratch {
    /// Marks the ids of every range of `ids`; on the first repeated id, returns its position.
    /// Leaves the bitmap clean either way. Ids must already be in `[0, universe)`.
    fn find_duplicate(
        &mut self,
        ids: &[i64],
        ranges: &[(usize, usize)],
        universe: u64,
    ) -> HostResult<Option<usize>> {
        let words = usize::try_from(universe.div_ceil(64))
            .map_err(|_| HostError::InvalidArgument("id universe too large".into()))?;
        if self.bits.len() < words {
            self.bits.resize(words, 0);
        }
        let mut dup = None;
        // How far marking got: every range before `done_ranges`, and `done_in_last` ids of it.
        let mut done_ranges = 0;
        let mut done_in_last = 0;
        'outer: for &(start, len) in ranges {
            for (i, &id) in ids[start..start + len].iter().enumerate() {
                let (w, b) = word_bit(id);
                if self.bits[w] & b != 0 {
                    dup = Some(start + i);
                    done_in_last = i;
                    break 'outer;
                }
                self.bits[w] |= b;
            }
            done_ranges += 1;
        }
        for (k, &(start, len)) in ranges.iter().enumerate().take(done_ranges + 1) {
            let end = if k < done_ranges {
                start + len
            } else {
                start + done_in_last
            };
            for &id in &ids[start..end] {
                self.bits[word_bit(id).0] = 0;
            }
        }
        Ok(dup)
    }
}

/// A finished plan: parallel arrays of source address, destination address and length.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CopyRuns {
    src: Vec<u64>,
    dst: Vec<u64>,
    len: Vec<u64>,
    pages: u64,
    bytes: u64,
    logical_bytes: u64,
    /// OR of every address and length: its lowest set bit is the common alignment.
    or_bits: u64,
    max_len: u64,
}

impl CopyRuns {
    pub fn src(&self) -> &[u64] {
        &self.src
    }
    pub fn dst(&self) -> &[u64] {
        &self.dst
    }
    pub fn lens(&self) -> &[u64] {
        &self.len
    }
    /// Number of runs (copy descriptors) after coalescing.
    pub fn len(&self) -> usize {
        self.len.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len.is_empty()
    }
    /// Number of (block, tensor) page copies before coalescing.
    pub fn pages(&self) -> u64 {
        self.pages
    }
    /// Bytes actually moved.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// Bytes as vLLM's worker accounts them: blocks times the sum of the group's reference
    /// sizes, counting twice a tensor a group references twice (moved once).
    pub fn logical_bytes(&self) -> u64 {
        self.logical_bytes
    }
    pub fn max_run_bytes(&self) -> u64 {
        self.max_len
    }
    /// Largest power of two dividing every address and length (`1 << 63` for an empty plan).
    pub fn alignment(&self) -> u64 {
        if self.or_bits == 0 {
            1 << 63
        } else {
            1 << self.or_bits.trailing_zeros()
        }
    }

    /// Number of descriptors when every run is cut into pieces of at most `max_piece` bytes
    /// (`0`: no cutting). GPU kernels share work per descriptor, so one long run would
    /// otherwise keep a single program busy while the others idle.
    pub fn count_pieces(&self, max_piece: u64) -> usize {
        if max_piece == 0 {
            return self.len();
        }
        self.len
            .iter()
            .map(|&l| usize::try_from(l.div_ceil(max_piece)).unwrap_or(usize::MAX))
            .fold(0usize, usize::saturating_add)
    }

    /// Writes the descriptors (runs cut as in [`Self::count_pieces`]) into `out` as the signed
    /// 64-bit integers GPU kernels index with: all sources, then all destinations, then all
    /// lengths. `out` must hold exactly `3 * count_pieces(max_piece)` entries.
    pub fn write_soa(&self, max_piece: u64, out: &mut [i64]) -> HostResult<()> {
        let n = self.count_pieces(max_piece);
        if Some(out.len()) != n.checked_mul(3) {
            return Err(HostError::InvalidArgument(format!(
                "descriptor buffer holds {} entries, expected 3 * {n}",
                out.len()
            )));
        }
        let signed = |v: u64| {
            i64::try_from(v).map_err(|_| {
                HostError::InvalidArgument(format!("address or length {v:#x} exceeds int64"))
            })
        };
        let (s, rest) = out.split_at_mut(n);
        let (d, l) = rest.split_at_mut(n);
        let step = if max_piece == 0 { u64::MAX } else { max_piece };
        let mut i = 0;
        for ((&src, &dst), &len) in self.src.iter().zip(&self.dst).zip(&self.len) {
            let mut off = 0;
            while off < len {
                let piece = step.min(len - off);
                s[i] = signed(src + off)?;
                d[i] = signed(dst + off)?;
                l[i] = signed(piece)?;
                i += 1;
                off += piece;
            }
        }
        Ok(())
    }
}

/// Accumulates runs; the open run lives in locals so the hot loop touches no vector.
struct RunBuilder {
    out: CopyRuns,
    src: u64,
    dst: u64,
    len: u64,
}

impl RunBuilder {
    fn new(pages: usize) -> Self {
        // Enough for a fully scattered request (pages come from validated id arrays times the
        // layout's tensor count), capped: coalesced requests need far fewer.
        let cap = pages.min(1 << 20);
        RunBuilder {
            out: CopyRuns {
                src: Vec::with_capacity(cap),
                dst: Vec::with_capacity(cap),
                len: Vec::with_capacity(cap),
                ..CopyRuns::default()
            },
            src: 0,
            dst: 0,
            len: 0,
        }
    }

    #[inline(always)]
    fn push(&mut self, src: u64, dst: u64, len: u64, mergeable: bool) {
        if mergeable && self.len != 0 && self.src + self.len == src && self.dst + self.len == dst {
            self.len += len;
        } else {
            self.flush();
            self.src = src;
            self.dst = dst;
            self.len = len;
        }
    }

    #[inline(always)]
    fn flush(&mut self) {
        if self.len != 0 {
            self.out.src.push(self.src);
            self.out.dst.push(self.dst);
            self.out.len.push(self.len);
            self.out.or_bits |= self.src | self.dst | self.len;
            self.out.max_len = self.out.max_len.max(self.len);
        }
    }

    fn finish(mut self, pages: u64, bytes: u64, logical_bytes: u64) -> CopyRuns {
        self.flush();
        self.out.pages = pages;
        self.out.bytes = bytes;
        self.out.logical_bytes = logical_bytes;
        self.out
    }
}

/// A group after validation: its distinct tensor references and bookkeeping.
#[derive(Clone, Debug)]
struct Group {
    /// `(tensor, bytes)`, one per distinct tensor (the largest size asked for it).
    refs: Vec<GroupRef>,
    /// Sum of the sizes as given (duplicates included): vLLM's per-block accounting.
    logical_bytes_per_block: u64,
    /// Sum of `refs` sizes: bytes moved per block.
    bytes_per_block: u64,
    /// Valid device block ids are `[0, num_blocks)`.
    num_blocks: u64,
    /// Groups of one class share device tensors: a destination may be named once per class.
    class: usize,
}

/// Validated geometry of one (device tensors, groups, host pool, `blocks_per_chunk`) set.
#[derive(Clone, Debug)]
pub struct TransferLayout {
    layers: Vec<LayerGeometry>,
    /// Offset of each tensor's segment inside a chunk.
    host_offsets: Vec<u64>,
    groups: Vec<Group>,
    num_classes: usize,
    blocks_per_chunk: usize,
    bpc: u64,
    host: HostGeometry,
    /// Valid device block ids for [`Self::plan`] (the smallest tensor's count).
    num_blocks: u64,
    /// Host registration pieces span this many chunks (0: no boundaries to respect).
    split_chunks: u64,
}

fn invalid(msg: String) -> HostError {
    HostError::InvalidArgument(msg)
}

fn to_u64(v: usize) -> u64 {
    // usize is at most 64 bits on every target Rust supports for this crate.
    u64::try_from(v).unwrap_or(u64::MAX)
}

fn find(parent: &mut [usize], mut i: usize) -> usize {
    while parent[i] != i {
        parent[i] = parent[parent[i]];
        i = parent[i];
    }
    i
}

impl TransferLayout {
    /// One group over every tensor, each copying whole pages, tensors back to back in a
    /// chunk of exactly `chunk_bytes == blocks_per_chunk * sum(page_bytes)` bytes.
    pub fn new(
        layers: Vec<LayerGeometry>,
        blocks_per_chunk: usize,
        host_base: u64,
        num_chunks: u64,
        chunk_bytes: u64,
        split_bytes: u64,
    ) -> HostResult<Self> {
        let refs = layers
            .iter()
            .enumerate()
            .map(|(tensor, l)| GroupRef {
                tensor,
                bytes: l.page_bytes,
            })
            .collect();
        let offsets = Self::packed_offsets(&layers, blocks_per_chunk)?;
        let packed = offsets.last().copied().unwrap_or(0);
        if packed != chunk_bytes {
            return Err(invalid(format!(
                "chunk_bytes is {chunk_bytes} but blocks_per_chunk ({blocks_per_chunk}) x the \
                 sum of layer page bytes is {packed}"
            )));
        }
        let offsets = offsets[..offsets.len().saturating_sub(1)].to_vec();
        Self::with_groups(
            layers,
            offsets,
            vec![refs],
            blocks_per_chunk,
            HostGeometry {
                base: host_base,
                num_chunks,
                chunk_stride: chunk_bytes,
                split_bytes,
            },
        )
    }

    /// Offsets of tensors packed back to back in a chunk, plus the total as a last entry.
    pub fn packed_offsets(
        layers: &[LayerGeometry],
        blocks_per_chunk: usize,
    ) -> HostResult<Vec<u64>> {
        let bpc = to_u64(blocks_per_chunk);
        let mut offsets = Vec::with_capacity(layers.len() + 1);
        let mut off: u64 = 0;
        offsets.push(0);
        for l in layers {
            off = l
                .page_bytes
                .checked_mul(bpc)
                .and_then(|s| s.checked_add(off))
                .ok_or_else(|| invalid("chunk size overflows".into()))?;
            offsets.push(off);
        }
        Ok(offsets)
    }

    /// The general form: `layers` (device tensors), the offset of each tensor's segment in a
    /// chunk, and the groups' references. Checks positive sizes, pages not overlapping within a
    /// tensor, segments inside the chunk and not overlapping each other, references in range
    /// with `0 < bytes <= page_bytes`, and addresses that cannot overflow.
    pub fn with_groups(
        layers: Vec<LayerGeometry>,
        host_offsets: Vec<u64>,
        groups: Vec<Vec<GroupRef>>,
        blocks_per_chunk: usize,
        host: HostGeometry,
    ) -> HostResult<Self> {
        if layers.is_empty() {
            return Err(invalid("at least one layer is required".into()));
        }
        if groups.is_empty() {
            return Err(invalid("at least one group is required".into()));
        }
        if blocks_per_chunk == 0 {
            return Err(invalid("blocks_per_chunk must be at least 1".into()));
        }
        let bpc = to_u64(blocks_per_chunk);
        if host.num_chunks == 0 || host.chunk_stride == 0 {
            return Err(invalid(
                "the pool must hold at least one non-empty chunk".into(),
            ));
        }
        if host_offsets.len() != layers.len() {
            return Err(invalid(format!(
                "{} segment offsets for {} layers",
                host_offsets.len(),
                layers.len()
            )));
        }
        let mut segments = Vec::with_capacity(layers.len());
        for (i, (l, &off)) in layers.iter().zip(&host_offsets).enumerate() {
            if l.page_bytes == 0 || l.num_blocks == 0 {
                return Err(invalid(format!("layer {i} has no blocks or empty pages")));
            }
            if l.block_stride < l.page_bytes {
                return Err(invalid(format!(
                    "layer {i}: blocks are {} bytes apart but pages are {} bytes (overlapping)",
                    l.block_stride, l.page_bytes
                )));
            }
            let end = (l.num_blocks - 1)
                .checked_mul(l.block_stride)
                .and_then(|o| o.checked_add(l.page_bytes))
                .and_then(|o| o.checked_add(l.base));
            if end.is_none() {
                return Err(invalid(format!("layer {i}: address range overflows")));
            }
            let seg_end = l
                .page_bytes
                .checked_mul(bpc)
                .and_then(|s| s.checked_add(off))
                .filter(|&e| e <= host.chunk_stride)
                .ok_or_else(|| {
                    invalid(format!(
                        "layer {i}: its {blocks_per_chunk} page slots of {} bytes at offset {off} \
                         do not fit in a chunk of {} bytes",
                        l.page_bytes, host.chunk_stride
                    ))
                })?;
            segments.push((off, seg_end, i));
        }
        segments.sort_unstable();
        for w in segments.windows(2) {
            if w[0].1 > w[1].0 {
                return Err(invalid(format!(
                    "the chunk segments of layers {} and {} overlap",
                    w[0].2, w[1].2
                )));
            }
        }
        if host
            .num_chunks
            .checked_mul(host.chunk_stride)
            .and_then(|n| n.checked_add(host.base))
            .is_none()
        {
            return Err(invalid("host address range overflows".into()));
        }
        if host.split_bytes % host.chunk_stride != 0 {
            return Err(invalid(format!(
                "registration pieces of {} bytes do not hold whole chunks",
                host.split_bytes
            )));
        }
        let min_blocks = layers.iter().map(|l| l.num_blocks).min().unwrap_or(0);
        // Classes: groups that reference a common tensor (union-find over tensors).
        let mut parent: Vec<usize> = (0..groups.len()).collect();
        let mut owner: Vec<Option<usize>> = vec![None; layers.len()];
        let mut checked = Vec::with_capacity(groups.len());
        for (g, refs) in groups.into_iter().enumerate() {
            let mut distinct: Vec<GroupRef> = Vec::with_capacity(refs.len());
            let mut logical: u64 = 0;
            for (k, r) in refs.iter().enumerate() {
                let layer = layers.get(r.tensor).ok_or_else(|| {
                    invalid(format!(
                        "group {g}, reference {k}: tensor {} of {}",
                        r.tensor,
                        layers.len()
                    ))
                })?;
                if r.bytes == 0 || r.bytes > layer.page_bytes {
                    return Err(invalid(format!(
                        "group {g}, reference {k}: copies {} bytes of a {}-byte page",
                        r.bytes, layer.page_bytes
                    )));
                }
                logical = logical
                    .checked_add(r.bytes)
                    .ok_or_else(|| invalid("reference sizes overflow".into()))?;
                match distinct.iter_mut().find(|d| d.tensor == r.tensor) {
                    Some(d) => d.bytes = d.bytes.max(r.bytes),
                    None => distinct.push(*r),
                }
                match owner[r.tensor] {
                    Some(o) => {
                        let (a, b) = (find(&mut parent, o), find(&mut parent, g));
                        parent[a] = b;
                    }
                    None => owner[r.tensor] = Some(g),
                }
            }
            let num_blocks = distinct
                .iter()
                .map(|r| layers[r.tensor].num_blocks)
                .min()
                .unwrap_or(min_blocks);
            let bytes_per_block = distinct.iter().map(|r| r.bytes).sum();
            checked.push(Group {
                refs: distinct,
                logical_bytes_per_block: logical,
                bytes_per_block,
                num_blocks,
                class: 0,
            });
        }
        let mut class_of_root = vec![usize::MAX; checked.len()];
        let mut num_classes = 0;
        for (g, group) in checked.iter_mut().enumerate() {
            let root = find(&mut parent, g);
            if class_of_root[root] == usize::MAX {
                class_of_root[root] = num_classes;
                num_classes += 1;
            }
            group.class = class_of_root[root];
        }
        Ok(TransferLayout {
            layers,
            host_offsets,
            groups: checked,
            num_classes,
            blocks_per_chunk,
            bpc,
            host,
            num_blocks: min_blocks,
            split_chunks: host.split_bytes / host.chunk_stride,
        })
    }

    pub fn layers(&self) -> &[LayerGeometry] {
        &self.layers
    }
    pub fn host_offsets(&self) -> &[u64] {
        &self.host_offsets
    }
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }
    pub fn blocks_per_chunk(&self) -> usize {
        self.blocks_per_chunk
    }
    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }
    pub fn num_chunks(&self) -> u64 {
        self.host.num_chunks
    }
    pub fn chunk_bytes(&self) -> u64 {
        self.host.chunk_stride
    }

    fn check_range(ids: &[i64], limit: u64, what: &str, offset: usize) -> HostResult<()> {
        if let Some((pos, &id)) = ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| u64::try_from(id).map_or(true, |id| id >= limit))
        {
            return Err(HostError::OutOfRange(format!(
                "{what} id {id} at position {} is out of range [0, {limit})",
                pos + offset
            )));
        }
        Ok(())
    }

    /// Whole chunks of the single group: `gpu_ids` lists `blocks_per_chunk` device blocks per
    /// entry of `chunk_ids`, in chunk order. Nothing is copied here.
    pub fn plan(
        &self,
        dir: Direction,
        gpu_ids: &[i64],
        chunk_ids: &[i64],
        scratch: &mut PlanScratch,
    ) -> HostResult<CopyRuns> {
        let bpc = self.blocks_per_chunk;
        if self.groups.len() != 1 {
            return Err(invalid(format!(
                "this layout has {} groups: give each group's span",
                self.groups.len()
            )));
        }
        if chunk_ids.len().checked_mul(bpc) != Some(gpu_ids.len()) {
            return Err(invalid(format!(
                "{} block ids for {} chunk ids: expected blocks_per_chunk ({bpc}) per chunk",
                gpu_ids.len(),
                chunk_ids.len()
            )));
        }
        let span = GroupSpan {
            blocks: gpu_ids.len(),
            first_index: 0,
        };
        self.plan_groups(dir, gpu_ids, chunk_ids, &[span], scratch)
    }

    /// Validates a request and builds its runs. `gpu_ids` holds the blocks of every group in
    /// group order, `chunk_ids` their chunks in the same order; `spans[g]` says how many blocks
    /// group `g` has and where its first block sits (see the module docs).
    pub fn plan_groups(
        &self,
        dir: Direction,
        gpu_ids: &[i64],
        chunk_ids: &[i64],
        spans: &[GroupSpan],
        scratch: &mut PlanScratch,
    ) -> HostResult<CopyRuns> {
        if spans.len() != self.groups.len() {
            return Err(invalid(format!(
                "{} group spans for a layout of {} groups",
                spans.len(),
                self.groups.len()
            )));
        }
        // (gpu offset, gpu count, chunk offset, chunk count) per group.
        let mut parts = Vec::with_capacity(spans.len());
        let (mut g_off, mut c_off) = (0usize, 0usize);
        for (g, s) in spans.iter().enumerate() {
            let chunks = if s.blocks == 0 {
                0
            } else {
                let skip = s.first_index % self.bpc;
                let logical = to_u64(s.blocks)
                    .checked_add(skip)
                    .ok_or_else(|| invalid(format!("group {g}: span overflows")))?;
                usize::try_from(logical.div_ceil(self.bpc))
                    .map_err(|_| invalid(format!("group {g}: span overflows")))?
            };
            parts.push((g_off, s.blocks, c_off, chunks));
            g_off = g_off
                .checked_add(s.blocks)
                .ok_or_else(|| invalid("group spans overflow".into()))?;
            c_off = c_off
                .checked_add(chunks)
                .ok_or_else(|| invalid("group spans overflow".into()))?;
        }
        if g_off != gpu_ids.len() || c_off != chunk_ids.len() {
            return Err(invalid(format!(
                "the group spans cover {g_off} block ids and {c_off} chunk ids, but the job has \
                 {} block ids and {} chunk ids",
                gpu_ids.len(),
                chunk_ids.len()
            )));
        }
        Self::check_range(chunk_ids, self.host.num_chunks, "chunk", 0)?;
        for (group, &(go, gn, _, _)) in self.groups.iter().zip(&parts) {
            Self::check_range(&gpu_ids[go..go + gn], group.num_blocks, "block", go)?;
        }
        let (dest, universe, what) = match dir {
            Direction::Store => (chunk_ids, self.host.num_chunks, "chunk"),
            Direction::Load => (gpu_ids, self.num_blocks_max(), "block"),
        };
        let mut ranges = Vec::with_capacity(parts.len());
        for class in 0..self.num_classes {
            ranges.clear();
            for (group, &(go, gn, co, cn)) in self.groups.iter().zip(&parts) {
                if group.class == class {
                    ranges.push(match dir {
                        Direction::Store => (co, cn),
                        Direction::Load => (go, gn),
                    });
                }
            }
            if let Some(pos) = scratch.find_duplicate(dest, &ranges, universe)? {
                return Err(invalid(format!(
                    "{what} id {} at position {pos} repeats: one job may write each destination \
                     once",
                    dest[pos]
                )));
            }
        }
        Ok(self.build(dir, gpu_ids, chunk_ids, spans, &parts))
    }

    fn num_blocks_max(&self) -> u64 {
        self.layers.iter().map(|l| l.num_blocks).max().unwrap_or(0)
    }

    fn build(
        &self,
        dir: Direction,
        gpu_ids: &[i64],
        chunk_ids: &[i64],
        spans: &[GroupSpan],
        parts: &[(usize, usize, usize, usize)],
    ) -> CopyRuns {
        let bpc = self.blocks_per_chunk;
        let mut pages: u64 = 0;
        let mut bytes: u64 = 0;
        let mut logical: u64 = 0;
        for (group, &(_, gn, _, _)) in self.groups.iter().zip(parts) {
            let n = to_u64(gn);
            pages += n * to_u64(group.refs.len());
            bytes += n * group.bytes_per_block;
            logical += n * group.logical_bytes_per_block;
        }
        let mut b = RunBuilder::new(usize::try_from(pages).unwrap_or(usize::MAX));
        let mut prev_segment: Option<u64> = None;
        for ((group, span), &(go, gn, co, cn)) in self.groups.iter().zip(spans).zip(parts) {
            if gn == 0 {
                continue;
            }
            // Both fit in usize: skip < bpc, and the span was validated.
            let skip = usize::try_from(span.first_index % self.bpc).unwrap_or(0);
            let blocks = &gpu_ids[go..go + gn];
            for (k, &chunk) in chunk_ids[co..co + cn].iter().enumerate() {
                // Slots [lo, hi) of this chunk hold blocks [k*bpc + lo - skip, k*bpc + hi - skip).
                let lo = if k == 0 { skip } else { 0 };
                let hi = bpc.min(skip + gn - k * bpc);
                let ids = &blocks[k * bpc + lo - skip..k * bpc + hi - skip];
                let c = u64::try_from(chunk).unwrap_or(0);
                let chunk_host = self.host.base + c * self.host.chunk_stride;
                let at_boundary = self.split_chunks != 0 && c % self.split_chunks == 0;
                let mut first_of_chunk = true;
                for r in &group.refs {
                    let layer = &self.layers[r.tensor];
                    let page = layer.page_bytes;
                    let mut host = chunk_host + self.host_offsets[r.tensor] + to_u64(lo) * page;
                    let mut mergeable =
                        prev_segment == Some(layer.segment) && !(first_of_chunk && at_boundary);
                    for &g in ids {
                        let dev = layer.base + u64::try_from(g).unwrap_or(0) * layer.block_stride;
                        match dir {
                            Direction::Store => b.push(dev, host, r.bytes, mergeable),
                            Direction::Load => b.push(host, dev, r.bytes, mergeable),
                        }
                        mergeable = true;
                        host += page;
                    }
                    first_of_chunk = false;
                    prev_segment = Some(layer.segment);
                }
            }
        }
        b.finish(pages, bytes, logical)
    }
}

#[cfg(test)]
mod tests;
