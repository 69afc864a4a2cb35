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
//! The lock's own state is only touched while the GIL is held (this extension is built for the
//! stable ABI of GIL builds only), so taking and releasing it are plain loads and stores: the
//! scheduler's one-key calls (`lookup`, `get`) pay no atomic instruction for it.

use std::cell::{Cell, UnsafeCell};
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use pyo3::prelude::*;

use crate::exceptions::{exceptions, new_err};

/// A per-thread id, never 0 (0 means "nobody"): the address of a thread-local.
fn thread_id() -> usize {
    thread_local!(static ANCHOR: u8 = const { 0 });
    ANCHOR.with(|a| std::ptr::from_ref(a) as usize)
}

/// The holder value `__traverse__` uses while it reads the protected value.
const COLLECTOR: usize = usize::MAX;

/// How long a waiter sleeps before looking again if a wake-up was missed (the releaser reads
/// the waiter count without a fence, so it may miss a waiter that just arrived).
const RECHECK: Duration = Duration::from_millis(1);

pub struct Guarded<T> {
    /// The thread holding the lock, or 0. Read and written only with the GIL held.
    holder: Cell<usize>,
    /// Threads waiting for the lock. Read and written only with the GIL held.
    waiters: Cell<usize>,
    wait_lock: Mutex<()>,
    released: Condvar,
    /// What the lock protects: only reached through a [`Guard`].
    value: UnsafeCell<T>,
    /// The object's name, for the reentrancy error.
    what: &'static str,
}

// SAFETY: `holder` and `waiters` are only read and written by threads attached to the
// interpreter (every method takes a `Python` token, `try_peek` runs in the garbage collector,
// and a `Guard` cannot leave its thread's attachment: it carries the token's lifetime and is
// not `Send`). On the GIL builds this abi3 extension supports, attached threads run one at a
// time, so those accesses never race. `value` is reached only through the one `Guard` that
// `holder` admits at a time, so sharing a `Guarded` shares a `T` the way a mutex does.
unsafe impl<T: Send> Sync for Guarded<T> {}

impl<T: Send> Guarded<T> {
    pub fn new(value: T, what: &'static str) -> Self {
        Guarded {
            holder: Cell::new(0),
            waiters: Cell::new(0),
            wait_lock: Mutex::new(()),
            released: Condvar::new(),
            value: UnsafeCell::new(value),
            what,
        }
    }

    /// Takes the lock: at once if free, after waiting (GIL released) if another thread holds
    /// it, and `ReentrantCallError` if this thread holds it already.
    #[inline(always)]
    pub fn lock<'py>(&'py self, py: Python<'py>) -> PyResult<Guard<'py, T>> {
        let me = thread_id();
        if self.holder.get() == 0 {
            self.holder.set(me);
            return Ok(Guard {
                lock: self,
                _attached: PhantomData,
            });
        }
        self.lock_busy(py, me)
    }

    /// [`lock`](Self::lock) when the object is busy: a reentrant call, or another thread's.
    #[cold]
    #[inline(never)]
    fn lock_busy<'py>(&'py self, py: Python<'py>, me: usize) -> PyResult<Guard<'py, T>> {
        loop {
            match self.holder.get() {
                0 => {
                    self.holder.set(me);
                    return Ok(Guard {
                        lock: self,
                        _attached: PhantomData,
                    });
                }
                holder if holder == me => {
                    return Err(new_err(
                        py,
                        &exceptions(py).reentrant_call,
                        format!(
                            "a callback called back into the {} it was called from (a request \
                             context method, a key iterator or a set's __contains__ running \
                             inside one of its calls); nothing was changed",
                            self.what
                        ),
                    ));
                }
                _ => {
                    self.waiters.set(self.waiters.get() + 1);
                    py.detach(|| {
                        let waiting = self.wait_lock.lock().unwrap_or_else(|p| p.into_inner());
                        let _ = self.released.wait_timeout(waiting, RECHECK);
                    });
                    self.waiters.set(self.waiters.get() - 1);
                }
            }
        }
    }

    /// The value, if no call holds the lock (for the garbage collector, which must never
    /// wait; it runs with the GIL held, so no thread can take the lock meanwhile).
    pub fn try_peek(&self) -> Option<Guard<'_, T>> {
        (self.holder.get() == 0).then(|| {
            self.holder.set(COLLECTOR);
            Guard {
                lock: self,
                _attached: PhantomData,
            }
        })
    }
}

pub struct Guard<'a, T> {
    lock: &'a Guarded<T>,
    /// Not `Send`: a guard is released by the attached thread that took it.
    _attached: PhantomData<*const ()>,
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
    #[inline(always)]
    fn drop(&mut self) {
        self.lock.holder.set(0);
        if self.lock.waiters.get() > 0 {
            self.lock.wake();
        }
    }
}

impl<T> Guarded<T> {
    #[cold]
    #[inline(never)]
    fn wake(&self) {
        // Taking the wait lock orders the wake-up after a waiter that is about to sleep.
        let _waiting = self.wait_lock.lock().unwrap_or_else(|p| p.into_inner());
        self.released.notify_all();
    }
}
