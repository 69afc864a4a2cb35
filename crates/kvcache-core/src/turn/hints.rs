//! What the turn policy learns about retention hints: for each kind of hint, how often chunks
//! that requests finished under that hint come back, and from that, how much later (or
//! earlier) than an unhinted chunk such a chunk is ranked.
//!
//! The estimate must not depend on what the policy does with it: a chunk ranked later is read
//! more often just because it is still there, and a policy that trusted a random hint a little
//! would then find it right and trust it more. So it is measured on a *shadow sample*: every
//! [`SAMPLE_EVERY`]th chunk stored, remembered (by its key's hash) when a request finishes
//! with it, with the request's hint and the tick, and counted as *come back* when any later
//! request reads or stores that key within [`HORIZON_CAPACITIES`] capacities of ticks,
//! resident or not. The sample is chosen by counting, not by hash, so a replay decides alike in
//! every process (key hashes are seeded per process). A kind whose sampled keys come back `v`
//! times as often as the average ranks `SCALE × log2(v)` capacities of key visits later
//! (earlier when `v < 1`), within `±MAX_SHIFT`, and only once `v` differs from 1 by more
//! than its own statistical error (three standard errors): a hint that says nothing earns
//! nothing, a consistently inverted hint earns the opposite sign, and a hint with few samples
//! earns nothing yet.

use std::collections::VecDeque;

use crate::retention::RetentionHint;

/// The groups of scored lists: chunks last ranked for an unhinted request, or under each hint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Group {
    Unhinted = 0,
    Continues = 1,
    Ends = 2,
}

impl Group {
    pub(super) const ALL: [Group; 3] = [Group::Unhinted, Group::Continues, Group::Ends];

    pub(super) fn of_hint(hint: Option<RetentionHint>) -> Group {
        match hint {
            None => Group::Unhinted,
            Some(RetentionHint::Continues) => Group::Continues,
            Some(RetentionHint::Ends) => Group::Ends,
        }
    }
}

/// One stored chunk in this many is sampled.
pub(super) const SAMPLE_EVERY: u32 = 16;
/// A sampled key counts as come back when it is used again within this many capacities of
/// ticks after it was marked (about the time a chunk stays; on the tuning workloads 4 gained
/// a little over 2 with wrong hints, 1 lost a third of the gain).
const HORIZON_CAPACITIES: u64 = 4;
/// Both counts of a group halve when this many of its keys were sampled.
const WINDOW: u32 = 8192;
/// Standard errors a difference must exceed before it counts.
const Z: f64 = 3.0;
/// Capacities of shift per doubling of the come-back rate: 1 kept a third of the gain of 3
/// with exact hints, 2 two thirds; beyond 3 random hints began to cost.
const SCALE: f64 = 3.0;
/// The most a group's chunks are ranked apart from unhinted ones, in thousandths of the
/// capacity: 2 capacities, past which a chunk ranked earlier is evicted before nearly
/// anything else (4 gained nothing more).
pub(super) const MAX_SHIFT_MILLI: i64 = 2000;

#[derive(Clone, Debug)]
pub(super) struct HintStats {
    /// Sampled marks and returns by [`Group`].
    marked: [u32; 3],
    returned: [u32; 3],
    /// Sampled keys awaiting their return: hash → (group, tick of the mark).
    pending: hashbrown::HashMap<u64, (Group, u64), foldhash::fast::FixedState>,
    /// The same keys in mark order, to expire them (a key marked again appears twice; only
    /// the record whose tick matches the map's is current).
    order: VecDeque<(u64, u64)>,
    /// Ticks a mark waits for its return.
    horizon: u64,
}

impl HintStats {
    pub(super) fn new(capacity: usize) -> Self {
        let capacity = u64::try_from(capacity).unwrap_or(u64::MAX);
        HintStats {
            marked: [0; 3],
            returned: [0; 3],
            pending: hashbrown::HashMap::default(),
            order: VecDeque::new(),
            horizon: capacity.saturating_mul(HORIZON_CAPACITIES),
        }
    }

    /// Forgets marks whose horizon passed.
    fn expire(&mut self, now: u64) {
        while let Some(&(hash, tick)) = self.order.front() {
            if tick.saturating_add(self.horizon) >= now {
                break;
            }
            self.order.pop_front();
            if self.pending.get(&hash).is_some_and(|&(_, t)| t == tick) {
                self.pending.remove(&hash);
            }
        }
    }

    /// A request of `group` finished with the sampled key `hash` at `now`.
    pub(super) fn mark(&mut self, hash: u64, group: Group, now: u64) {
        self.expire(now);
        let g = group as usize;
        self.marked[g] += 1;
        if self.marked[g] >= WINDOW {
            self.marked[g] /= 2;
            self.returned[g] /= 2;
        }
        self.pending.insert(hash, (group, now));
        self.order.push_back((hash, now));
    }

    /// A later request read or stored the key `hash` at `now` (it counts if it is a sampled
    /// key awaiting its return).
    #[inline]
    pub(super) fn came_back(&mut self, hash: u64, now: u64) {
        if self.pending.is_empty() {
            return;
        }
        self.expire(now);
        if let Some((group, _)) = self.pending.remove(&hash) {
            let g = group as usize;
            self.returned[g] = self.returned[g].saturating_add(1).min(self.marked[g]);
        }
    }

    /// How much later than an unhinted chunk of its class each group's chunks rank, in
    /// thousandths of the capacity (unhinted chunks: 0).
    pub(super) fn shifts_milli(&self) -> [i64; 3] {
        let total_marked: u32 = self.marked.iter().sum();
        let total_returned: u32 = self.returned.iter().sum();
        #[allow(clippy::cast_precision_loss, reason = "a small constant")]
        let max = MAX_SHIFT_MILLI as f64;
        Group::ALL.map(|group| {
            let g = group as usize;
            if group == Group::Unhinted || self.marked[g] == 0 || total_returned == 0 {
                return 0;
            }
            // ln(v), v = (returned_g / marked_g) / (all returned / all marked), taken no
            // further from 0 than its confidence bound: a rate estimated from r returns has a
            // relative error of about sqrt((1 - p) / r).
            let returns = f64::from(self.returned[g]).max(0.5);
            let rate = returns / f64::from(self.marked[g]);
            let all = f64::from(total_returned);
            let average = all / f64::from(total_marked);
            let ln_v = (rate / average).ln();
            let se = ((1.0 - rate).max(0.0) / returns + (1.0 - average).max(0.0) / all).sqrt();
            let margin = Z * se;
            let bounded = if ln_v > margin {
                ln_v - margin
            } else if ln_v < -margin {
                ln_v + margin
            } else {
                0.0
            };
            let log2 = bounded / std::f64::consts::LN_2;
            #[allow(clippy::cast_possible_truncation, reason = "clamped to ±MAX_SHIFT_MILLI")]
            let shift = (log2 * SCALE * 1000.0).clamp(-max, max) as i64;
            shift
        })
    }

    /// Forgets every sample (the tuning stays).
    pub(super) fn clear(&mut self) {
        self.marked = [0; 3];
        self.returned = [0; 3];
        self.pending = hashbrown::HashMap::default();
        self.order = VecDeque::new();
    }

    pub(super) fn marked(&self, group: Group) -> u32 {
        self.marked[group as usize]
    }

    pub(super) fn returned(&self, group: Group) -> u32 {
        self.returned[group as usize]
    }

    /// Sets the counts as if `(marked, returned)` of each group had been sampled (tests).
    #[cfg(test)]
    pub(super) fn force_rates(&mut self, counts: [(u32, u32); 3]) {
        for (g, (marked, returned)) in counts.into_iter().enumerate() {
            self.marked[g] = marked;
            self.returned[g] = returned;
        }
    }

    /// Sampled keys awaiting their return.
    #[cfg(test)]
    pub(super) fn pending_len(&self) -> usize {
        self.pending.len()
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.pending.allocation_size() + self.order.capacity() * std::mem::size_of::<(u64, u64)>()
    }

    #[cfg(any(test, feature = "validate"))]
    pub(super) fn check(&self) -> Result<(), String> {
        for g in 0..3 {
            if self.marked[g] >= WINDOW || self.returned[g] > self.marked[g] {
                return Err(format!(
                    "hint group {g}: {} returned of {} marked",
                    self.returned[g], self.marked[g]
                ));
            }
        }
        if self.pending.len() > self.order.len() {
            return Err("a pending sample is missing from the expiry order".into());
        }
        Ok(())
    }
}
