//! CPU cost of building copy descriptors (`TransferLayout::plan`): validation, duplicate
//! check and coalescing, per page. Target: <= 50 ns per page descriptor.
//!
//! `cargo bench -p kvcache-core --bench transfer_plan` (criterion reports elements/s = pages/s).

// Rebuilt with the transfer worker; its casts are audited one by one when that lands.
#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss,
    clippy::cast_lossless
)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvcache_core::host::{Direction, LayerGeometry, PlanScratch, TransferLayout};

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
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v.truncate(n);
    v.into_iter().map(|i| i as i64).collect()
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
    let chunk_bytes = LAYERS * PAGE * BPC as u64;
    let layout = TransferLayout::new(layers, BPC, 1 << 46, CHUNKS, chunk_bytes, 0).unwrap();
    let chunks = scattered(JOB_CHUNKS, CHUNKS, 7);
    let pages = (JOB_CHUNKS * BPC) as u64 * LAYERS;
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
    let contiguous: Vec<i64> = (1000..1000 + (JOB_CHUNKS * BPC) as i64).collect();
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
