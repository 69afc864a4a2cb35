//! `_core.CudaQueue`: DMA jobs submitted to a CUDA stream from a thread of their own.
//!
//! Why a thread: building one descriptor per page and handing them to the driver costs time in
//! proportion to the pages (tens of microseconds to milliseconds per job, plus the driver's own
//! per-descriptor cost), and vLLM pays it on the model runner's thread inside the step. Here
//! `submit` (on the caller's thread) only records an event on the caller's current stream and
//! queues the validated job; the queue's thread builds the runs, makes its stream wait for that
//! event (so the copy still sees everything queued before the submission, as if it had been
//! issued then), and enqueues the copies between two timing events. Completion is read from
//! the end event by `poll`/`wait` on the caller's thread.
//!
//! Jobs of one queue run in submission order (one stream, one thread). A job whose copies could
//! not all be enqueued is still closed with its end event, and reported failed only when that
//! event has completed: nothing of it may still run when its memory is released.
//!
//! CUDA is reached through a [`CudaApi`] (the loaded runtime, or the tests' fake). Every call
//! runs with the queue's device current: the thread binds it once, `submit` (on the caller's
//! thread, whose device is the caller's business) binds it for its two calls and restores the
//! caller's. A job whose copies could not be batched is re-issued one copy per run; the
//! driver's error and failing index are kept for the engine to log. An error that leaves the
//! CUDA context unusable (an illegal address, a misaligned access: "sticky") marks the queue
//! lost: every later job fails at once, naming the first cause.

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_float, c_int, c_uint};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use pyo3::prelude::*;

use kvcache_core::host::PinStatus;

use super::api::{is_sticky, CudaApi, Event, PyCudaApi, Stream};
use super::cuda::{batch_copy, memcpy_each_run, BatchFailure, RunFailure};
use super::plan::{Plan, PlanData};
use super::thread::JobThread;
use crate::errors::typed;

/// cudaErrorNotReady: an event or stream has work still pending.
const NOT_READY: c_int = 600;
/// cudaEventDisableTiming.
const DISABLE_TIMING: c_uint = 2;

/// One queued job as the thread receives it.
struct QueuedJob {
    id: u64,
    plan: Arc<PlanData>,
    ready: usize,
    src_access_order: i32,
}

/// How a job's copies reached the stream.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Method {
    Batched,
    PerRun,
}

enum JobState {
    /// Waiting for the thread.
    Queued,
    /// On the stream: `error` is set when not every copy could be enqueued.
    Enqueued {
        start: usize,
        end: usize,
        error: Option<String>,
    },
    /// Failed before anything reached the stream.
    Failed(String),
}

/// One failed batched call: the job, the driver's code and name, the copy it failed on (when
/// the driver says), the job's copies, and whether the queue stopped batching because of it.
type BatchReport = (u64, i32, String, Option<usize>, usize, bool);

struct State {
    order: VecDeque<u64>,
    jobs: HashMap<u64, (JobState, Arc<PlanData>)>,
    /// Reusable events: (timing, no-timing).
    timing_events: Vec<usize>,
    ready_events: Vec<usize>,
    batch_failures: Vec<BatchReport>,
    /// The first sticky error seen: the context is lost, nothing more may be submitted.
    lost: Option<String>,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    api: Arc<CudaApi>,
    device: c_int,
    stream: usize,
    /// Whether jobs still go through the driver's batched call.
    batching: AtomicBool,
    jobs_batched: AtomicU64,
    jobs_per_run: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn stream(&self) -> Stream {
        std::ptr::with_exposed_provenance_mut(self.stream)
    }

    /// Names a failed call (clearing the thread's last error); a sticky code also marks the
    /// queue lost.
    fn fail(&self, what: &str, code: c_int) -> String {
        let cause = self.api.describe(what, code);
        if is_sticky(code) {
            let mut st = self.lock();
            if st.lost.is_none() {
                st.lost = Some(format!("the CUDA context is lost: {cause}"));
            }
        }
        cause
    }

    /// The queue's device current on this thread until the guard drops (see
    /// [`CudaApi::on_device`]); a sticky failure marks the queue lost.
    fn bind(&self) -> Result<super::api::DeviceGuard<'_>, String> {
        self.api
            .bind(self.device)
            .map_err(|(what, code)| self.fail(what, code))
    }

    fn lost(&self) -> Option<String> {
        self.lock().lost.clone()
    }

    /// An event from the pool, or a new one (on the calling thread's current device, which
    /// the caller made the queue's).
    fn event(&self, timing: bool) -> Result<usize, String> {
        {
            let mut st = self.lock();
            let pool = if timing {
                &mut st.timing_events
            } else {
                &mut st.ready_events
            };
            if let Some(ev) = pool.pop() {
                return Ok(ev);
            }
        }
        let mut ev: Event = std::ptr::null_mut();
        let flags = if timing { 0 } else { DISABLE_TIMING };
        // SAFETY: cudaEventCreateWithFlags writes one event handle into `ev`.
        let rc = unsafe { (self.api.event_create)(&mut ev, flags) };
        if rc != 0 {
            return Err(self.fail("cudaEventCreateWithFlags", rc));
        }
        Ok(ev.expose_provenance())
    }

    fn give_back(&self, st: &mut State, ev: usize, timing: bool) {
        if timing {
            st.timing_events.push(ev);
        } else {
            st.ready_events.push(ev);
        }
    }
}

fn ev(handle: usize) -> Event {
    std::ptr::with_exposed_provenance_mut(handle)
}

/// Enqueues every run of `plan` on the stream: one batched call, or one call per run where
/// the driver has none or a batched call failed (the same bytes, in the same stream order).
/// The cause of a failure, if any.
fn enqueue_copies(shared: &Shared, job: u64, plan: &PlanData, order: i32) -> Option<String> {
    let _guard = plan.copy_guard();
    let runs = plan.runs();
    let batch = shared
        .api
        .batch
        .filter(|_| shared.batching.load(Ordering::Acquire));
    let mut method = Method::PerRun;
    if let Some(b) = batch {
        // SAFETY: the plan's runs lie inside the pool and the device tensors it was validated
        // against; the plan (held by this job until it is reported) keeps the pool mapped and
        // the engine keeps the device tensors alive; the stream is the queue's.
        match unsafe { batch_copy(b, runs, shared.stream(), order) } {
            Ok(()) => method = Method::Batched,
            Err(BatchFailure { code, index }) => {
                shared.api.clear_error();
                let name = shared.api.driver_error_name(code);
                // Once pinning is over (done, failed or never asked for) the memory will not
                // change: the driver cannot batch these copies, stop trying. While a
                // background registration is still running, ranges not yet pinned may be the
                // cause, so only this job goes run by run.
                let stop = !matches!(plan.region().pin_status(), PinStatus::Pinning { .. });
                if stop {
                    shared.batching.store(false, Ordering::Release);
                }
                let mut st = shared.lock();
                st.batch_failures
                    .push((job, code, name, index, runs.len(), stop));
                if is_sticky(code) && st.lost.is_none() {
                    st.lost = Some(format!(
                        "the CUDA context is lost: cuMemcpyBatchAsync failed with {code}"
                    ));
                }
                drop(st);
                if is_sticky(code) {
                    return Some(format!("cuMemcpyBatchAsync failed: {code}"));
                }
            }
        }
    }
    let counter = match method {
        Method::Batched => &shared.jobs_batched,
        Method::PerRun => &shared.jobs_per_run,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    if method == Method::Batched {
        return None;
    }
    // SAFETY: as above.
    match unsafe { memcpy_each_run(&shared.api, runs, shared.stream()) } {
        Ok(()) => None,
        Err(RunFailure::Unaddressable { index }) => {
            Some(format!("run {index} does not fit in this address space"))
        }
        Err(RunFailure::Cuda { index, code }) => {
            let cause = shared.fail("cudaMemcpyAsync", code);
            Some(format!("{cause} after {index} of {} runs", runs.len()))
        }
    }
}

fn run_queue(rx: Receiver<QueuedJob>, shared: Arc<Shared>) {
    // SAFETY: cudaSetDevice takes a device ordinal; the thread works for that device only.
    let bound = unsafe { (shared.api.set_device)(shared.device) };
    let bind_error = (bound != 0).then(|| shared.fail("cudaSetDevice", bound));
    while let Ok(job) = rx.recv() {
        let outcome = match bind_error.clone().or_else(|| shared.lost()) {
            Some(e) => Err(e),
            None => run_one(&shared, &job),
        };
        let mut st = shared.lock();
        let ready = job.ready;
        shared.give_back(&mut st, ready, false);
        if let Some((state, _)) = st.jobs.get_mut(&job.id) {
            *state = match outcome {
                Ok((start, end, error)) => JobState::Enqueued { start, end, error },
                Err(e) => JobState::Failed(e),
            };
        }
        drop(st);
        shared.cv.notify_all();
    }
}

/// Puts one job on the stream: wait for the submission point, start event, copies, end event.
fn run_one(shared: &Shared, job: &QueuedJob) -> Result<(usize, usize, Option<String>), String> {
    let api = &shared.api;
    let start = shared.event(true)?;
    let end = match shared.event(true) {
        Ok(e) => e,
        Err(e) => {
            let mut st = shared.lock();
            shared.give_back(&mut st, start, true);
            return Err(e);
        }
    };
    // SAFETY: valid events from the pool or from cudaEventCreateWithFlags, and the queue's
    // stream (kept alive by the engine that owns the queue).
    unsafe {
        let rc = (api.stream_wait_event)(shared.stream(), ev(job.ready), 0);
        if rc != 0 {
            let mut st = shared.lock();
            shared.give_back(&mut st, start, true);
            shared.give_back(&mut st, end, true);
            drop(st);
            return Err(shared.fail("cudaStreamWaitEvent", rc));
        }
        let mut error = None;
        let rc = (api.event_record)(ev(start), shared.stream());
        if rc != 0 {
            error = Some(shared.fail("cudaEventRecord", rc));
        }
        if error.is_none() {
            error = enqueue_copies(shared, job.id, &job.plan, job.src_access_order);
        }
        let rc = (api.event_record)(ev(end), shared.stream());
        if rc != 0 {
            // No end marker: make sure nothing of the job still runs before reporting it.
            let cause = shared.fail("cudaEventRecord", rc);
            (api.stream_synchronize)(shared.stream());
            api.clear_error();
            let mut st = shared.lock();
            shared.give_back(&mut st, start, true);
            shared.give_back(&mut st, end, true);
            return Err(error.unwrap_or(cause));
        }
        Ok((start, end, error))
    }
}

/// One finished job: id, success, seconds on the device (None when unknown), cause.
type Done = (u64, bool, Option<f64>, Option<String>);

#[pyclass(module = "kvcache._core", name = "CudaQueue", frozen)]
pub struct CudaQueue {
    shared: Arc<Shared>,
    thread: JobThread<QueuedJob>,
}

#[pymethods]
impl CudaQueue {
    /// Pickling and copying are refused with `kvcache.InvalidTypeError` (a `TypeError`).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }

    /// A queue submitting to `stream` (a `cudaStream_t` of `device`, which the caller keeps
    /// alive for the queue's life) through `api`; its thread binds `device` first. The
    /// driver's batched copy is used when `api` has it.
    #[new]
    fn new(api: &Bound<'_, PyCudaApi>, stream: usize, device: i32) -> PyResult<Self> {
        let api = Arc::clone(&api.get().api);
        let batching = api.batch.is_some();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                order: VecDeque::new(),
                jobs: HashMap::new(),
                timing_events: Vec::new(),
                ready_events: Vec::new(),
                batch_failures: Vec::new(),
                lost: None,
            }),
            cv: Condvar::new(),
            api,
            device,
            stream,
            batching: AtomicBool::new(batching),
            jobs_batched: AtomicU64::new(0),
            jobs_per_run: AtomicU64::new(0),
        });
        let thread_shared = Arc::clone(&shared);
        let thread = JobThread::spawn("kvcache-dma", "DMA", move |rx| {
            run_queue(rx, thread_shared);
        })?;
        Ok(CudaQueue { shared, thread })
    }

    /// Whether jobs go through the driver's batched call (False without one, and after a
    /// batched call failed once pinning was over: every later job goes run by run).
    #[getter]
    fn batched(&self) -> bool {
        self.shared.batching.load(Ordering::Acquire)
    }

    /// Stops using the batched call (every later job goes run by run).
    fn stop_batching(&self) {
        self.shared.batching.store(false, Ordering::Release);
    }

    /// Jobs whose copies reached the stream by one batched call, and one call per run.
    fn jobs_by_method(&self) -> (u64, u64) {
        (
            self.shared.jobs_batched.load(Ordering::Relaxed),
            self.shared.jobs_per_run.load(Ordering::Relaxed),
        )
    }

    /// Failed batched calls since the last call, each once, as `(job_id, code, driver's name
    /// for it, index of the failing copy or None, copies in the job, stopped batching)`.
    fn take_batch_failures(&self) -> Vec<BatchReport> {
        std::mem::take(&mut self.shared.lock().batch_failures)
    }

    /// Why the CUDA context is unusable (a sticky error seen by this queue), or None.
    fn context_lost(&self) -> Option<String> {
        self.shared.lost()
    }

    #[getter]
    fn device(&self) -> i32 {
        self.shared.device
    }

    /// The stream this queue submits to.
    #[getter]
    fn stream(&self) -> usize {
        self.shared.stream
    }

    /// Queues `plan` as job `job_id` (unique among unreported jobs): records an event on
    /// `current_stream` (a stream of the queue's device) now, so the copies see all work
    /// queued there before this call; the thread then builds and enqueues them.
    /// `src_access_order`: 1 (stream order) when the source may still be written by the
    /// device, 3 (any) for host sources. The caller's current device is left as it was.
    fn submit(
        &self,
        #[pyo3(from_py_with = super::ids::job_id_arg)] job_id: u64,
        #[pyo3(from_py_with = super::ids::plan_arg)] plan: Bound<'_, Plan>,
        current_stream: usize,
        src_access_order: i32,
    ) -> PyResult<()> {
        if !(1..=3).contains(&src_access_order) {
            return Err(typed(
                |e| &e.invalid_argument,
                format!("src_access_order must be 1, 2 or 3, got {src_access_order}"),
            ));
        }
        // Host-layer plans are accepted too (cudaMemcpyDefault copies host to host): the tests
        // drive a queue with them.
        let data = plan.get().data();
        data.check_not_executed()?;
        if let Some(lost) = self.shared.lost() {
            return Err(typed(|e| &e.transfer, lost));
        }
        let tx = self.thread.sender();
        let tx = tx
            .as_ref()
            .ok_or_else(|| typed(|e| &e.transfer, "the queue is shut down"))?;
        if self.shared.lock().jobs.contains_key(&job_id) {
            return Err(typed(
                |e| &e.invalid_argument,
                format!("job {job_id} is already in flight"),
            ));
        }
        let shared = &self.shared;
        // The ready event is created on, and recorded to a stream of, the queue's device,
        // whatever device the caller's thread has current.
        let recorded = shared.bind().and_then(|_bound| {
            let ready = shared.event(false)?;
            // SAFETY: a valid event, and the caller's current stream handle.
            let rc = unsafe {
                (shared.api.event_record)(
                    ev(ready),
                    std::ptr::with_exposed_provenance_mut(current_stream),
                )
            };
            if rc == 0 {
                Ok(ready)
            } else {
                let mut st = shared.lock();
                shared.give_back(&mut st, ready, false);
                drop(st);
                Err(shared.fail("cudaEventRecord", rc))
            }
        });
        let mut st = shared.lock();
        st.order.push_back(job_id);
        match recorded {
            Ok(ready) => {
                st.jobs
                    .insert(job_id, (JobState::Queued, Arc::clone(&data)));
                drop(st);
                let job = QueuedJob {
                    id: job_id,
                    plan: data,
                    ready,
                    src_access_order,
                };
                if tx.send(job).is_err() {
                    let mut st = shared.lock();
                    if let Some((state, _)) = st.jobs.get_mut(&job_id) {
                        *state = JobState::Failed("the DMA thread has stopped".into());
                    }
                }
            }
            Err(cause) => {
                st.jobs.insert(job_id, (JobState::Failed(cause), data));
            }
        }
        Ok(())
    }

    /// Finished jobs, in submission order, as `(job_id, success, seconds, error)`; the first
    /// unfinished job ends the list (a stream runs its jobs in order).
    fn poll(&self) -> Vec<Done> {
        let shared = &self.shared;
        let mut done = Vec::new();
        let mut finished_plans = Vec::new();
        if shared.lock().order.is_empty() {
            return done;
        }
        // Queries from the caller's thread run with the queue's device current: a thread of
        // another device (or of none yet) would otherwise make CUDA set up a context there.
        let _bound = shared.bind();
        loop {
            let mut st = shared.lock();
            let Some(&id) = st.order.front() else { break };
            let Some((state, _)) = st.jobs.get(&id) else {
                st.order.pop_front();
                continue;
            };
            let result = match state {
                JobState::Queued => break,
                JobState::Failed(cause) => Some((None, Some(cause.clone()), None)),
                &JobState::Enqueued {
                    start,
                    end,
                    ref error,
                } => {
                    let error = error.clone();
                    drop(st);
                    // SAFETY: a valid event recorded on the queue's stream (querying an event
                    // needs no particular current device).
                    let rc = unsafe { (shared.api.event_query)(ev(end)) };
                    if rc == NOT_READY {
                        break;
                    }
                    let mut seconds = None;
                    let error = if rc == 0 {
                        let mut ms: c_float = 0.0;
                        // SAFETY: both events were recorded on the stream and have completed.
                        if unsafe { (shared.api.event_elapsed)(&mut ms, ev(start), ev(end)) } == 0 {
                            seconds = Some(f64::from(ms) * 1e-3);
                        } else {
                            shared.api.clear_error();
                        }
                        error
                    } else {
                        Some(shared.fail("the device reported an error; the job", rc))
                    };
                    st = shared.lock();
                    Some((Some((start, end)), error, seconds))
                }
            };
            let Some((events, error, seconds)) = result else {
                break;
            };
            st.order.pop_front();
            if let Some((_, plan)) = st.jobs.remove(&id) {
                drop(plan.take_lease());
                finished_plans.push(plan);
            }
            if let Some((start, end)) = events {
                shared.give_back(&mut st, start, true);
                shared.give_back(&mut st, end, true);
            }
            done.push((id, error.is_none(), seconds, error));
        }
        // The plans are dropped here, on the caller's thread with the GIL held.
        drop(finished_plans);
        done
    }

    /// Blocks (GIL released) until the given jobs (all if None) have finished on the device;
    /// results stay queued for `poll()`.
    #[pyo3(signature = (job_ids=None))]
    fn wait(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = super::ids::job_ids)] job_ids: Option<Vec<u64>>,
    ) {
        let shared = Arc::clone(&self.shared);
        py.detach(move || {
            let ends: Vec<usize> = {
                let mut st = shared.lock();
                loop {
                    let pending = st.jobs.iter().any(|(id, (s, _))| {
                        matches!(s, JobState::Queued)
                            && job_ids.as_ref().is_none_or(|ids| ids.contains(id))
                    });
                    if !pending {
                        break;
                    }
                    st = shared.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                }
                st.jobs
                    .iter()
                    .filter(|(id, _)| job_ids.as_ref().is_none_or(|ids| ids.contains(id)))
                    .filter_map(|(_, (s, _))| match s {
                        JobState::Enqueued { end, .. } => Some(*end),
                        _ => None,
                    })
                    .collect()
            };
            let _bound = (!ends.is_empty()).then(|| shared.bind());
            for end in ends {
                // SAFETY: a recorded event of a job not yet reported (events return to the
                // pool only when poll() reports their job, on the caller's thread).
                let rc = unsafe { (shared.api.event_synchronize)(ev(end)) };
                if rc != 0 {
                    // The error surfaces again from poll()'s query; clear this thread's copy.
                    shared.fail("cudaEventSynchronize", rc);
                }
            }
        });
    }

    /// Jobs submitted and not yet reported.
    fn in_flight(&self) -> usize {
        self.shared.lock().jobs.len()
    }

    /// Jobs the thread has not put on the stream yet.
    fn queued(&self) -> usize {
        self.shared
            .lock()
            .jobs
            .values()
            .filter(|(s, _)| matches!(s, JobState::Queued))
            .count()
    }

    /// Lets the thread enqueue what is queued, stops it, and waits for the device to finish
    /// every job (GIL released). Results stay available to `poll()`. Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        self.thread.shutdown(py);
        self.wait(py, None);
    }
}

impl Drop for CudaQueue {
    fn drop(&mut self) {
        // Nothing more reaches the stream once the thread has stopped.
        self.thread.stop();
        let api = Arc::clone(&self.shared.api);
        let _bound = api.on_device(self.shared.device);
        let mut st = self.shared.lock();
        // Every job still listed has an end event or none; wait for those on the stream
        // before their memory goes.
        for (state, _) in st.jobs.values() {
            if let JobState::Enqueued { end, .. } = state {
                // SAFETY: a recorded event of this queue.
                unsafe { (api.event_synchronize)(ev(*end)) };
            }
        }
        let mut events = std::mem::take(&mut st.timing_events);
        events.append(&mut st.ready_events);
        for e in events {
            // SAFETY: events this queue created and no longer uses.
            unsafe { (api.event_destroy)(ev(e)) };
        }
    }
}
