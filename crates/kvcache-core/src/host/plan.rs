//! Copy plans: `(block ids, chunk ids)` -> `(src, dst, len)` runs.
//!
//! # Chunk layout
//! A chunk holds, for every layer in order, the pages of its `blocks_per_chunk` blocks back to
//! back: `[layer 0: block 0 | block 1 | ...][layer 1: block 0 | ...]...` (layer-major). The
//! chunk is thus a fixed sequence of per-layer *segments* of `blocks_per_chunk * page` bytes.
//! Layer-major because device memory is layer-major too (one tensor per layer, block-indexed):
//! when a chunk's blocks are consecutive on the device, each layer segment is a single copy
//! instead of `blocks_per_chunk` page copies. A block-major chunk would never coalesce
//! beyond one page with per-layer tensors.
//!
//! # Coalescing
//! Pages are enumerated chunk by chunk, layer by layer, block by block, and a page is merged
//! into the previous run when it continues it on *both* sides. That merges, with no special
//! cases: consecutive blocks within a layer segment; consecutive chunks when there is a
//! single layer; and whole chunks when the layers are interleaved views of one allocation
//! (a "cross-layer" block layout) and `blocks_per_chunk == 1`. Runs never cross a host
//! registration boundary, nor join two layers that live in different device allocations
//! (copy engines may reject a range that spans two allocations even when they are adjacent).
//!
//! # Validation
//! Every id is checked (range, and no destination written twice in one job) before the plan is
//! built, so a bad request has no effect at all.

use super::error::{HostError, HostResult};

/// One layer's device-side geometry: block `b`'s page is `page_bytes` bytes at
/// `base + b * block_stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerGeometry {
    pub base: u64,
    pub block_stride: u64,
    pub page_bytes: u64,
    pub num_blocks: u64,
    /// Identifies the allocation the layer lives in; runs join two layers only when equal.
    pub segment: u64,
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

impl PlanScratch {
    /// Marks each id; on the first repeated id, unmarks everything and returns its position.
    /// Ids must already be in `[0, universe)`.
    fn find_duplicate(&mut self, ids: &[i64], universe: u64) -> Option<usize> {
        let words = universe.div_ceil(64) as usize;
        if self.bits.len() < words {
            self.bits.resize(words, 0);
        }
        let mut dup = None;
        let mut marked = ids.len();
        for (i, &id) in ids.iter().enumerate() {
            let (w, b) = ((id as u64 / 64) as usize, id as u64 % 64);
            if self.bits[w] & (1 << b) != 0 {
                dup = Some(i);
                marked = i;
                break;
            }
            self.bits[w] |= 1 << b;
        }
        for &id in &ids[..marked] {
            self.bits[(id as u64 / 64) as usize] = 0;
        }
        dup
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
    /// Number of pages before coalescing.
    pub fn pages(&self) -> u64 {
        self.pages
    }
    pub fn bytes(&self) -> u64 {
        self.bytes
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
            .map(|&l| l.div_ceil(max_piece) as usize)
            .sum()
    }

    /// Writes the descriptors (runs cut as in [`Self::count_pieces`]) into `out` as the signed
    /// 64-bit integers GPU kernels index with: all sources, then all destinations, then all
    /// lengths. `out` must hold exactly `3 * count_pieces(max_piece)` entries.
    pub fn write_soa(&self, max_piece: u64, out: &mut [i64]) -> HostResult<()> {
        let n = self.count_pieces(max_piece);
        if out.len() != 3 * n {
            return Err(HostError::InvalidArgument(format!(
                "descriptor buffer holds {} entries, expected 3 * {n}",
                out.len()
            )));
        }
        let (s, rest) = out.split_at_mut(n);
        let (d, l) = rest.split_at_mut(n);
        let step = if max_piece == 0 { u64::MAX } else { max_piece };
        let mut i = 0;
        for ((&src, &dst), &len) in self.src.iter().zip(&self.dst).zip(&self.len) {
            let mut off = 0;
            while off < len {
                let piece = step.min(len - off);
                s[i] = (src + off) as i64;
                d[i] = (dst + off) as i64;
                l[i] = piece as i64;
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
        // Enough for a fully scattered request, capped: coalesced requests need far fewer.
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

    fn finish(mut self, pages: u64, bytes: u64) -> CopyRuns {
        self.flush();
        self.out.pages = pages;
        self.out.bytes = bytes;
        self.out
    }
}

/// Validated geometry of one (device layers, host pool, `blocks_per_chunk`) triple.
#[derive(Clone, Debug)]
pub struct TransferLayout {
    layers: Vec<LayerGeometry>,
    /// Offset of each layer's segment inside a chunk.
    seg_offsets: Vec<u64>,
    blocks_per_chunk: usize,
    chunk_bytes: u64,
    num_chunks: u64,
    /// Valid device block ids are `[0, num_blocks)` (the smallest layer's count).
    num_blocks: u64,
    host_base: u64,
    /// Host registration pieces span this many chunks (0: no boundaries to respect).
    split_chunks: u64,
}

fn invalid(msg: String) -> HostError {
    HostError::InvalidArgument(msg)
}

impl TransferLayout {
    /// Checks the geometry: positive sizes, pages not overlapping within a layer, addresses
    /// that cannot overflow, and `chunk_bytes == blocks_per_chunk * sum(page_bytes)`.
    /// `split_bytes` is the host registration piece size (0 if unregistered or one piece); it
    /// must be a multiple of `chunk_bytes`.
    pub fn new(
        layers: Vec<LayerGeometry>,
        blocks_per_chunk: usize,
        host_base: u64,
        num_chunks: u64,
        chunk_bytes: u64,
        split_bytes: u64,
    ) -> HostResult<Self> {
        if layers.is_empty() {
            return Err(invalid("at least one layer is required".into()));
        }
        if blocks_per_chunk == 0 {
            return Err(invalid("blocks_per_chunk must be at least 1".into()));
        }
        if num_chunks == 0 || chunk_bytes == 0 {
            return Err(invalid(
                "the pool must hold at least one non-empty chunk".into(),
            ));
        }
        let mut page_sum: u64 = 0;
        for (i, l) in layers.iter().enumerate() {
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
            page_sum = page_sum
                .checked_add(l.page_bytes)
                .ok_or_else(|| invalid("page sizes overflow".into()))?;
        }
        let expected = page_sum.checked_mul(blocks_per_chunk as u64);
        if expected != Some(chunk_bytes) {
            return Err(invalid(format!(
                "chunk_bytes is {chunk_bytes} but blocks_per_chunk ({blocks_per_chunk}) x the \
                 sum of layer page bytes ({page_sum}) is {}",
                expected.map_or_else(|| "too large".to_string(), |e| e.to_string())
            )));
        }
        if num_chunks
            .checked_mul(chunk_bytes)
            .and_then(|n| n.checked_add(host_base))
            .is_none()
        {
            return Err(invalid("host address range overflows".into()));
        }
        if split_bytes % chunk_bytes != 0 {
            return Err(invalid(format!(
                "registration pieces of {split_bytes} bytes do not hold whole chunks"
            )));
        }
        let mut seg_offsets = Vec::with_capacity(layers.len());
        let mut off = 0;
        for l in &layers {
            seg_offsets.push(off);
            off += l.page_bytes * blocks_per_chunk as u64;
        }
        let num_blocks = layers.iter().map(|l| l.num_blocks).min().unwrap_or(0);
        Ok(TransferLayout {
            layers,
            seg_offsets,
            blocks_per_chunk,
            chunk_bytes,
            num_chunks,
            num_blocks,
            host_base,
            split_chunks: split_bytes / chunk_bytes,
        })
    }

    pub fn layers(&self) -> &[LayerGeometry] {
        &self.layers
    }
    pub fn blocks_per_chunk(&self) -> usize {
        self.blocks_per_chunk
    }
    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }
    pub fn num_chunks(&self) -> u64 {
        self.num_chunks
    }
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }

    fn check_range(ids: &[i64], limit: u64, what: &str) -> HostResult<()> {
        if let Some((pos, &id)) = ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id < 0 || id as u64 >= limit)
        {
            return Err(HostError::OutOfRange(format!(
                "{what} id {id} at position {pos} is out of range [0, {limit})"
            )));
        }
        Ok(())
    }

    /// Validates a request and builds its runs. `gpu_ids` lists `blocks_per_chunk` device
    /// blocks per entry of `chunk_ids`, in chunk order. Nothing is copied here.
    pub fn plan(
        &self,
        dir: Direction,
        gpu_ids: &[i64],
        chunk_ids: &[i64],
        scratch: &mut PlanScratch,
    ) -> HostResult<CopyRuns> {
        let bpc = self.blocks_per_chunk;
        if chunk_ids.len().checked_mul(bpc) != Some(gpu_ids.len()) {
            return Err(invalid(format!(
                "{} block ids for {} chunk ids: expected blocks_per_chunk ({bpc}) per chunk",
                gpu_ids.len(),
                chunk_ids.len()
            )));
        }
        Self::check_range(chunk_ids, self.num_chunks, "chunk")?;
        Self::check_range(gpu_ids, self.num_blocks, "block")?;
        let (dest, universe, what) = match dir {
            Direction::Store => (chunk_ids, self.num_chunks, "chunk"),
            Direction::Load => (gpu_ids, self.num_blocks, "block"),
        };
        if let Some(pos) = scratch.find_duplicate(dest, universe) {
            return Err(invalid(format!(
                "{what} id {} at position {pos} repeats: one job may write each destination once",
                dest[pos]
            )));
        }
        Ok(self.build(dir, gpu_ids, chunk_ids))
    }

    fn build(&self, dir: Direction, gpu_ids: &[i64], chunk_ids: &[i64]) -> CopyRuns {
        let bpc = self.blocks_per_chunk;
        let pages = gpu_ids.len() * self.layers.len();
        let mut b = RunBuilder::new(pages);
        let mut prev_segment: Option<u64> = None;
        for (c, ids) in chunk_ids.iter().zip(gpu_ids.chunks_exact(bpc)) {
            let c = *c as u64;
            let chunk_host = self.host_base + c * self.chunk_bytes;
            let at_boundary = self.split_chunks != 0 && c % self.split_chunks == 0;
            for (l, (layer, &seg_off)) in self.layers.iter().zip(&self.seg_offsets).enumerate() {
                let page = layer.page_bytes;
                let mut host = chunk_host + seg_off;
                let mut mergeable = prev_segment == Some(layer.segment) && !(l == 0 && at_boundary);
                for &g in ids {
                    let dev = layer.base + g as u64 * layer.block_stride;
                    match dir {
                        Direction::Store => b.push(dev, host, page, mergeable),
                        Direction::Load => b.push(host, dev, page, mergeable),
                    }
                    mergeable = true;
                    host += page;
                }
                prev_segment = Some(layer.segment);
            }
        }
        let bytes = chunk_ids.len() as u64 * self.chunk_bytes;
        b.finish(pages as u64, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layer(base: u64, stride: u64, page: u64, n: u64, segment: u64) -> LayerGeometry {
        LayerGeometry {
            base,
            block_stride: stride,
            page_bytes: page,
            num_blocks: n,
            segment,
        }
    }

    const HOST: u64 = 1 << 40;

    /// Reference: one descriptor per page, no merging, same enumeration order.
    fn pages_of(
        lay: &TransferLayout,
        dir: Direction,
        g: &[i64],
        c: &[i64],
    ) -> Vec<(u64, u64, u64)> {
        let mut v = vec![];
        for (j, &cid) in c.iter().enumerate() {
            for (l, layer) in lay.layers.iter().enumerate() {
                for k in 0..lay.blocks_per_chunk {
                    let host = HOST
                        + cid as u64 * lay.chunk_bytes
                        + lay.seg_offsets[l]
                        + k as u64 * layer.page_bytes;
                    let dev =
                        layer.base + g[j * lay.blocks_per_chunk + k] as u64 * layer.block_stride;
                    v.push(match dir {
                        Direction::Store => (dev, host, layer.page_bytes),
                        Direction::Load => (host, dev, layer.page_bytes),
                    });
                }
            }
        }
        v
    }

    fn expand(r: &CopyRuns, pages: &[(u64, u64, u64)]) -> Vec<(u64, u64, u64)> {
        // Split each run back into pages of the sizes the reference used, in order.
        let mut out = vec![];
        let mut it = pages.iter();
        for i in 0..r.len() {
            let (mut s, mut d, mut left) = (r.src()[i], r.dst()[i], r.lens()[i]);
            while left > 0 {
                let &(_, _, len) = it.next().expect("runs cover more than the pages");
                out.push((s, d, len));
                s += len;
                d += len;
                left -= len;
            }
        }
        out
    }

    #[test]
    fn geometry_checks() {
        let l = layer(0, 64, 64, 10, 0);
        assert!(TransferLayout::new(vec![l], 2, HOST, 4, 128, 0).is_ok());
        assert!(TransferLayout::new(vec![l], 2, HOST, 4, 127, 0).is_err());
        assert!(TransferLayout::new(vec![], 1, HOST, 4, 64, 0).is_err());
        assert!(TransferLayout::new(vec![l], 0, HOST, 4, 64, 0).is_err());
        assert!(TransferLayout::new(vec![layer(0, 32, 64, 10, 0)], 1, HOST, 4, 64, 0).is_err());
        assert!(
            TransferLayout::new(vec![layer(u64::MAX - 10, 64, 64, 2, 0)], 1, HOST, 4, 64, 0)
                .is_err()
        );
        assert!(TransferLayout::new(vec![l], 1, HOST, 4, 64, 96).is_err());
    }

    #[test]
    fn rejects_bad_requests() {
        let lay = TransferLayout::new(vec![layer(0, 64, 64, 10, 0)], 2, HOST, 4, 128, 0).unwrap();
        let mut s = PlanScratch::default();
        let st = Direction::Store;
        assert!(matches!(
            lay.plan(st, &[1, 2, 3], &[0, 1], &mut s),
            Err(HostError::InvalidArgument(_))
        ));
        assert!(matches!(
            lay.plan(st, &[1, 2], &[4], &mut s),
            Err(HostError::OutOfRange(_))
        ));
        assert!(matches!(
            lay.plan(st, &[1, 10], &[0], &mut s),
            Err(HostError::OutOfRange(_))
        ));
        assert!(matches!(
            lay.plan(st, &[-1, 0], &[0], &mut s),
            Err(HostError::OutOfRange(_))
        ));
        assert!(matches!(
            lay.plan(st, &[1, 2, 3, 4], &[1, 1], &mut s),
            Err(HostError::InvalidArgument(_))
        ));
        // Duplicate sources are fine for a store; duplicate destinations are not for a load.
        assert!(lay.plan(st, &[1, 1, 1, 1], &[0, 1], &mut s).is_ok());
        assert!(lay.plan(Direction::Load, &[1, 1], &[0], &mut s).is_err());
        // The scratch bitmap is left clean after both outcomes.
        assert!(lay
            .plan(Direction::Load, &[1, 2, 3, 4], &[0, 0], &mut s)
            .is_ok());
        assert!(s.bits.iter().all(|&w| w == 0));
    }

    #[test]
    fn contiguous_blocks_merge_per_layer_segment() {
        let layers = vec![layer(0, 100, 100, 64, 1), layer(1 << 20, 50, 50, 64, 2)];
        let lay = TransferLayout::new(layers, 4, HOST, 8, 600, 0).unwrap();
        let runs = lay
            .plan(
                Direction::Store,
                &[8, 9, 10, 11, 20, 21, 22, 23],
                &[3, 4],
                &mut PlanScratch::default(),
            )
            .unwrap();
        // Two chunks x two layers, each segment one run; nothing merges across layers.
        assert_eq!(runs.len(), 4);
        assert_eq!(runs.pages(), 16);
        assert_eq!(runs.bytes(), 1200);
        assert_eq!(runs.lens(), &[400, 200, 400, 200]);
        assert_eq!(runs.src()[0], 800);
        assert_eq!(runs.dst()[0], HOST + 3 * 600);
    }

    #[test]
    fn single_layer_merges_across_chunks_but_not_registration_pieces() {
        let lay =
            TransferLayout::new(vec![layer(0, 64, 64, 64, 0)], 2, HOST, 8, 128, 4 * 128).unwrap();
        let g: Vec<i64> = (0..12).collect();
        let runs = lay
            .plan(
                Direction::Load,
                &g,
                &[1, 2, 3, 4, 5, 6],
                &mut PlanScratch::default(),
            )
            .unwrap();
        // Chunks 1..=3 then 4..=6: chunk 4 starts a new registration piece.
        assert_eq!(runs.lens(), &[384, 384]);
    }

    #[test]
    fn cross_layer_block_layout_merges_whole_chunks() {
        // Two layers interleaved in one allocation: block b of layer l at b*256 + l*128.
        let layers = vec![layer(0, 256, 128, 16, 7), layer(128, 256, 128, 16, 7)];
        let lay = TransferLayout::new(layers, 1, HOST, 16, 256, 0).unwrap();
        let runs = lay
            .plan(
                Direction::Store,
                &[5, 6, 9],
                &[0, 1, 2],
                &mut PlanScratch::default(),
            )
            .unwrap();
        assert_eq!(runs.lens(), &[512, 256]);
        // The same addresses in different allocations must not merge.
        let layers = vec![layer(0, 256, 128, 16, 7), layer(128, 256, 128, 16, 8)];
        let lay = TransferLayout::new(layers, 1, HOST, 16, 256, 0).unwrap();
        let runs = lay
            .plan(Direction::Store, &[5], &[0], &mut PlanScratch::default())
            .unwrap();
        assert_eq!(runs.len(), 2);
    }

    #[test]
    fn soa_and_alignment() {
        let lay = TransferLayout::new(vec![layer(0, 64, 24, 8, 0)], 1, HOST, 8, 24, 0).unwrap();
        let runs = lay
            .plan(
                Direction::Load,
                &[3, 1],
                &[5, 6],
                &mut PlanScratch::default(),
            )
            .unwrap();
        assert_eq!(runs.alignment(), 8);
        let mut out = vec![0i64; 6];
        runs.write_soa(0, &mut out).unwrap();
        assert_eq!(
            out,
            vec![(HOST + 120) as i64, (HOST + 144) as i64, 192, 64, 24, 24]
        );
        assert!(runs.write_soa(0, &mut [0i64; 5]).is_err());
        // Cutting: one 48-byte run becomes pieces of 16 + 16 + 16.
        let lay = TransferLayout::new(vec![layer(0, 24, 24, 8, 0)], 2, HOST, 8, 48, 0).unwrap();
        let runs = lay
            .plan(Direction::Store, &[2, 3], &[1], &mut PlanScratch::default())
            .unwrap();
        assert_eq!(
            (runs.len(), runs.count_pieces(16), runs.count_pieces(0)),
            (1, 3, 1)
        );
        let mut out = vec![0i64; 9];
        runs.write_soa(16, &mut out).unwrap();
        let h = (HOST + 48) as i64;
        assert_eq!(out, vec![48, 64, 80, h, h + 16, h + 32, 16, 16, 16]);
    }

    proptest! {
        #[test]
        fn runs_cover_exactly_the_pages(
            bpc in 1usize..4,
            pages in proptest::collection::vec(1u64..5, 1..4),
            gap in 0u64..2,
            seed in proptest::collection::vec(0i64..12, 0..24),
            load in any::<bool>(),
        ) {
            let n_blocks = 12u64;
            let mut base = 0;
            let layers: Vec<_> = pages.iter().map(|&p| {
                let l = layer(base, (p + gap) * 8, p * 8, n_blocks, 0);
                base += n_blocks * (p + gap) * 8;
                l
            }).collect();
            let chunk_bytes = pages.iter().sum::<u64>() * 8 * bpc as u64;
            let lay = TransferLayout::new(layers, bpc, HOST, 6, chunk_bytes, 0).unwrap();
            let n_chunks = seed.len() / bpc;
            let g: Vec<i64> = seed[..n_chunks * bpc].to_vec();
            let c: Vec<i64> = (0..n_chunks as i64).map(|i| (i * 5) % 6).collect();
            let dir = if load { Direction::Load } else { Direction::Store };
            match lay.plan(dir, &g, &c, &mut PlanScratch::default()) {
                Ok(runs) => {
                    let want = pages_of(&lay, dir, &g, &c);
                    prop_assert_eq!(expand(&runs, &want), want.clone());
                    prop_assert_eq!(runs.bytes(), want.iter().map(|p| p.2).sum::<u64>());
                    // Maximal merging: no two consecutive runs continue each other.
                    for i in 1..runs.len() {
                        prop_assert!(!(runs.src()[i - 1] + runs.lens()[i - 1] == runs.src()[i]
                            && runs.dst()[i - 1] + runs.lens()[i - 1] == runs.dst()[i]));
                    }
                }
                Err(_) => {
                    // Only a repeated destination can fail here.
                    let dest = if load { g.clone() } else { c.clone() };
                    let mut sorted = dest.clone();
                    sorted.sort_unstable();
                    sorted.dedup();
                    prop_assert!(sorted.len() < dest.len());
                }
            }
        }
    }
}
