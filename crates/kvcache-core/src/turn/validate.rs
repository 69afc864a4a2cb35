//! The turn policy's invariant checker (tests, fuzzing and the Python test build only).

use super::{
    Class, TurnPolicy, EVICTABLE, FRESH_ORIGIN, GROUP_LISTS, LISTS, SAMPLED, MAX_CREDITED_REUSES,
    TAIL,
};

impl<C> TurnPolicy<C> {
    /// Checks every structural invariant; `Err` names the first one broken.
    pub(super) fn check_invariants(&self) -> Result<(), String> {
        let mut total = 0;
        for list in 0..LISTS {
            let members = self.lists[list].validate(&self.entries.slab)?;
            let mut previous_tick = 0;
            for &idx in &members {
                let e = self.entries.get(idx);
                if usize::from(e.list) != list {
                    return Err(format!(
                        "{:?} is on list {list} but tagged {}",
                        e.key, e.list
                    ));
                }
                if e.tick < previous_tick {
                    return Err(format!("list {list} is out of tick order at {:?}", e.key));
                }
                previous_tick = e.tick;
                if e.tick > self.tick {
                    return Err(format!("{:?} has a tick from the future", e.key));
                }
                if e.flags & !(EVICTABLE | FRESH_ORIGIN | TAIL | SAMPLED) != 0 {
                    return Err(format!("{:?} has unknown flags {:#x}", e.key, e.flags));
                }
                let fresh = e.flags & FRESH_ORIGIN != 0;
                if fresh && e.reuses != 0 {
                    return Err(format!("{:?} is fresh but was reused", e.key));
                }
                let tail = e.flags & TAIL != 0;
                if tail && e.reuses != 0 {
                    return Err(format!("{:?} is a marked tail but was reused", e.key));
                }
                // A hint group's list holds what its unhinted twin would.
                let twin = if list >= Class::Tail as usize {
                    Class::Tail as usize + (list - Class::Tail as usize) % GROUP_LISTS
                } else {
                    list
                };
                let class_ok = match twin {
                    l if l == Class::Dead as usize => tail,
                    l if l == Class::Fresh as usize => fresh,
                    l if l == Class::Tail as usize => e.reuses == 0,
                    l => {
                        e.reuses.min(MAX_CREDITED_REUSES)
                            == u8::try_from(l - Class::Reused0 as usize).unwrap_or(0)
                    }
                };
                if !class_ok {
                    return Err(format!(
                        "{:?} (reused {}, fresh {fresh}) is on list {list}",
                        e.key, e.reuses
                    ));
                }
                self.entries.check_indexed(idx)?;
            }
            total += members.len();
        }
        self.entries.check_counts(total, 0)?;
        if self.tails_marked >= super::TAIL_WINDOW {
            return Err(format!("{} tails marked: the window was not halved", self.tails_marked));
        }
        self.hints.check()?;
        self.ghosts.check()
    }
}
