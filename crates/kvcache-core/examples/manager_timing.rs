//! Quick timing of the manager core on a store-heavy request stream (not a benchmark suite;
//! see benches/ for those).
use std::time::Instant;

use kvcache_core::manager::{Manager, ManagerConfig};
use kvcache_core::LruPolicy;

fn main() {
    let config = ManagerConfig {
        num_chunks: 20_000,
        enable_events: true,
        store_threshold: 1,
        max_tracker_size: 64_000,
    };
    let mut m: Manager<LruPolicy<u32>> = Manager::new(config);
    let keys: Vec<Vec<u8>> = (0..28_000u64)
        .map(|i| {
            let mut k = vec![0u8; 36];
            k[..8].copy_from_slice(&i.to_be_bytes());
            k
        })
        .collect();
    let mut token = None;
    let rounds = 20;
    let start = Instant::now();
    for _ in 0..rounds {
        for r in 0..2000 {
            let t = m.request(token.take());
            let ks: Vec<_> = keys[r * 14..r * 14 + 14].iter().map(|k| m.key(k)).collect();
            let pos: Vec<_> = (0..14).map(|j| Some(16 * (j as i64 + 1))).collect();
            let out = m.prepare_store(t, &ks, &pos).unwrap();
            std::hint::black_box(&out);
            m.complete_store(&ks, true);
            std::hint::black_box(m.take_events());
            m.finish_request(t, |_| Ok::<_, ()>(Some(16))).unwrap();
            m.release_request(t);
        }
    }
    let per = start.elapsed().as_nanos() as f64 / (rounds * 2000) as f64;
    println!("core: {per:.0} ns per request (prepare_store+complete_store+events+finish, 14 keys)");
}
