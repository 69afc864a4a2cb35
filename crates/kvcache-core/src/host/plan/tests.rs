use super::*;
use proptest::prelude::*;

// Checked conversions for test arithmetic (the values are small and known).
fn u(x: i64) -> u64 {
    u64::try_from(x).expect("non-negative")
}
fn i(x: u64) -> i64 {
    i64::try_from(x).expect("below 2^63")
}
fn us(x: u64) -> usize {
    usize::try_from(x).expect("fits in usize")
}
fn w(x: usize) -> u64 {
    u64::try_from(x).expect("fits in u64")
}

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

fn host(num_chunks: u64, chunk_stride: u64) -> HostGeometry {
    HostGeometry {
        base: HOST,
        num_chunks,
        chunk_stride,
        split_bytes: 0,
    }
}

fn r(tensor: usize, bytes: u64) -> GroupRef {
    GroupRef { tensor, bytes }
}

fn span(blocks: usize, first_index: u64) -> GroupSpan {
    GroupSpan {
        blocks,
        first_index,
    }
}

/// `(pages, bytes, logical_bytes)` of the validated request: the counts a plan's runs were
/// built from.
fn counts(
    lay: &TransferLayout,
    dir: Direction,
    g: &[i64],
    c: &[i64],
    spans: &[GroupSpan],
) -> (u64, u64, u64) {
    let req = lay
        .validate(
            dir,
            g.to_vec(),
            c.to_vec(),
            spans.to_vec(),
            &mut PlanScratch::default(),
        )
        .unwrap();
    (req.pages(), req.bytes(), req.logical_bytes())
}

/// Reference: one descriptor per (block, chunk segment) page, no merging, enumerated like the
/// planner (chunk, layer, block) for the single whole-chunk group.
fn pages_of(lay: &TransferLayout, dir: Direction, g: &[i64], c: &[i64]) -> Vec<(u64, u64, u64)> {
    let mut v = vec![];
    for (j, &cid) in c.iter().enumerate() {
        for (l, layer) in lay.layers.iter().enumerate() {
            for k in 0..lay.blocks_per_chunk {
                let host = HOST
                    + u(cid) * lay.host.chunk_stride
                    + lay.host_offsets[l]
                    + w(k) * layer.page_bytes;
                let dev = layer.base + u(g[j * lay.blocks_per_chunk + k]) * layer.block_stride;
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
        TransferLayout::new(vec![layer(u64::MAX - 10, 64, 64, 2, 0)], 1, HOST, 4, 64, 0).is_err()
    );
    assert!(TransferLayout::new(vec![l], 1, HOST, 4, 64, 96).is_err());
    // General form: segments must fit in the chunk and not overlap; references in range.
    let two = vec![l, layer(1 << 20, 64, 64, 10, 1)];
    let ok = |offsets: Vec<u64>, groups: Vec<Vec<GroupRef>>, stride: u64| {
        TransferLayout::with_groups(two.clone(), offsets, groups, 2, host(4, stride)).is_ok()
    };
    assert!(ok(vec![0, 128], vec![vec![r(0, 64), r(1, 32)]], 256));
    assert!(ok(vec![128, 0], vec![vec![r(1, 64)], vec![r(0, 1)]], 300));
    assert!(
        !ok(vec![0, 64], vec![vec![r(0, 64)]], 256),
        "overlapping segments"
    );
    assert!(
        !ok(vec![0, 129], vec![vec![r(0, 64)]], 256),
        "segment past the chunk"
    );
    assert!(
        !ok(vec![0, 128], vec![vec![r(2, 64)]], 256),
        "tensor out of range"
    );
    assert!(
        !ok(vec![0, 128], vec![vec![r(0, 65)]], 256),
        "more than a page"
    );
    assert!(
        !ok(vec![0, 128], vec![vec![r(0, 0)]], 256),
        "empty reference"
    );
    assert!(!ok(vec![0], vec![vec![r(0, 64)]], 256), "offset count");
    assert!(!ok(vec![0, 128], vec![], 256), "no group");
}

#[test]
fn rejects_bad_requests() {
    let lay = TransferLayout::new(vec![layer(0, 64, 64, 10, 0)], 2, HOST, 4, 128, 0).unwrap();
    let mut s = PlanScratch::default();
    let st = Direction::Store;
    assert!(matches!(
        lay.plan(st, &[1, 2, 3], &[0, 1], &mut s),
        Err(HostError::Mismatch(_))
    ));
    assert!(matches!(
        lay.plan(st, &[1, 2], &[4], &mut s),
        Err(HostError::OutOfRange {
            what: "chunk",
            id: 4,
            position: 0,
            bound: 4
        })
    ));
    assert!(matches!(
        lay.plan(st, &[1, 10], &[0], &mut s),
        Err(HostError::OutOfRange { .. })
    ));
    assert!(matches!(
        lay.plan(st, &[-1, 0], &[0], &mut s),
        Err(HostError::OutOfRange { .. })
    ));
    assert!(matches!(
        lay.plan(st, &[1, 2, 3, 4], &[1, 1], &mut s),
        Err(HostError::DuplicateDestination {
            what: "chunk",
            id: 1,
            position: 1
        })
    ));
    // Duplicate sources are fine for a store; duplicate destinations are not for a load.
    assert!(lay.plan(st, &[1, 1, 1, 1], &[0, 1], &mut s).is_ok());
    assert!(lay.plan(Direction::Load, &[1, 1], &[0], &mut s).is_err());
    // The scratch bitmap is left clean after both outcomes.
    assert!(lay
        .plan(Direction::Load, &[1, 2, 3, 4], &[0, 0], &mut s)
        .is_ok());
    assert!(s.bits.iter().all(|&w| w == 0));
    // Spans must cover the ids exactly and match the group count.
    let sp = |blocks, first| [span(blocks, first)];
    assert!(lay
        .plan_groups(st, &[1, 2, 3], &[0, 1], &sp(3, 0), &mut s)
        .is_ok());
    assert!(lay
        .plan_groups(st, &[1, 2, 3], &[0, 1], &sp(3, 1), &mut s)
        .is_ok());
    assert!(lay
        .plan_groups(st, &[1, 2, 3], &[0], &sp(3, 1), &mut s)
        .is_err());
    assert!(lay
        .plan_groups(st, &[1, 2, 3], &[0, 1, 2], &sp(3, 1), &mut s)
        .is_err());
    assert!(lay
        .plan_groups(st, &[1, 2], &[0], &sp(3, 0), &mut s)
        .is_err());
    assert!(lay
        .plan_groups(st, &[1], &[0], &[span(1, 0), span(0, 0)], &mut s)
        .is_err());
    assert!(lay
        .plan_groups(st, &[1], &[0], &sp(usize::MAX, u64::MAX), &mut s)
        .is_err());
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
    let ids = [8, 9, 10, 11, 20, 21, 22, 23];
    let (pages, bytes, logical) = counts(&lay, Direction::Store, &ids, &[3, 4], &[span(8, 0)]);
    assert_eq!(pages, 16);
    assert_eq!(bytes, 1200);
    assert_eq!(logical, 1200);
    assert_eq!(runs.lens(), &[400, 200, 400, 200]);
    assert_eq!(runs.src()[0], 800);
    assert_eq!(runs.dst()[0], HOST + 3 * 600);
}

#[test]
fn single_layer_merges_across_chunks_but_not_registration_pieces() {
    let lay = TransferLayout::new(vec![layer(0, 64, 64, 64, 0)], 2, HOST, 8, 128, 4 * 128).unwrap();
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
fn partial_chunks_skip_slots_and_padded_pages_move_their_payload() {
    // One tensor, 4 slots of 64 bytes per chunk; the group copies 48 bytes of each page.
    let lay = TransferLayout::with_groups(
        vec![layer(0, 64, 64, 32, 0)],
        vec![0],
        vec![vec![r(0, 48)]],
        4,
        host(8, 256),
    )
    .unwrap();
    // 6 blocks starting at logical index 7: slot 3 of chunk 5, then slots 0..=3 of chunk 2,
    // then slot 0 of chunk 6.
    let runs = lay
        .plan_groups(
            Direction::Store,
            &[10, 11, 12, 13, 14, 15],
            &[5, 2, 6],
            &[span(6, 7)],
            &mut PlanScratch::default(),
        )
        .unwrap();
    let want: Vec<(u64, u64, u64)> = vec![
        (10 * 64, HOST + 5 * 256 + 3 * 64, 48),
        (11 * 64, HOST + 2 * 256, 48),
        (12 * 64, HOST + 2 * 256 + 64, 48),
        (13 * 64, HOST + 2 * 256 + 128, 48),
        (14 * 64, HOST + 2 * 256 + 192, 48),
        (15 * 64, HOST + 6 * 256, 48),
    ];
    let got: Vec<_> = (0..runs.len())
        .map(|i| (runs.src()[i], runs.dst()[i], runs.lens()[i]))
        .collect();
    assert_eq!(got, want);
    assert_eq!(
        counts(
            &lay,
            Direction::Store,
            &[10, 11, 12, 13, 14, 15],
            &[5, 2, 6],
            &[span(6, 7)]
        ),
        (6, 288, 288)
    );
}

#[test]
fn groups_share_tensors_and_duplicate_references_move_once() {
    // Tensors 0 and 1; group 0 references tensor 0 twice (the larger size moves once), group 1
    // references tensor 0 too, so both groups are one class; group 2 only tensor 1.
    let layers = vec![layer(0, 64, 64, 16, 0), layer(1 << 20, 32, 32, 16, 1)];
    let lay = TransferLayout::with_groups(
        layers,
        vec![0, 128],
        vec![vec![r(0, 16), r(0, 40)], vec![r(0, 64)], vec![r(1, 32)]],
        2,
        host(8, 192),
    )
    .unwrap();
    assert_eq!(lay.num_classes, 2);
    let mut s = PlanScratch::default();
    let spans = [span(2, 0), span(1, 1), span(1, 0)];
    let runs = lay
        .plan_groups(Direction::Load, &[3, 4, 5, 3], &[0, 1, 2], &spans, &mut s)
        .unwrap();
    let (pages, bytes, logical) = counts(&lay, Direction::Load, &[3, 4, 5, 3], &[0, 1, 2], &spans);
    assert_eq!(pages, 4);
    assert_eq!(bytes, 2 * 40 + 64 + 32);
    assert_eq!(logical, 2 * 56 + 64 + 32);
    assert_eq!(runs.lens().iter().sum::<u64>(), bytes);
    // Block 3 in groups 0 and 2 is fine (different tensors); in groups 0 and 1 it is not.
    let err = lay.plan_groups(Direction::Load, &[3, 4, 3, 5], &[0, 1, 2], &spans, &mut s);
    assert!(matches!(
        err,
        Err(HostError::DuplicateDestination {
            what: "block",
            position: 2,
            ..
        })
    ));
    assert!(s.bits.iter().all(|&w| w == 0));
    // A store names chunks: chunk 1 twice in one class is refused.
    let err = lay.plan_groups(Direction::Store, &[3, 4, 5, 6], &[1, 1, 2], &spans, &mut s);
    assert!(err.is_err());
    assert!(s.bits.iter().all(|&w| w == 0));
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
    assert_eq!(out, vec![i(HOST + 120), i(HOST + 144), 192, 64, 24, 24]);
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
    let h = i(HOST + 48);
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
        let c: Vec<i64> = (0..i(w(n_chunks))).map(|i| (i * 5) % 6).collect();
        let dir = if load { Direction::Load } else { Direction::Store };
        match lay.plan(dir, &g, &c, &mut PlanScratch::default()) {
            Ok(runs) => {
                let want = pages_of(&lay, dir, &g, &c);
                prop_assert_eq!(expand(&runs, &want), want.clone());
                let (_, bytes, _) = counts(&lay, dir, &g, &c, &[span(g.len(), 0)]);
                prop_assert_eq!(bytes, want.iter().map(|p| p.2).sum::<u64>());
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

/// vLLM 0.33.0's descriptor rule, one copy per (group, reference, block), applied to a byte
/// arena: block pointers `base + id * stride`, chunk sub-slots `chunk * stride + offset +
/// j * page`, the group's slots taken from `skip` on.
fn reference_copy(
    lay: &TransferLayout,
    groups: &[Vec<GroupRef>],
    dir: Direction,
    g: &[i64],
    c: &[i64],
    spans: &[GroupSpan],
    arena: &mut [u8],
) {
    let bpc = lay.blocks_per_chunk;
    let (mut go, mut co) = (0, 0);
    for (refs, s) in groups.iter().zip(spans) {
        if s.blocks == 0 {
            continue;
        }
        let skip = us(s.first_index % w(bpc));
        let nc = (skip + s.blocks).div_ceil(bpc);
        for rf in refs {
            let t = &lay.layers[rf.tensor];
            for i in 0..s.blocks {
                let dev = us(t.base + u(g[go + i]) * t.block_stride);
                let slot = skip + i;
                let chunk = u(c[co + slot / bpc]);
                let host = us(HOST
                    + chunk * lay.host.chunk_stride
                    + lay.host_offsets[rf.tensor]
                    + w(slot % bpc) * t.page_bytes);
                let (src, dst) = match dir {
                    Direction::Store => (dev, host),
                    Direction::Load => (host, dev),
                };
                let n = us(rf.bytes);
                let host0 = us(HOST) - ARENA_DEV;
                let fix = |a: usize| if a >= us(HOST) { a - host0 } else { a };
                arena.copy_within(fix(src)..fix(src) + n, fix(dst));
            }
        }
        go += s.blocks;
        co += nc;
    }
}

/// Device addresses live in `[0, ARENA_DEV)`, host addresses from `HOST` map after them.
const ARENA_DEV: usize = 1 << 14;

fn apply_runs(runs: &CopyRuns, arena: &mut [u8]) {
    let host0 = us(HOST) - ARENA_DEV;
    let fix = |a: u64| {
        let a = us(a);
        if a >= us(HOST) {
            a - host0
        } else {
            a
        }
    };
    for i in 0..runs.len() {
        let (s, d, n) = (fix(runs.src()[i]), fix(runs.dst()[i]), us(runs.lens()[i]));
        arena.copy_within(s..s + n, d);
    }
}

#[derive(Debug, Clone)]
struct GroupedCase {
    bpc: usize,
    /// (page words, gap words) per tensor.
    tensors: Vec<(u64, u64)>,
    /// Per group: (tensor, fraction of the page in eighths) references.
    groups: Vec<Vec<(usize, u64)>>,
    /// Per group: (blocks, first index).
    spans: Vec<(usize, u64)>,
    load: bool,
    seed: u64,
}

fn grouped_case() -> impl Strategy<Value = GroupedCase> {
    (
        1usize..5,
        proptest::collection::vec((1u64..4, 0u64..2), 1..4),
    )
        .prop_flat_map(|(bpc, tensors)| {
            let nt = tensors.len();
            let group = proptest::collection::vec((0..nt, 1u64..=8), 1..4);
            (
                Just(bpc),
                Just(tensors),
                proptest::collection::vec(group, 1..4),
                proptest::collection::vec((0usize..9, 0u64..20), 3),
                any::<bool>(),
                any::<u64>(),
            )
                .prop_map(|(bpc, tensors, groups, spans, load, seed)| {
                    let spans = spans[..groups.len()].to_vec();
                    GroupedCase {
                        bpc,
                        tensors,
                        groups,
                        spans,
                        load,
                        seed,
                    }
                })
        })
}

fn shuffled(n: u64, seed: u64) -> Vec<i64> {
    let mut v: Vec<i64> = (0..i(n)).collect();
    let mut x = seed | 1;
    for k in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(k, us(x % (w(k) + 1)));
    }
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]
    /// Groups, partial chunks, padded pages and shared tensors: the planner's runs leave the
    /// arena exactly as vLLM's one-descriptor-per-page rule does.
    #[test]
    fn grouped_plans_match_the_per_page_reference(case in grouped_case()) {
        let n_blocks = 24u64;
        let mut base = 0u64;
        let layers: Vec<LayerGeometry> = case.tensors.iter().enumerate().map(|(k, &(p, gap))| {
            let l = layer(base, (p + gap) * 8, p * 8, n_blocks, w(k));
            base += n_blocks * (p + gap) * 8;
            l
        }).collect();
        prop_assert!(us(base) <= ARENA_DEV);
        let offsets = TransferLayout::packed_offsets(&layers, case.bpc).unwrap();
        let chunk = offsets[offsets.len() - 1] + 8; // one spare word per chunk
        let groups: Vec<Vec<GroupRef>> = case.groups.iter().map(|refs| {
            refs.iter().map(|&(t, eighths)| {
                // Sizes that are whole words, at least one, at most the page.
                let page = layers[t].page_bytes;
                r(t, (page * eighths / 8).max(8) / 8 * 8)
            }).collect()
        }).collect();
        let num_chunks = 16u64;
        let lay = TransferLayout::with_groups(
            layers.clone(), offsets[..layers.len()].to_vec(), groups.clone(), case.bpc,
            host(num_chunks, chunk),
        ).unwrap();
        // Distinct ids across the whole job (every class), enough for the spans.
        let spans: Vec<GroupSpan> = case.spans.iter().map(|&(b, f)| span(b, f)).collect();
        let total_blocks: usize = spans.iter().map(|s| s.blocks).sum();
        let total_chunks: usize = spans.iter().map(|s| if s.blocks == 0 { 0 } else {
            (s.blocks + us(s.first_index % w(case.bpc))).div_ceil(case.bpc)
        }).sum();
        prop_assume!(w(total_blocks) <= n_blocks && w(total_chunks) <= num_chunks);
        let g = shuffled(n_blocks, case.seed)[..total_blocks].to_vec();
        let c = shuffled(num_chunks, case.seed ^ 0x5eed)[..total_chunks].to_vec();
        let dir = if case.load { Direction::Load } else { Direction::Store };
        let req = lay.validate(dir, g.clone(), c.clone(), spans.clone(), &mut PlanScratch::default())
            .unwrap();
        let runs = lay.build(&req);
        // The bound the submitting thread reads; exact when no run can join two tensors: every
        // group has two distinct tensors and no two groups meet on one.
        let bound = lay.max_runs(&req);
        prop_assert!(w(runs.len()) <= bound);
        let distinct = |g: &[GroupRef]| g.iter().map(|r| r.tensor).collect::<std::collections::BTreeSet<_>>();
        let exact = groups.iter().all(|g| distinct(g).len() >= 2)
            && groups.windows(2).all(|p| distinct(&p[0]).is_disjoint(&distinct(&p[1])));
        if exact {
            prop_assert_eq!(w(runs.len()), bound);
        }
        let arena_len = ARENA_DEV + us(num_chunks * chunk);
        let init: Vec<u8> = (0..arena_len).map(|k| u8::try_from((k * 31 + k / 256) % 251).unwrap()).collect();
        let init_copy = init.clone();
        let mut ours = init.clone();
        apply_runs(&runs, &mut ours);
        let mut theirs = init;
        reference_copy(&lay, &groups, dir, &g, &c, &spans, &mut theirs);
        prop_assert!(ours == theirs);
        // The per-block table a copy kernel expands gives the same bytes too.
        let mut kernel = init_copy;
        for group in 0..groups.len() {
            let mut table = vec![];
            lay.block_table(&req, group, &mut table).unwrap();
            let n = table.len() / 3;
            for rf in lay.group_refs(group).unwrap() {
                let [dev_base, stride, off, page, bytes] = rf;
                for i in 0..n {
                    let dev = dev_base + u(table[i]) * stride;
                    let host = u(table[n + i]) + off + u(table[2 * n + i]) * page;
                    let (src, dst) = if case.load { (host, dev) } else { (dev, host) };
                    let host0 = us(HOST) - ARENA_DEV;
                    let fix = |a: u64| if a >= HOST { us(a) - host0 } else { us(a) };
                    kernel.copy_within(fix(src)..fix(src) + us(bytes), fix(dst));
                }
            }
        }
        prop_assert!(kernel == ours);
        // Accounting: vLLM's size is blocks x the sum of the group's reference sizes.
        let logical: u64 = groups.iter().zip(&spans)
            .map(|(refs, s)| w(s.blocks) * refs.iter().map(|r| r.bytes).sum::<u64>())
            .sum();
        prop_assert_eq!(req.logical_bytes(), logical);
        prop_assert!(req.bytes() <= logical);
    }
}
