//! ARC's invariant checker (tests, fuzzing and the Python test build only).

use super::{usize_as_f64, ArcPolicy, ListId};

impl<C> ArcPolicy<C> {
    /// Checks every structural invariant; `Err` names the first one broken.
    pub(super) fn check_invariants(&self) -> Result<(), String> {
        let mut total = 0;
        for list in ListId::ALL {
            let members = self.lists[list as usize].validate(&self.entries.slab)?;
            for &idx in &members {
                let e = self.entries.get(idx);
                if e.list != list {
                    return Err(format!(
                        "{:?} is on {list:?} but tagged {:?}",
                        e.key, e.list
                    ));
                }
                if e.chunk.is_some() != list.is_resident() {
                    return Err(format!("{:?} on {list:?}: chunk presence is wrong", e.key));
                }
                self.entries.check_indexed(idx)?;
            }
            total += members.len();
        }
        self.entries.check_counts(total, 0)?;
        for ghost in [ListId::B1, ListId::B2] {
            if self.list_len(ghost) > self.capacity {
                return Err(format!(
                    "{ghost:?} holds {} > capacity {}",
                    self.list_len(ghost),
                    self.capacity
                ));
            }
        }
        if !(0.0..=usize_as_f64(self.capacity)).contains(&self.target_t1_size) {
            return Err(format!(
                "target_t1_size {} outside [0, {}]",
                self.target_t1_size, self.capacity
            ));
        }
        Ok(())
    }
}
