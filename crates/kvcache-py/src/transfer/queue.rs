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
//! CUDA entry points are function addresses from the loaded runtime and driver (private API: a
//! wrong address is undefined behaviour, as with ctypes); tests pass ctypes fakes.

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_char, c_float, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kvcache_core::host::PinStatus;

use super::cuda::{memcpy_each_run, MemcpyAsyncFn, RunFailure};
use super::plan::{Plan, PlanData};
use super::registrar::nonzero;
use crate::errors::typed;

type Event = *mut c_void;
type Stream = *mut c_void;

/// cudaErrorNotReady: an event or stream has work still pending.
const NOT_READY: c_int = 600;
/// cudaEventDisableTiming.
const DISABLE_TIMING: c_uint = 2;

type EventCreateFn = unsafe extern "C" fn(*mut Event, c_uint) -> c_int;
type EventFn = unsafe extern "C" fn(Event) -> c_int;
type EventRecordFn = unsafe extern "C" fn(Event, Stream) -> c_int;
type ElapsedFn = unsafe extern "C" fn(*mut c_float, Event, Event) -> c_int;
type StreamWaitFn = unsafe extern "C" fn(Stream, Event, c_uint) -> c_int;
type StreamFn = unsafe extern "C" fn(Stream) -> c_int;
type SetDeviceFn = unsafe extern "C" fn(c_int) -> c_int;
type LastErrorFn = unsafe extern "C" fn() -> c_int;
type ErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;

#[derive(Clone, Copy)]
struct Fns {
    event_create: EventCreateFn,
    event_destroy: EventFn,
    event_record: EventRecordFn,
    event_query: EventFn,
    event_synchronize: EventFn,
    event_elapsed: ElapsedFn,
    stream_wait_event: StreamWaitFn,
    stream_synchronize: StreamFn,
    memcpy_async: MemcpyAsyncFn,
    set_device: SetDeviceFn,
    get_last_error: LastErrorFn,
    get_error_string: ErrorStringFn,
}

// SAFETY: plain function pointers into the CUDA runtime, which is thread-safe.
unsafe impl Send for Fns {}
// SAFETY: as above.
unsafe impl Sync for Fns {}

fn addr(py_fns: &Bound<'_, PyDict>, name: &str) -> PyResult<usize> {
    let value: usize = py_fns
        .get_item(name)?
        .ok_or_else(|| {
            typed(
                |e| &e.invalid_argument,
                format!("missing CUDA function {name}"),
            )
        })?
        .extract()?;
    nonzero(value, name)
}

macro_rules! fn_at {
    ($dict:expr, $name:literal, $ty:ty) => {{
        let a = addr($dict, $name)?;
        // SAFETY: per the private caller contract, `a` is the address of the named CUDA
        // runtime function, whose C signature is `$ty`.
        unsafe { std::mem::transmute::<usize, $ty>(a) }
    }};
}

impl Fns {
    fn from_dict(d: &Bound<'_, PyDict>) -> PyResult<Self> {
        Ok(Fns {
            event_create: fn_at!(d, "cudaEventCreateWithFlags", EventCreateFn),
            event_destroy: fn_at!(d, "cudaEventDestroy", EventFn),
            event_record: fn_at!(d, "cudaEventRecord", EventRecordFn),
            event_query: fn_at!(d, "cudaEventQuery", EventFn),
            event_synchronize: fn_at!(d, "cudaEventSynchronize", EventFn),
            event_elapsed: fn_at!(d, "cudaEventElapsedTime", ElapsedFn),
            stream_wait_event: fn_at!(d, "cudaStreamWaitEvent", StreamWaitFn),
            stream_synchronize: fn_at!(d, "cudaStreamSynchronize", StreamFn),
            memcpy_async: fn_at!(d, "cudaMemcpyAsync", MemcpyAsyncFn),
            set_device: fn_at!(d, "cudaSetDevice", SetDeviceFn),
            get_last_error: fn_at!(d, "cudaGetLastError", LastErrorFn),
            get_error_string: fn_at!(d, "cudaGetErrorString", ErrorStringFn),
        })
    }

    /// Reads and clears the calling thread's last error, and names `code`.
    fn describe(&self, what: &str, code: c_int) -> String {
        // SAFETY: cudaGetLastError takes no arguments; cudaGetErrorString returns a static
        // NUL-terminated string (or NULL) for any code.
        let name = unsafe {
            (self.get_last_error)();
            let p = (self.get_error_string)(code);
            if p.is_null() {
                format!("CUDA error {code}")
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        format!("{what} failed: {name} ({code})")
    }
}

/// `cuMemcpyBatchAsync` with `failIdx` (12.8+ drivers) or its `_v2` (13.x), by address.
#[derive(Clone, Copy)]
struct Batch {
    addr: usize,
    v2: bool,
}

/// One queued job as the thread receives it.
struct QueuedJob {
    id: u64,
    plan: Arc<PlanData>,
    ready: usize,
    src_access_order: i32,
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

struct State {
    order: VecDeque<u64>,
    jobs: HashMap<u64, (JobState, Arc<PlanData>)>,
    /// Reusable events: (timing, no-timing).
    timing_events: Vec<usize>,
    ready_events: Vec<usize>,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    fns: Fns,
    stream: usize,
    batch: Mutex<Option<Batch>>,
    batch_failed: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn stream(&self) -> Stream {
        std::ptr::with_exposed_provenance_mut(self.stream)
    }

    /// An event from the pool, or a new one; None (error cleared) when CUDA refuses.
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
        let rc = unsafe { (self.fns.event_create)(&mut ev, flags) };
        if rc != 0 {
            return Err(self.fns.describe("cudaEventCreateWithFlags", rc));
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

/// Enqueues every run of `plan` on the stream (one batched call, or one call per run after a
/// batch failure); the cause of a failure, if any.
fn enqueue_copies(shared: &Shared, plan: &PlanData, order: i32) -> Option<String> {
    let _guard = plan.copy_guard();
    let runs = plan.runs();
    if runs.is_empty() {
        return None;
    }
    let batch = *shared.batch.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(b) = batch {
        match super::cuda::batch_copy(runs, b.addr, b.v2, shared.stream, order) {
            (0, _) => return None,
            (rc, _failed_at) => {
                // Every run is re-issued one by one below (same bytes, same stream order).
                shared.fns.describe("cuMemcpyBatchAsync", rc);
                if !matches!(plan.region().pin_status(), PinStatus::Pinning { .. }) {
                    // Once pinning is over (done, failed or never asked for), the memory will
                    // not change: the driver cannot batch these copies, stop trying. While a
                    // background registration is still running, ranges not yet pinned may be
                    // the cause, so only this job goes run by run.
                    shared.batch_failed.store(true, Ordering::Release);
                    *shared.batch.lock().unwrap_or_else(|e| e.into_inner()) = None;
                }
            }
        }
    }
    // SAFETY: `memcpy_async` is cudaMemcpyAsync (resolved by name); the plan's runs lie inside
    // the pool and the device tensors it was validated against; the plan (held by this job
    // until it is reported) keeps the pool mapped, and the engine keeps the device tensors
    // alive. cudaMemcpyDefault (4) infers the direction.
    match unsafe { memcpy_each_run(runs, shared.fns.memcpy_async, 4, shared.stream()) } {
        Ok(()) => None,
        Err(RunFailure::Unaddressable { index }) => {
            Some(format!("run {index} does not fit in this address space"))
        }
        Err(RunFailure::Cuda { index, code }) => {
            let cause = shared.fns.describe("cudaMemcpyAsync", code);
            Some(format!("{cause} after {index} of {} runs", runs.len()))
        }
    }
}

fn run_queue(rx: Receiver<QueuedJob>, shared: Arc<Shared>, device: i32) {
    // SAFETY: cudaSetDevice takes a device ordinal; the thread works for that device only.
    let bound = unsafe { (shared.fns.set_device)(device) };
    let bind_error = (bound != 0).then(|| shared.fns.describe("cudaSetDevice", bound));
    while let Ok(job) = rx.recv() {
        let outcome = match &bind_error {
            Some(e) => Err(e.clone()),
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
    let fns = &shared.fns;
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
        let rc = (fns.stream_wait_event)(shared.stream(), ev(job.ready), 0);
        if rc != 0 {
            let mut st = shared.lock();
            shared.give_back(&mut st, start, true);
            shared.give_back(&mut st, end, true);
            return Err(fns.describe("cudaStreamWaitEvent", rc));
        }
        let mut error = None;
        let rc = (fns.event_record)(ev(start), shared.stream());
        if rc != 0 {
            error = Some(fns.describe("cudaEventRecord", rc));
        }
        if error.is_none() {
            error = enqueue_copies(shared, &job.plan, job.src_access_order);
        }
        let rc = (fns.event_record)(ev(end), shared.stream());
        if rc != 0 {
            // No end marker: make sure nothing of the job still runs before reporting it.
            let cause = fns.describe("cudaEventRecord", rc);
            (fns.stream_synchronize)(shared.stream());
            (fns.get_last_error)();
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
    device: i32,
    tx: Mutex<Option<Sender<QueuedJob>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
    /// Keeps the runtime library (or the test's callbacks) alive while the thread may call it.
    _keepalive: Py<PyAny>,
}

#[pymethods]
impl CudaQueue {
    /// Pickling and copying are refused with `kvcache.InvalidTypeError` (a `TypeError`).
    fn __reduce__(slf: &Bound<'_, Self>) -> PyResult<()> {
        Err(crate::errors::not_picklable(slf.as_any()))
    }

    /// A queue submitting to `stream` (a `cudaStream_t`) on `device`. `fns` maps CUDA runtime
    /// function names (cudaEventCreateWithFlags, cudaEventDestroy, cudaEventRecord,
    /// cudaEventQuery, cudaEventSynchronize, cudaEventElapsedTime, cudaStreamWaitEvent,
    /// cudaStreamSynchronize, cudaMemcpyAsync, cudaSetDevice, cudaGetLastError,
    /// cudaGetErrorString) to their addresses; `batch_fn` is cuMemcpyBatchAsync (or its `_v2`
    /// with `batch_v2`), 0 for one cudaMemcpyAsync per run. `keepalive` is held for the
    /// queue's lifetime.
    #[new]
    #[pyo3(signature = (stream, device, fns, keepalive, *, batch_fn=0, batch_v2=false))]
    fn new(
        stream: usize,
        device: i32,
        fns: &Bound<'_, PyDict>,
        keepalive: Py<PyAny>,
        batch_fn: usize,
        batch_v2: bool,
    ) -> PyResult<Self> {
        let fns = Fns::from_dict(fns)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                order: VecDeque::new(),
                jobs: HashMap::new(),
                timing_events: Vec::new(),
                ready_events: Vec::new(),
            }),
            cv: Condvar::new(),
            fns,
            stream,
            batch: Mutex::new((batch_fn != 0).then_some(Batch {
                addr: batch_fn,
                v2: batch_v2,
            })),
            batch_failed: AtomicBool::new(false),
        });
        let (tx, rx) = channel();
        let thread_shared = Arc::clone(&shared);
        let worker = std::thread::Builder::new()
            .name("kvcache-dma".into())
            .spawn(move || run_queue(rx, thread_shared, device))
            .map_err(|e| typed(|e| &e.transfer, format!("cannot start DMA thread: {e}")))?;
        Ok(CudaQueue {
            shared,
            device,
            tx: Mutex::new(Some(tx)),
            worker: Mutex::new(Some(worker)),
            _keepalive: keepalive,
        })
    }

    /// Whether batched submission is in use (False after a batch call failed: every later
    /// job goes run by run).
    #[getter]
    fn batched(&self) -> bool {
        self.shared
            .batch
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// True once, after a batched call failed and the queue switched to per-run copies.
    fn take_batch_failure(&self) -> bool {
        self.shared.batch_failed.swap(false, Ordering::AcqRel)
    }

    #[getter]
    fn device(&self) -> i32 {
        self.device
    }

    /// Queues `plan` as job `job_id` (unique among unreported jobs): records an event on
    /// `current_stream` now, so the copies see all work queued there before this call; the
    /// thread then builds and enqueues them. `src_access_order`: 1 (stream order) when the
    /// source may still be written by the device, 3 (any) for host sources.
    fn submit(
        &self,
        job_id: u64,
        plan: &Bound<'_, Plan>,
        current_stream: usize,
        src_access_order: i32,
    ) -> PyResult<()> {
        // Host-layer plans are accepted too (cudaMemcpyDefault copies host to host): the tests
        // drive a queue with them.
        let data = plan.get().data();
        data.check_not_executed()?;
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
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
        let recorded = shared.event(false).and_then(|ready| {
            // SAFETY: a valid event, and the caller's current stream handle.
            let rc = unsafe {
                (shared.fns.event_record)(
                    ev(ready),
                    std::ptr::with_exposed_provenance_mut(current_stream),
                )
            };
            if rc == 0 {
                Ok(ready)
            } else {
                let mut st = shared.lock();
                shared.give_back(&mut st, ready, false);
                Err(shared.fns.describe("cudaEventRecord", rc))
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
                    // SAFETY: a valid event recorded on the queue's stream.
                    let rc = unsafe { (shared.fns.event_query)(ev(end)) };
                    st = shared.lock();
                    if rc == NOT_READY {
                        break;
                    }
                    let mut seconds = None;
                    let error = if rc == 0 {
                        let mut ms: c_float = 0.0;
                        // SAFETY: both events were recorded on the stream and have completed.
                        if unsafe { (shared.fns.event_elapsed)(&mut ms, ev(start), ev(end)) } == 0 {
                            seconds = Some(f64::from(ms) * 1e-3);
                        } else {
                            // SAFETY: clears the error left by the failed call.
                            unsafe { (shared.fns.get_last_error)() };
                        }
                        error
                    } else {
                        Some(
                            shared
                                .fns
                                .describe("the device reported an error; the job", rc),
                        )
                    };
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
    fn wait(&self, py: Python<'_>, job_ids: Option<Vec<u64>>) {
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
            for end in ends {
                // SAFETY: a recorded event of a job not yet reported (events return to the
                // pool only when poll() reports their job, on the caller's thread).
                if unsafe { (shared.fns.event_synchronize)(ev(end)) } != 0 {
                    // The error surfaces again from poll()'s query; clear this thread's copy.
                    // SAFETY: cudaGetLastError takes no arguments.
                    unsafe { (shared.fns.get_last_error)() };
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
        drop(self.tx.lock().unwrap_or_else(|e| e.into_inner()).take());
        let handle = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            py.detach(move || {
                let _ = h.join();
            });
        }
        self.wait(py, None);
    }
}

impl Drop for CudaQueue {
    fn drop(&mut self) {
        drop(self.tx.get_mut().unwrap_or_else(|e| e.into_inner()).take());
        if let Some(h) = self
            .worker
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = h.join();
        }
        let fns = self.shared.fns;
        let mut st = self.shared.lock();
        // Every job still listed has an end event or none; wait for those on the stream
        // before their memory goes.
        for (state, _) in st.jobs.values() {
            if let JobState::Enqueued { end, .. } = state {
                // SAFETY: a recorded event of this queue.
                unsafe { (fns.event_synchronize)(ev(*end)) };
            }
        }
        let mut events = std::mem::take(&mut st.timing_events);
        events.append(&mut st.ready_events);
        for e in events {
            // SAFETY: events this queue created and no longer uses.
            unsafe { (fns.event_destroy)(ev(e)) };
        }
    }
}
