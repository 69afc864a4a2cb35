//! What the manager reports: events (stored and removed keys), usage figures and heap bytes.

use super::{ChunkId, Event, Manager, MemoryUsage, Stats};
use crate::key::Key;
use crate::policy::{Policy, PolicyExt};

impl<P: Policy<ChunkId>> Manager<P> {
    /// Takes the events collected so far. A failed store's cleanup only names keys no retry
    /// has stored again since.
    pub fn take_events(&mut self) -> Vec<Event> {
        let Some(events) = &mut self.events else {
            return Vec::new();
        };
        let events = std::mem::take(events);
        events
            .into_iter()
            .filter_map(|mut e| {
                if e.metadata_only {
                    e.keys.retain(|k| {
                        self.policy
                            .get(Key::new(&self.hasher, k.as_slice()))
                            .is_none()
                    });
                    if e.keys.is_empty() {
                        return None;
                    }
                }
                Some(e)
            })
            .collect()
    }

    /// Puts back events a caller took but could not deliver, in front of those collected
    /// since: the next [`take_events`](Self::take_events) returns them first (and filters a
    /// failed store's cleanup again).
    pub fn requeue_events(&mut self, mut events: Vec<Event>) {
        if let Some(queue) = &mut self.events {
            events.append(queue);
            *queue = events;
        }
    }

    /// vLLM's `get_stats`: usage gauges, and the allocation sizes and skipped stores since the
    /// last call (which this call resets).
    pub fn take_stats(&mut self) -> Stats {
        let n = self.table.num_chunks();
        let used = self.table.num_resident() - self.num_evictable;
        let usage = ratio(used, n);
        let write_usage = ratio(self.num_write_pending, n);
        let stores_skipped = self
            .tracker
            .is_some()
            .then(|| std::mem::take(&mut self.stores_skipped));
        let kept_hits = self.policy.hint_kept_hits();
        let hints = std::mem::take(&mut self.hints);
        self.hints.kept_hits_taken = kept_hits;
        Stats {
            usage,
            write_usage,
            read_usage: f64::max(usage - write_usage, 0.0),
            allocation_sizes: std::mem::take(&mut self.allocation_sizes),
            stores_skipped,
            hinted_requests: hints.hinted_requests,
            ignored_hints: hints.ignored_hints,
            hint_kept_hits: kept_hits.saturating_sub(hints.kept_hits_taken),
        }
    }

    pub fn memory_usage(&self) -> MemoryUsage {
        MemoryUsage {
            policy: self.policy.heap_bytes(),
            table: self.table.heap_bytes(),
            tracker: self.tracker.as_ref().map_or(0, |t| t.heap_bytes()),
            requests: self.requests.heap_bytes(),
        }
    }
}

/// `part / whole` as vLLM computes its usage gauges (0 for an empty cache).
#[allow(
    clippy::cast_precision_loss,
    reason = "chunk counts are far below 2^53"
)]
fn ratio(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}
