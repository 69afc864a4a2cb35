//! One lock per policy or manager, so calls from several threads are safe and a call back
//! into the same object from inside one of its own calls is refused.
//!
//! A call may run Python code (a context's `get_offload_key_position`, `get_state`, a key
//! generator, a set's `__contains__`), and the interpreter may switch threads there. The lock
//! is taken when a call starts and held until it returns, so calls are serialised from entry to
//! exit, Python callbacks included:
//! - another thread that finds the object busy waits with the GIL released (the holder needs
//!   the GIL to finish), then runs: never an error;
//! - the holding thread itself calling in again (from a callback) gets `ReentrantCallError`
//!   before anything is read or changed.
//!
//! The uncontended path is one compare-and-swap to take the lock and one store to release it.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex};

use pyo3::prelude::*;

use crate::exceptions::{exceptions, new_err};

/// A small per-thread id (0 means "nobody").
fn thread_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static ID: u64 = NEXT.fetch_add(1, SeqCst));
    ID.with(|id| *id)
}

pub struct Guarded<T> {
    /// The thread holding the lock, or 0.
    holder: AtomicU64,
    waiters: AtomicUsize,
    wait_lock: Mutex<()>,
    released: Condvar,
    /// What the lock protects: only reached through a [`Guard`].
    value: UnsafeCell<T>,
    /// The object's name, for the reentrancy error.
    what: &'static str,
}

// SAFETY: `value` is only reached through a `Guard`, and `holder` admits one guard at a time
// (taken by a successful compare-and-swap from 0, given back on drop), so sharing a `Guarded`
// between threads shares a `T` the way a mutex does.
unsafe impl<T: Send> Sync for Guarded<T> {}

impl<T: Send> Guarded<T> {
    pub fn new(value: T, what: &'static str) -> Self {
        Guarded {
            holder: AtomicU64::new(0),
            waiters: AtomicUsize::new(0),
            wait_lock: Mutex::new(()),
            released: Condvar::new(),
            value: UnsafeCell::new(value),
            what,
        }
    }

    /// Takes the lock: at once if free, after waiting (GIL released) if another thread holds
    /// it, and `ReentrantCallError` if this thread holds it already.
    pub fn lock(&self, py: Python<'_>) -> PyResult<Guard<'_, T>> {
        let me = thread_id();
        match self.holder.compare_exchange(0, me, SeqCst, SeqCst) {
            Ok(_) => return Ok(Guard { lock: self }),
            Err(holder) if holder == me => {
                return Err(new_err(
                    py,
                    &exceptions(py).reentrant_call,
                    format!(
                        "a callback called back into the {} it was called from (a request \
                         context method, a key iterator or a set's __contains__ running inside \
                         one of its calls); nothing was changed",
                        self.what
                    ),
                ));
            }
            Err(_) => {}
        }
        self.waiters.fetch_add(1, SeqCst);
        py.detach(|| {
            let mut waiting = self.wait_lock.lock().unwrap_or_else(|p| p.into_inner());
            while self.holder.compare_exchange(0, me, SeqCst, SeqCst).is_err() {
                waiting = self
                    .released
                    .wait(waiting)
                    .unwrap_or_else(|p| p.into_inner());
            }
        });
        self.waiters.fetch_sub(1, SeqCst);
        Ok(Guard { lock: self })
    }

    /// The value, if no call holds the lock (for the garbage collector, which must never
    /// wait; it runs with the GIL held, so no thread can take the lock meanwhile).
    pub fn try_peek(&self) -> Option<Guard<'_, T>> {
        self.holder
            .compare_exchange(0, u64::MAX, SeqCst, SeqCst)
            .ok()
            .map(|_| Guard { lock: self })
    }
}

pub struct Guard<'a, T> {
    lock: &'a Guarded<T>,
}

impl<T> Deref for Guard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        // SAFETY: this guard is the only one (see `Guarded`'s `Sync` impl).
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard is the only one, and `&mut self` makes this borrow unique.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        self.lock.holder.store(0, SeqCst);
        if self.lock.waiters.load(SeqCst) > 0 {
            // Taking the wait lock orders this wake-up after a waiter's failed attempt.
            let _waiting = self
                .lock
                .wait_lock
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            self.lock.released.notify_all();
        }
    }
}
