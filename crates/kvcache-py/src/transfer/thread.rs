//! [`JobThread`]: the life of a worker thread fed through a channel (the CPU copier's and the
//! CUDA queue's): its start, the lock that orders submissions, shutdown, and the join on drop.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;

use pyo3::prelude::*;

use crate::errors::typed;

/// A named thread that runs the jobs sent to it until its channel closes. The thread never
/// needs the GIL, so it may be joined while the GIL is held.
pub struct JobThread<J> {
    /// The channel to the thread; `None` once shut down.
    tx: Mutex<Option<Sender<J>>>,
    handle: Mutex<Option<JoinHandle<()>>>,
}

impl<J: Send + 'static> JobThread<J> {
    /// Starts the thread `name`, running `run` over the jobs sent to it; `what` names the
    /// thread in the error raised when it cannot start.
    pub fn spawn(
        name: &str,
        what: &str,
        run: impl FnOnce(Receiver<J>) + Send + 'static,
    ) -> PyResult<Self> {
        let (tx, rx) = channel();
        let handle = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || run(rx))
            .map_err(|e| typed(|e| &e.transfer, format!("cannot start {what} thread: {e}")))?;
        Ok(JobThread {
            tx: Mutex::new(Some(tx)),
            handle: Mutex::new(Some(handle)),
        })
    }
}

impl<J> JobThread<J> {
    /// The channel to the thread (`None` once shut down), locked: jobs sent while one caller
    /// holds it reach the thread in the order that caller decided, and shutdown waits for it.
    pub fn sender(&self) -> MutexGuard<'_, Option<Sender<J>>> {
        self.tx.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Closes the channel, which lets the thread run the jobs already sent and exit, and joins
    /// it with the GIL released. Idempotent.
    pub fn shutdown(&self, py: Python<'_>) {
        drop(self.sender().take());
        let handle = self.handle.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            py.detach(move || {
                let _ = h.join();
            });
        }
    }

    /// [`shutdown`](Self::shutdown) for `Drop`, where the GIL may be held: the thread never
    /// needs it, so joining under it cannot deadlock. Idempotent.
    pub fn stop(&mut self) {
        drop(self.tx.get_mut().unwrap_or_else(|e| e.into_inner()).take());
        if let Some(h) = self
            .handle
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = h.join();
        }
    }
}

impl<J> Drop for JobThread<J> {
    fn drop(&mut self) {
        self.stop();
    }
}
