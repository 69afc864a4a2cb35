//! CPU cost of building copy descriptors (`TransferLayout::plan`): validation, duplicate
//! check and coalescing, per page; and of validation alone (`validate`: what the thread that
//! submits a job pays). Target: <= 50 ns per page descriptor.
//!
//! `cargo bench -p kvcache-core --bench transfer_plan` (criterion reports elements/s = pages/s).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvcache_core::host::{Direction, GroupSpan, LayerGeometry, PlanScratch, TransferLayout};

const LAYERS: u64 = 32;
const BPC: usize = 16;
const PAGE: u64 = 16 * 1024;
const BLOCKS: u64 = 1 << 16;
const CHUNKS: u64 = 4096;
const JOB_CHUNKS: usize = 256;

/// Deterministic pseudo-random permutation prefix (no RNG dependency).
fn scattered(n: usize, universe: u64, seed: u64) -> Vec<i64> {
    let mut v: Vec<u64> = (0..universe).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let bound = u64::try_from(i).expect("small") + 1;
        v.swap(i, usize::try_from(x % bound).expect("below i"));
    }
    v.truncate(n);
    v.into_iter()
        .map(|i| i64::try_from(i).expect("small"))
        .collect()
}

fn bench_plan(c: &mut Criterion) {
    let layers: Vec<LayerGeometry> = (0..LAYERS)
        .map(|l| LayerGeometry {
            base: (1 << 40) + l * BLOCKS * PAGE,
            block_stride: PAGE,
            page_bytes: PAGE,
            num_blocks: BLOCKS,
            segment: l,
        })
        .collect();
    let bpc = u64::try_from(BPC).expect("small");
    let chunk_bytes = LAYERS * PAGE * bpc;
    let layout = TransferLayout::new(layers, BPC, 1 << 46, CHUNKS, chunk_bytes, 0).unwrap();
    let chunks = scattered(JOB_CHUNKS, CHUNKS, 7);
    let pages = u64::try_from(JOB_CHUNKS * BPC).expect("small") * LAYERS;
    let mut group = c.benchmark_group("transfer_plan");
    group.throughput(Throughput::Elements(pages));
    let mut scratch = PlanScratch::default();
    let blocks = scattered(JOB_CHUNKS * BPC, BLOCKS, 11);
    group.bench_function("scattered", |b| {
        b.iter(|| {
            layout
                .plan(Direction::Store, &blocks, &chunks, &mut scratch)
                .unwrap()
        })
    });
    let job_blocks = i64::try_from(JOB_CHUNKS * BPC).expect("small");
    let contiguous: Vec<i64> = (1000..1000 + job_blocks).collect();
    group.bench_function("scattered_validate_only", |b| {
        b.iter(|| {
            let spans = vec![GroupSpan {
                blocks: blocks.len(),
                first_index: 0,
            }];
            layout
                .validate(
                    Direction::Store,
                    blocks.clone(),
                    chunks.clone(),
                    spans,
                    &mut scratch,
                )
                .unwrap()
        })
    });
    group.bench_function("contiguous", |b| {
        b.iter(|| {
            layout
                .plan(Direction::Load, &contiguous, &chunks, &mut scratch)
                .unwrap()
        })
    });
    group.finish();
}

criterion_group!(benches, bench_plan);
criterion_main!(benches);
