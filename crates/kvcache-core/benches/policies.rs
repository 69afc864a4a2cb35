//! Core costs without Python: policy batch operations over 100 k resident entries, and the
//! manager's per-request cycle. `cargo bench -p kvcache-core --bench policies`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvcache_core::manager::{ChunkId, Manager, ManagerConfig};
use kvcache_core::{ArcPolicy, HasRefCnt, LruPolicy, Policy, PolicyExt, Protected, SelfCounted};

/// An idle chunk that knows its count, as the Python chunk objects do.
struct Chunk {
    _id: u64,
    ref_cnt: i32,
}

impl Chunk {
    fn new(id: u64, ref_cnt: i32) -> Self {
        Chunk { _id: id, ref_cnt }
    }
}

impl HasRefCnt for Chunk {
    fn ref_cnt(&self) -> i32 {
        self.ref_cnt
    }
}

const ENTRIES: u64 = 100_000;
/// [`ENTRIES`] as a capacity.
const CAPACITY: usize = 100_000;
const BATCH: usize = 256;

fn key(i: u64) -> Vec<u8> {
    let mut k = vec![0u8; 36];
    k[24..32].copy_from_slice(&i.to_be_bytes());
    k
}

/// Deterministic pseudo-random entry indices.
fn picks(n: usize, seed: u64) -> Vec<u64> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % ENTRIES
        })
        .collect()
}

fn filled_arc() -> ArcPolicy<Chunk> {
    let mut p = ArcPolicy::new(CAPACITY);
    for i in 0..ENTRIES {
        let k = key(i);
        p.insert_key(&mut (), p.key(&k), Chunk::new(i, 0), None, true)
            .unwrap();
    }
    // Half of the entries reused once: both T1 and T2 populated.
    let keys: Vec<Vec<u8>> = (0..ENTRIES).step_by(2).map(key).collect();
    let ks: Vec<_> = keys.iter().map(|k| p.key(k)).collect();
    p.touch_keys(&ks, &SelfCounted);
    p
}

fn filled_lru() -> LruPolicy<Chunk> {
    let mut p = LruPolicy::new(CAPACITY);
    for i in 0..ENTRIES {
        let k = key(i);
        p.insert_key(&mut None, p.key(&k), Chunk::new(i, 0), None, true)
            .unwrap();
    }
    p
}

fn policies(c: &mut Criterion) {
    let batches: Vec<Vec<Vec<u8>>> = (0..64)
        .map(|s| picks(BATCH, s + 1).into_iter().map(key).collect())
        .collect();
    let mut group = c.benchmark_group("policy");
    group.throughput(Throughput::Elements(BATCH as u64));

    let mut arc = filled_arc();
    let mut round = 0usize;
    group.bench_function("arc touch(256)", |b| {
        b.iter(|| {
            round += 1;
            let ks: Vec<_> = batches[round % 64].iter().map(|k| arc.key(k)).collect();
            arc.touch_keys(&ks, &SelfCounted);
        })
    });
    let mut lru = filled_lru();
    group.bench_function("lru touch(256)", |b| {
        b.iter(|| {
            round += 1;
            let ks: Vec<_> = batches[round % 64].iter().map(|k| lru.key(k)).collect();
            lru.touch_keys(&ks, &SelfCounted);
        })
    });
    group.bench_function("arc get", |b| {
        b.iter(|| {
            round += 1;
            for k in &batches[round % 64] {
                black_box(arc.get(arc.key(k)));
            }
        })
    });

    group.throughput(Throughput::Elements(32));
    let mut next = ENTRIES;
    group.bench_function("arc evict(32)+reinsert", |b| {
        b.iter(|| {
            let out = arc.evict(32, &Protected::new(), &SelfCounted).unwrap();
            for e in out {
                next += 1;
                let k = key(next);
                arc.insert_key(&mut (), arc.key(&k), e.chunk, None, true)
                    .unwrap();
            }
        })
    });
    group.bench_function("lru evict(32)+reinsert", |b| {
        b.iter(|| {
            let out = lru.evict(32, &Protected::new(), &SelfCounted).unwrap();
            for e in out {
                next += 1;
                let k = key(next);
                lru.insert_key(&mut None, lru.key(&k), e.chunk, None, true)
                    .unwrap();
            }
        })
    });
    group.finish();
}

/// One request of 64 new keys through a full manager: store, complete, finish, release.
fn manager(c: &mut Criterion) {
    fn cycle<P: Policy<ChunkId>>(m: &mut Manager<P>, keys: &[Vec<u8>]) {
        let t = m.request(None);
        let ks: Vec<_> = keys.iter().map(|k| m.key(k)).collect();
        let pos: Vec<_> = (1..=64).map(|j| Some(16 * j)).take(ks.len()).collect();
        black_box(m.prepare_store(t, &ks, &pos, &mut Vec::new()).unwrap());
        m.complete_store(&ks, true);
        black_box(m.take_events());
        m.finish_request(t, &[Some(16); 64]);
        m.release_request(t);
    }
    let config = ManagerConfig {
        num_chunks: 50_000,
        enable_events: true,
        store_threshold: 1,
        max_tracker_size: 64_000,
        semantics: kvcache_core::VllmSemantics::default(),
    };
    let mut group = c.benchmark_group("manager");
    group.throughput(Throughput::Elements(64));
    let requests: Vec<Vec<Vec<u8>>> = (0..4_000u64)
        .map(|r| (0..64).map(|j| key(r * 64 + j)).collect())
        .collect();
    let mut lru: Manager<LruPolicy<u32>> = Manager::new(config).unwrap();
    let mut arc: Manager<ArcPolicy<u32>> = Manager::new(config).unwrap();
    let mut r = 0usize;
    group.bench_function("lru request(64 new keys)", |b| {
        b.iter(|| {
            r += 1;
            cycle(&mut lru, &requests[r % requests.len()])
        })
    });
    group.bench_function("arc request(64 new keys)", |b| {
        b.iter(|| {
            r += 1;
            cycle(&mut arc, &requests[r % requests.len()])
        })
    });
    group.bench_function("lru fresh manager, 1000 requests", |b| {
        b.iter_batched(
            || Manager::<LruPolicy<u32>>::new(config).unwrap(),
            |mut m| {
                for keys in &requests[..1000] {
                    cycle(&mut m, keys);
                }
            },
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30);
    targets = policies, manager
}
criterion_main!(benches);
