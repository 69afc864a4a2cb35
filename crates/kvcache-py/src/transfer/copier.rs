//! `_core.CpuCopier`: builds and runs CPU plans on a worker thread, reported through
//! `poll()`/`wait()`.
//!
//! The worker never drops the last reference to a plan: a plan may hold Python buffers, whose
//! release needs the interpreter, and a worker attaching to it while the owner joins the
//! worker under the GIL would deadlock. Finished plans go back to the caller through the done
//! list and are dropped by `poll()` (or by `Drop` after the join), always on a Python thread.

use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use kvcache_core::host::copy_runs;
use pyo3::prelude::*;

use super::plan::{Plan, PlanData};
use super::thread::JobThread;
use crate::errors::typed;

/// One finished job: id, success, seconds spent copying, and the cause of a failure.
type Done = (u64, bool, f64, Option<String>);

struct Job {
    id: u64,
    plan: Arc<PlanData>,
}

#[derive(Default)]
struct State {
    in_flight: HashSet<u64>,
    done: Vec<(Done, Arc<PlanData>)>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn run_jobs(rx: Receiver<Job>, shared: Arc<Shared>, execute: bool) {
    // Ends when the sender is dropped and every queued job has been run.
    while let Ok(Job { id, plan }) = rx.recv() {
        let started = Instant::now();
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
            // The runs are built here, off the submitting thread.
            let runs = plan.runs();
            if !execute {
                return Ok(());
            }
            // SAFETY: the plan was validated against the pool mapping and the layers'
            // exported buffers, all kept alive by `plan` (which this thread holds). The
            // engine's contract is that nobody touches a job's destination until it is
            // reported finished.
            unsafe { copy_runs(runs) }
        }));
        let seconds = started.elapsed().as_secs_f64();
        let error = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some("the copy panicked".to_string()),
        };
        drop(plan.take_lease());
        let mut st = shared.lock();
        st.in_flight.remove(&id);
        st.done.push(((id, error.is_none(), seconds, error), plan));
        drop(st);
        shared.cv.notify_all();
    }
}

#[pyclass(module = "kvcache._core", name = "CpuCopier", frozen)]
pub struct CpuCopier {
    shared: Arc<Shared>,
    thread: JobThread<Job>,
}

#[pymethods]
impl CpuCopier {
    /// Pickling and copying are refused with `kvcache.InvalidTypeError` (a `TypeError`).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }

    /// `execute=False` builds each job's runs but copies nothing (for measuring the planning
    /// cost alone); jobs are then reported as succeeded.
    #[new]
    #[pyo3(signature = (*, execute=true))]
    fn new(execute: bool) -> PyResult<Self> {
        let shared = Arc::new(Shared::default());
        let worker_shared = Arc::clone(&shared);
        let thread = JobThread::spawn("kvcache-copy", "copy", move |rx| {
            run_jobs(rx, worker_shared, execute);
        })?;
        Ok(CpuCopier { shared, thread })
    }

    /// Queues `plan` (a host-layer plan, not yet executed) as job `job_id` (unique among
    /// unfinished jobs). Jobs run one after another in submission order.
    fn submit(
        &self,
        #[pyo3(from_py_with = super::ids::job_id_arg)] job_id: u64,
        #[pyo3(from_py_with = super::ids::plan_arg)] plan: Bound<'_, Plan>,
    ) -> PyResult<()> {
        let data = plan.get().data();
        if !data.is_host() {
            return Err(typed(
                |e| &e.invalid_argument,
                "the CPU copier only runs plans over host-memory layers",
            ));
        }
        data.check_not_executed()?;
        let tx = self.thread.sender();
        let tx = tx
            .as_ref()
            .ok_or_else(|| typed(|e| &e.transfer, "the copier is shut down"))?;
        if !self.shared.lock().in_flight.insert(job_id) {
            return Err(typed(
                |e| &e.invalid_argument,
                format!("job {job_id} is already in flight"),
            ));
        }
        // Sent without the state lock: the woken thread may finish the job and take the lock
        // before `send` returns here, and must not have to sleep on it (a second wake-up).
        if tx
            .send(Job {
                id: job_id,
                plan: data,
            })
            .is_err()
        {
            self.shared.lock().in_flight.remove(&job_id);
            return Err(typed(|e| &e.transfer, "the copy thread has stopped"));
        }
        Ok(())
    }

    /// Finished jobs since the last call, as `(job_id, success, seconds, error or None)`,
    /// in completion order.
    fn poll(&self) -> Vec<Done> {
        let done = std::mem::take(&mut self.shared.lock().done);
        // The plans are dropped here, with the GIL held.
        done.into_iter().map(|(d, _plan)| d).collect()
    }

    /// Blocks (GIL released) until none of `job_ids` (all jobs if None) is still running.
    /// Results stay queued for `poll()`.
    #[pyo3(signature = (job_ids=None))]
    fn wait(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = super::ids::job_ids)] job_ids: Option<Vec<u64>>,
    ) {
        let shared = Arc::clone(&self.shared);
        py.detach(move || {
            let mut st = shared.lock();
            loop {
                let busy = match &job_ids {
                    None => !st.in_flight.is_empty(),
                    Some(ids) => ids.iter().any(|id| st.in_flight.contains(id)),
                };
                if !busy {
                    break;
                }
                st = shared.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        });
    }

    /// Number of jobs queued or running.
    fn in_flight(&self) -> usize {
        self.shared.lock().in_flight.len()
    }

    /// Finishes the queued jobs and stops the worker thread (GIL released); later `submit`
    /// calls raise. Results stay available to `poll()`. Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        self.thread.shutdown(py);
    }
}

impl Drop for CpuCopier {
    fn drop(&mut self) {
        // The worker finishes the queued jobs and exits before `shared` drops: the last
        // reference to the finished plans goes here, never on the worker.
        self.thread.stop();
    }
}
