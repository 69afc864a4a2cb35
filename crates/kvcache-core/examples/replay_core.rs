//! The replay driver's semantics (`python -m kvcache replay`, lag 8, every store succeeds) in
//! pure Rust, to time and profile the manager without Python:
//! `cargo run --release --example replay_core -- FILE POLICY CHUNKS [REPEATS]` (POLICY: a
//! policy's short name, `lru` or `arc`).
//! FILE comes from `bench/dump_workload.py` (u32 request count, u32 block tokens, then per
//! request a u32 key count and 36-byte keys, little-endian). Prints ns per key visit for each
//! repeat, and to stderr the split by phase (per key visit; each request's keys are hashed
//! twice, once per phase that takes them, as the bindings do).

use std::collections::VecDeque;
use std::time::Instant;

use kvcache_core::manager::{ChunkId, LookupResult, Manager, ManagerConfig};
use kvcache_core::Policy;

fn read_u32(b: &[u8], at: &mut usize) -> u32 {
    let v = u32::from_le_bytes(b[*at..*at + 4].try_into().unwrap());
    *at += 4;
    v
}

fn load(path: &str) -> (Vec<Vec<Vec<u8>>>, i64) {
    let b = std::fs::read(path).expect("read workload");
    let mut at = 0;
    let n = read_u32(&b, &mut at);
    let bt = i64::from(read_u32(&b, &mut at));
    let reqs = (0..n)
        .map(|_| {
            let k = usize::try_from(read_u32(&b, &mut at)).expect("a key count");
            (0..k)
                .map(|_| {
                    let key = b[at..at + 36].to_vec();
                    at += 36;
                    key
                })
                .collect()
        })
        .collect();
    (reqs, bt)
}

fn run<P: Policy<ChunkId>>(reqs: &[Vec<Vec<u8>>], bt: i64, chunks: usize) -> (u128, usize, usize) {
    let mut m: Manager<P> = Manager::new(ManagerConfig {
        num_chunks: chunks,
        enable_events: false,
        store_threshold: 1,
        max_tracker_size: 64_000,
        semantics: kvcache_core::VllmSemantics::default(),
    })
    .expect("a valid configuration");
    let mut pending = VecDeque::new();
    let mut hits = 0;
    let mut visits = 0;
    let start = Instant::now();
    let mut ph = [0u128; 6];
    let mut clock = Instant::now();
    let mut lap = |i: usize, ph: &mut [u128; 6]| {
        let now = Instant::now();
        ph[i] += (now - clock).as_nanos();
        clock = now;
    };
    for keys in reqs {
        visits += keys.len();
        let t = m.request(None);
        let ks: Vec<_> = keys.iter().map(|k| m.key(k)).collect();
        let pos: Vec<_> = (1..).map(|j| Some(bt * j)).take(ks.len()).collect();
        lap(0, &mut ph);
        let n = ks
            .iter()
            .take_while(|&&k| m.lookup(k) == LookupResult::Hit)
            .count();
        hits += n;
        lap(1, &mut ph);
        let mut observed = Vec::new();
        if n > 0 {
            m.prepare_load(t, &ks[..n], &pos[..n], &mut observed)
                .unwrap();
        }
        lap(2, &mut ph);
        let mut stored = Vec::new();
        if n < ks.len() {
            if let Some(out) = m
                .prepare_store(t, &ks[n..], &pos[n..], &mut observed)
                .unwrap()
            {
                stored = out.stored.iter().map(|&i| i + n).collect();
            }
        }
        lap(3, &mut ph);
        pending.push_back((t, keys, n, stored));
        if pending.len() > 8 {
            let (t, keys, n, stored) = pending.pop_front().unwrap();
            let ks: Vec<_> = keys.iter().map(|k| m.key(k)).collect();
            if n > 0 {
                m.complete_load(&ks[..n]).unwrap();
            }
            let st: Vec<_> = stored.iter().map(|&i| ks[i]).collect();
            m.complete_store(&st, true);
            lap(4, &mut ph);
            let positions: Vec<_> = (1..).map(|j| Some(bt * j)).take(keys.len()).collect();
            m.finish_request(t, &positions);
            m.release_request(t);
            lap(5, &mut ph);
        }
    }
    let v: usize = reqs.iter().map(|r| r.len()).sum();
    eprintln!(
        "keys {:.0} lookup {:.0} pload {:.0} pstore {:.0} complete {:.0} finish {:.0}",
        ratio(ph[0], v),
        ratio(ph[1], v),
        ratio(ph[2], v),
        ratio(ph[3], v),
        ratio(ph[4], v),
        ratio(ph[5], v)
    );
    (start.elapsed().as_nanos(), visits, hits)
}

/// `part / whole` for the report.
#[allow(clippy::cast_precision_loss, reason = "a printed ratio")]
fn ratio(part: u128, whole: usize) -> f64 {
    part as f64 / whole as f64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (reqs, bt) = load(&args[1]);
    let chunks: usize = args[3].parse().unwrap();
    let reps: usize = args.get(4).map_or(3, |s| s.parse().unwrap());
    let policy = args[2].as_str();
    // The runner of each policy the crate offers, by its short name.
    macro_rules! runners {
        ($($(#[$doc:meta])* $module:ident::$policy:ident as $kind:ident = $class:literal;)*) => {
            [$((
                <kvcache_core::$policy<u32> as Policy<u32>>::NAME,
                run::<kvcache_core::$policy<u32>> as fn(&[Vec<Vec<u8>>], i64, usize) -> (u128, usize, usize),
            )),*]
        };
    }
    let runners = kvcache_core::for_each_policy!(runners);
    let Some(&(_, run)) = runners.iter().find(|(name, _)| *name == policy) else {
        let names: Vec<_> = runners.iter().map(|(name, _)| *name).collect();
        eprintln!(
            "unknown policy {policy:?}: choose from {}",
            names.join(", ")
        );
        std::process::exit(2);
    };
    for _ in 0..reps {
        let (ns, visits, hits) = run(&reqs, bt, chunks);
        println!(
            "{} {chunks}: {:.1} ns/visit, hit ratio {:.4}",
            args[2],
            ratio(ns, visits),
            ratio(hits as u128, visits)
        );
    }
}
