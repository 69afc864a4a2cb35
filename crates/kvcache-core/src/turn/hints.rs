//! What the turn policy learns about retention hints: for each kind of hint, how often the
//! chunks a request finished under that hint were read again, and from that, how far to trust
//! the hint.
//!
//! Every chunk ranked when a request finishes is *marked* with the request's hint (or as
//! unhinted), and the mark is *read* when a later request reuses the chunk, or stores it again
//! while its ghost remembers the mark. Each kind's read rate, against the rate of all marks,
//! decides its treatment: a kind read far less often than the rest is dropped first, a kind
//! read far more often is kept, and anything in between (random hints, or too few marks yet)
//! changes nothing. Nothing is assumed about what a hint means: a consistently inverted hint
//! earns the other treatment, and a hint that says nothing earns none.

use crate::retention::RetentionHint;

/// A chunk's mark: the hint it was last ranked under, unless read since.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Mark {
    None = 0,
    Unhinted = 1,
    Continues = 2,
    Ends = 3,
}

impl Mark {
    pub(super) const BITS: u32 = 2;

    pub(super) fn of_hint(hint: Option<RetentionHint>) -> Mark {
        match hint {
            None => Mark::Unhinted,
            Some(RetentionHint::Continues) => Mark::Continues,
            Some(RetentionHint::Ends) => Mark::Ends,
        }
    }

    pub(super) fn from_bits(bits: u8) -> Mark {
        match bits & 3 {
            0 => Mark::None,
            1 => Mark::Unhinted,
            2 => Mark::Continues,
            _ => Mark::Ends,
        }
    }
}

/// How the policy treats the chunks of a kind of hint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Treatment {
    /// As if there were no hint.
    Neutral,
    /// Evicted before anything but dead tails.
    Drop,
    /// Ranked later than unhinted chunks of the same class.
    Keep,
}

/// Marks a kind needs before its treatment departs from neutral.
const SAMPLES_MIN: u32 = 256;
/// Both counts of a kind halve when this many of its chunks were marked.
const WINDOW: u32 = 16_384;

#[derive(Clone, Debug)]
pub(super) struct HintStats {
    /// Marks and reads by [`Mark`] (index 0, no mark, is unused).
    marked: [u32; 4],
    read: [u32; 4],
    /// A kind is dropped while its read rate is below the rate of all marks times
    /// `drop_below / 1000`, and kept while above it times `keep_above / 1000`.
    pub(super) drop_below: u32,
    pub(super) keep_above: u32,
}

impl Default for HintStats {
    fn default() -> Self {
        HintStats {
            marked: [0; 4],
            read: [0; 4],
            drop_below: 500,
            keep_above: 1250,
        }
    }
}

impl HintStats {
    pub(super) fn note_marked(&mut self, mark: Mark) {
        let i = mark as usize;
        self.marked[i] += 1;
        if self.marked[i] >= WINDOW {
            self.marked[i] /= 2;
            self.read[i] /= 2;
        }
    }

    pub(super) fn note_read(&mut self, mark: Mark) {
        let i = mark as usize;
        if i != 0 {
            self.read[i] = self.read[i].saturating_add(1).min(self.marked[i]);
        }
    }

    /// The treatment of chunks marked `mark` (unhinted ones are always neutral).
    pub(super) fn treatment(&self, mark: Mark) -> Treatment {
        let i = mark as usize;
        if mark == Mark::None || mark == Mark::Unhinted || self.marked[i] < SAMPLES_MIN {
            return Treatment::Neutral;
        }
        let total_marked: u64 = self.marked[1..].iter().map(|&m| u64::from(m)).sum();
        let total_read: u64 = self.read[1..].iter().map(|&r| u64::from(r)).sum();
        // read_i / marked_i against total_read / total_marked, in thousandths.
        let lhs = u64::from(self.read[i]) * total_marked * 1000;
        let rhs = total_read * u64::from(self.marked[i]);
        if lhs < rhs * u64::from(self.drop_below) {
            Treatment::Drop
        } else if lhs > rhs * u64::from(self.keep_above) {
            Treatment::Keep
        } else {
            Treatment::Neutral
        }
    }

    pub(super) fn marked(&self, mark: Mark) -> u32 {
        self.marked[mark as usize]
    }

    pub(super) fn read(&self, mark: Mark) -> u32 {
        self.read[mark as usize]
    }

    #[cfg(any(test, feature = "validate"))]
    pub(super) fn check(&self) -> Result<(), String> {
        for i in 0..4 {
            if self.marked[i] >= WINDOW || self.read[i] > self.marked[i] {
                return Err(format!(
                    "hint kind {i}: {} read of {} marked",
                    self.read[i], self.marked[i]
                ));
            }
        }
        Ok(())
    }
}
