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
//! This is vLLM 0.33.0's `GPULoadStoreSpec(group_sizes, block_indices)` contract; vLLM 0.34.0
//! names the same blocks by device address, which [`TransferLayout::block_ids_from_pointers`]
//! turns back into block ids.
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
            .map_err(|_| HostError::Geometry("id universe too large".into()))?;
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

/// A group after validation: its distinct tensor references and bookkeeping.
#[derive(Clone, Debug)]
struct Group {
    /// `(tensor, bytes)`, one per distinct tensor (the largest size asked for it).
    refs: Vec<GroupRef>,
    /// The references as given, in order and with repeats: what a caller that names device
    /// pages per reference (vLLM's device pointers) enumerates.
    given: Vec<GroupRef>,
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

fn geometry(msg: String) -> HostError {
    HostError::Geometry(msg)
}

fn mismatch(msg: String) -> HostError {
    HostError::Mismatch(msg)
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
            return Err(geometry(format!(
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
                .ok_or_else(|| geometry("chunk size overflows".into()))?;
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
            return Err(geometry("at least one layer is required".into()));
        }
        if groups.is_empty() {
            return Err(geometry("at least one group is required".into()));
        }
        if blocks_per_chunk == 0 {
            return Err(geometry("blocks_per_chunk must be at least 1".into()));
        }
        let bpc = to_u64(blocks_per_chunk);
        if host.num_chunks == 0 || host.chunk_stride == 0 {
            return Err(geometry(
                "the pool must hold at least one non-empty chunk".into(),
            ));
        }
        if host_offsets.len() != layers.len() {
            return Err(geometry(format!(
                "{} segment offsets for {} layers",
                host_offsets.len(),
                layers.len()
            )));
        }
        let mut segments = Vec::with_capacity(layers.len());
        for (i, (l, &off)) in layers.iter().zip(&host_offsets).enumerate() {
            if l.page_bytes == 0 || l.num_blocks == 0 {
                return Err(geometry(format!("layer {i} has no blocks or empty pages")));
            }
            if l.block_stride < l.page_bytes {
                return Err(geometry(format!(
                    "layer {i}: blocks are {} bytes apart but pages are {} bytes (overlapping)",
                    l.block_stride, l.page_bytes
                )));
            }
            let end = (l.num_blocks - 1)
                .checked_mul(l.block_stride)
                .and_then(|o| o.checked_add(l.page_bytes))
                .and_then(|o| o.checked_add(l.base));
            if end.is_none() {
                return Err(geometry(format!("layer {i}: address range overflows")));
            }
            let seg_end = l
                .page_bytes
                .checked_mul(bpc)
                .and_then(|s| s.checked_add(off))
                .filter(|&e| e <= host.chunk_stride)
                .ok_or_else(|| {
                    geometry(format!(
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
                return Err(geometry(format!(
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
            return Err(geometry("host address range overflows".into()));
        }
        if host.split_bytes % host.chunk_stride != 0 {
            return Err(geometry(format!(
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
                    geometry(format!(
                        "group {g}, reference {k}: tensor {} of {}",
                        r.tensor,
                        layers.len()
                    ))
                })?;
                if r.bytes == 0 || r.bytes > layer.page_bytes {
                    return Err(geometry(format!(
                        "group {g}, reference {k}: copies {} bytes of a {}-byte page",
                        r.bytes, layer.page_bytes
                    )));
                }
                logical = logical
                    .checked_add(r.bytes)
                    .ok_or_else(|| geometry("reference sizes overflow".into()))?;
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
                given: refs,
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

    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }
    pub fn blocks_per_chunk(&self) -> usize {
        self.blocks_per_chunk
    }
    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    fn check_range(ids: &[i64], limit: u64, what: &'static str, offset: usize) -> HostResult<()> {
        if let Some((pos, &id)) = ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| u64::try_from(id).map_or(true, |id| id >= limit))
        {
            return Err(HostError::OutOfRange {
                what,
                id,
                position: pos + offset,
                bound: limit,
            });
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
            return Err(mismatch(format!(
                "this layout has {} groups: give each group's span",
                self.groups.len()
            )));
        }
        if chunk_ids.len().checked_mul(bpc) != Some(gpu_ids.len()) {
            return Err(mismatch(format!(
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
    pub(crate) fn plan_groups(
        &self,
        dir: Direction,
        gpu_ids: &[i64],
        chunk_ids: &[i64],
        spans: &[GroupSpan],
        scratch: &mut PlanScratch,
    ) -> HostResult<CopyRuns> {
        let req = self.validate(
            dir,
            gpu_ids.to_vec(),
            chunk_ids.to_vec(),
            spans.to_vec(),
            scratch,
        )?;
        Ok(self.build(&req))
    }

    /// Checks a request completely (counts, ranges, no destination named twice) in time
    /// linear in its ids, without building its runs: [`Self::build`] does that later, possibly
    /// on another thread.
    pub fn validate(
        &self,
        dir: Direction,
        gpu_ids: Vec<i64>,
        chunk_ids: Vec<i64>,
        spans: Vec<GroupSpan>,
        scratch: &mut PlanScratch,
    ) -> HostResult<Request> {
        if spans.len() != self.groups.len() {
            return Err(mismatch(format!(
                "{} group spans for a layout of {} groups",
                spans.len(),
                self.groups.len()
            )));
        }
        let mut parts = Vec::with_capacity(spans.len());
        let (mut g_off, mut c_off) = (0usize, 0usize);
        for (g, s) in spans.iter().enumerate() {
            let chunks = if s.blocks == 0 {
                0
            } else {
                let skip = s.first_index % self.bpc;
                let logical = to_u64(s.blocks)
                    .checked_add(skip)
                    .ok_or_else(|| mismatch(format!("group {g}: span overflows")))?;
                usize::try_from(logical.div_ceil(self.bpc))
                    .map_err(|_| mismatch(format!("group {g}: span overflows")))?
            };
            parts.push(Part {
                gpu: g_off,
                blocks: s.blocks,
                chunk: c_off,
                chunks,
                skip: usize::try_from(s.first_index % self.bpc).unwrap_or(0),
            });
            g_off = g_off
                .checked_add(s.blocks)
                .ok_or_else(|| mismatch("group spans overflow".into()))?;
            c_off = c_off
                .checked_add(chunks)
                .ok_or_else(|| mismatch("group spans overflow".into()))?;
        }
        if g_off != gpu_ids.len() || c_off != chunk_ids.len() {
            return Err(mismatch(format!(
                "the group spans cover {g_off} block ids and {c_off} chunk ids, but the job has \
                 {} block ids and {} chunk ids",
                gpu_ids.len(),
                chunk_ids.len()
            )));
        }
        Self::check_range(&chunk_ids, self.host.num_chunks, "chunk", 0)?;
        for (group, p) in self.groups.iter().zip(&parts) {
            Self::check_range(
                &gpu_ids[p.gpu..p.gpu + p.blocks],
                group.num_blocks,
                "block",
                p.gpu,
            )?;
        }
        let (dest, universe, what) = match dir {
            Direction::Store => (&chunk_ids, self.host.num_chunks, "chunk"),
            Direction::Load => (&gpu_ids, self.num_blocks_max(), "block"),
        };
        let mut ranges = Vec::with_capacity(parts.len());
        for class in 0..self.num_classes {
            ranges.clear();
            for (group, p) in self.groups.iter().zip(&parts) {
                // A group without references on this rank writes nothing: its placeholders
                // may repeat.
                if group.class == class && !group.refs.is_empty() {
                    ranges.push(match dir {
                        Direction::Store => (p.chunk, p.chunks),
                        Direction::Load => (p.gpu, p.blocks),
                    });
                }
            }
            if let Some(pos) = scratch.find_duplicate(dest, &ranges, universe)? {
                return Err(HostError::DuplicateDestination {
                    what,
                    id: dest[pos],
                    position: pos,
                });
            }
        }
        let (mut pages, mut bytes, mut logical) = (0u64, 0u64, 0u64);
        for (group, p) in self.groups.iter().zip(&parts) {
            let n = to_u64(p.blocks);
            pages += n * to_u64(group.refs.len());
            bytes += n * group.bytes_per_block;
            logical += n * group.logical_bytes_per_block;
        }
        Ok(Request {
            dir,
            gpu_ids,
            chunk_ids,
            parts,
            pages,
            bytes,
            logical_bytes: logical,
        })
    }

    fn num_blocks_max(&self) -> u64 {
        self.layers.iter().map(|l| l.num_blocks).max().unwrap_or(0)
    }

    /// Builds the runs of a request this layout validated. Consecutive device blocks are
    /// found once per chunk, so a fresh (unfragmented) request costs per chunk and tensor, not
    /// per page; a scattered one costs per page.
    pub fn build(&self, req: &Request) -> CopyRuns {
        let bpc = self.blocks_per_chunk;
        let mut b = RunBuilder::new(usize::try_from(req.pages).unwrap_or(usize::MAX));
        let mut prev_segment: Option<u64> = None;
        // Lengths of the maximal runs of consecutive ids in the current chunk's slice.
        let mut streaks: Vec<usize> = Vec::with_capacity(bpc);
        for (group, p) in self.groups.iter().zip(&req.parts) {
            let chunks = &req.chunk_ids[p.chunk..p.chunk + p.chunks];
            for ((lo, ids), &chunk) in p.chunk_slices(&req.gpu_ids, bpc).zip(chunks) {
                streak_lengths(ids, &mut streaks);
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
                    let dense = self.is_dense(r);
                    let mut i = 0;
                    for &len in &streaks {
                        if dense {
                            let dev = layer.base
                                + u64::try_from(ids[i]).unwrap_or(0) * layer.block_stride;
                            let n = to_u64(len) * page;
                            match req.dir {
                                Direction::Store => b.push(dev, host, n, mergeable),
                                Direction::Load => b.push(host, dev, n, mergeable),
                            }
                            mergeable = true;
                            host += n;
                        } else {
                            for &g in &ids[i..i + len] {
                                let dev =
                                    layer.base + u64::try_from(g).unwrap_or(0) * layer.block_stride;
                                match req.dir {
                                    Direction::Store => b.push(dev, host, r.bytes, mergeable),
                                    Direction::Load => b.push(host, dev, r.bytes, mergeable),
                                }
                                mergeable = true;
                                host += page;
                            }
                        }
                        i += len;
                    }
                    first_of_chunk = false;
                    prev_segment = Some(layer.segment);
                }
            }
        }
        b.finish()
    }

    /// Whole pages of densely packed blocks: a streak of consecutive block ids is one
    /// contiguous range on both sides, hence one run.
    fn is_dense(&self, r: &GroupRef) -> bool {
        let layer = &self.layers[r.tensor];
        r.bytes == layer.page_bytes && layer.block_stride == layer.page_bytes
    }

    /// How many runs [`Self::build`] makes when none joins two tensors, two chunks or two
    /// groups: an upper bound, exact for most layouts (a single tensor, or tensors in one
    /// allocation, can merge further). Linear in the blocks and independent of the number of
    /// tensors, so the thread that submits a job can choose between DMA and a copy kernel
    /// without building the runs.
    pub fn max_runs(&self, req: &Request) -> u64 {
        let bpc = self.blocks_per_chunk;
        let mut runs = 0u64;
        let mut lengths = Vec::with_capacity(bpc);
        for (group, p) in self.groups.iter().zip(&req.parts) {
            let dense = to_u64(group.refs.iter().filter(|r| self.is_dense(r)).count());
            let others = to_u64(group.refs.len()) - dense;
            let mut streaks = 0u64;
            for (_, ids) in p.chunk_slices(&req.gpu_ids, bpc) {
                streak_lengths(ids, &mut lengths);
                streaks += to_u64(lengths.len());
            }
            runs += dense * streaks + others * to_u64(p.blocks);
        }
        runs
    }

    /// The host memory a request touches: `(address, chunk bytes)` of each of its chunks (what
    /// a copy must keep a background registration away from).
    pub fn chunk_ranges<'a>(&'a self, req: &'a Request) -> impl Iterator<Item = (u64, u64)> + 'a {
        req.chunk_ids.iter().map(|&c| {
            let c = u64::try_from(c).unwrap_or(0);
            (
                self.host.base + c * self.host.chunk_stride,
                self.host.chunk_stride,
            )
        })
    }
}

/// Lengths of the maximal stretches of consecutive ids in `ids` (one chunk's blocks), into
/// `out`: what [`TransferLayout::build`] makes one run of, per dense reference.
fn streak_lengths(ids: &[i64], out: &mut Vec<usize>) {
    out.clear();
    let mut start = 0;
    for i in 1..=ids.len() {
        if i == ids.len() || ids[i] != ids[i - 1].wrapping_add(1) {
            out.push(i - start);
            start = i;
        }
    }
}

/// One group's share of a validated request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Part {
    /// Offset and count of its device block ids.
    gpu: usize,
    blocks: usize,
    /// Offset and count of its chunk ids.
    chunk: usize,
    chunks: usize,
    /// Slots skipped in its first chunk.
    skip: usize,
}

impl Part {
    /// Its blocks chunk by chunk: for the k-th of its chunks, the first slot used (the skip
    /// in the first chunk, else 0) and the blocks in that chunk's slots.
    fn chunk_slices<'a>(
        &self,
        gpu_ids: &'a [i64],
        bpc: usize,
    ) -> impl Iterator<Item = (usize, &'a [i64])> + 'a {
        let p = *self;
        let blocks = &gpu_ids[p.gpu..p.gpu + p.blocks];
        (0..p.chunks).map(move |k| {
            // Slots [lo, hi) of chunk k hold blocks [k*bpc + lo - skip, k*bpc + hi - skip).
            let lo = if k == 0 { p.skip } else { 0 };
            let hi = bpc.min(p.skip + p.blocks - k * bpc);
            (lo, &blocks[k * bpc + lo - p.skip..k * bpc + hi - p.skip])
        })
    }
}

/// A request its layout has validated: the ids (owned), how they split into groups, and its
/// size. Building its runs ([`TransferLayout::build`]) cannot fail.
#[derive(Clone, Debug)]
pub struct Request {
    dir: Direction,
    gpu_ids: Vec<i64>,
    chunk_ids: Vec<i64>,
    parts: Vec<Part>,
    pages: u64,
    bytes: u64,
    logical_bytes: u64,
}

impl Request {
    /// Number of (block, tensor) page copies.
    pub fn pages(&self) -> u64 {
        self.pages
    }
    /// Bytes the request moves.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// Bytes as vLLM's worker accounts them: blocks times the sum of the group's reference
    /// sizes, counting twice a tensor a group references twice (moved once).
    pub fn logical_bytes(&self) -> u64 {
        self.logical_bytes
    }
    /// Device blocks per group.
    pub fn group_blocks(&self) -> impl Iterator<Item = usize> + '_ {
        self.parts.iter().map(|p| p.blocks)
    }
}

mod kernel;
mod pointers;
mod runs;

pub use pointers::PointerCounts;
pub use runs::CopyRuns;
use runs::RunBuilder;
#[cfg(test)]
mod tests;
