/*
 * fakecuda: a fake libcudart + libcuda in one shared library, for testing kvcache's
 * host<->device copy engine without a GPU.
 *
 * It exports the real CUDA symbol names with the real C signatures, so the engine can dlopen
 * it and dlsym its entry points exactly as it does with the real libraries. "Device memory"
 * is ordinary host memory that the test declares as belonging to a device
 * (fakecuda_add_device_memory); every other address is pinned host memory (cudaHostRegister)
 * or pageable host memory.
 *
 * What it models, because the engine's correctness depends on it:
 *   - streams run their work later, on a thread of their own, in enqueue order; gates let a
 *     test hold a stream at a point and so observe ordering and buffer-reuse bugs;
 *   - events: record generations, cross-stream waits, queries, timing;
 *   - the current device and the last error are per thread, as in CUDA; any call that needs
 *     a context marks the current device touched, so a test can see stray contexts;
 *   - pageable copies block the calling thread until executed; pinned/device ones do not;
 *   - cuMemcpyBatchAsync's argument rules and failIdx, with failure injection;
 *   - sticky faults: a bad kernel access poisons the process, as on a real GPU;
 *   - what a test waits for instead of sleeping: a gate reached, a stream sitting at a gate
 *     or an event wait, the ops a stream has not executed yet, the callers blocked in a
 *     synchronising call (so no test has to guess how long a thread takes to get there);
 *   - a copy kernel (fakecuda_launch_copy) that checks every 8-byte access the way the GPU's
 *     MMU would: aligned, inside mapped pinned memory or the stream's device memory;
 *   - a non-UVA mode (fakecuda_set_uva(0)) where mapped pinned memory has a separate device
 *     address, as on some WSL2 setups; the kernel then accepts only those addresses.
 *
 * What it does not model: real asynchrony of pageable copies (the call simply waits for the
 * stream), staging buffers, stream priorities or capture, contexts beyond the touched-device
 * mask, peer access, allocation APIs, and implicit synchronisation with the legacy default
 * stream (handles 0, 1 and 2 are one ordinary stream per device).
 *
 * Locking: one global mutex and one condition variable, broadcast on every state change.
 * The lock is never held while copying bytes or while a stream sits at a gate or a wait.
 *
 * Files: fakecuda.h (types, the shared state, the helpers the files share), state.c (the
 * shared state, locking, API entry and exit, events, gates and ops), streams.c (stream
 * threads, the copy kernel, copies), runtime.c (CUDA's runtime and driver entry points),
 * controls.c (what the tests call). Every internal name is hidden: the library exports CUDA's
 * names and the test controls alone, and a call from one file into another binds inside the
 * library even in a process that loaded the real libcudart globally (torch does).
 */
#ifndef FAKECUDA_H
#define FAKECUDA_H

#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum {
	E_OK = 0, E_VALUE = 1, E_MEMORY = 2, E_DEVICE = 101, E_HANDLE = 400, E_NOT_READY = 600,
	E_ILLEGAL = 700, E_REGISTERED = 712, E_NOT_REGISTERED = 713, E_MISALIGNED = 716,
	E_LAUNCH = 719,
};

#define MAX_DEVICES 64
#define ALIAS_OFFSET 0x100000000000ull
/* Handles come from a counter and are never reused, so a stale handle cannot alias a new
 * object (a freed pointer could); distinct bases make a stream handle an invalid event. */
#define STREAM_BASE 0x5e0000000000ull
#define EVENT_BASE 0xe70000000000ull
#define EVENT_DISABLE_TIMING 2u
#define HOST_REGISTER_MAPPED 2u

enum { C_MEMCPY, C_PAGEABLE, C_BATCH_OK, C_BATCH_FAILED, C_BATCH_COPIES, C_KERNELS, C_CROSS,
       C_RECORDS, C_STREAMS, C_REGISTERS, C_COUNT };

typedef struct { int type; int id; } CUmemLocation;
typedef struct {
	int srcAccessOrder;
	CUmemLocation srcLocHint;
	CUmemLocation dstLocHint;
	unsigned int flags;
} CUmemcpyAttributes;

struct range { uint64_t start, len; int device; unsigned flags; };
struct ranges { struct range *v; size_t n, cap; };
struct ptrs { void **v; size_t n, cap; };

enum { OP_COPY, OP_RECORD, OP_WAIT, OP_GATE, OP_KERNEL };
struct op {
	struct op *next;
	int kind;
	size_t n; /* OP_COPY: n copies, executed in order */
	uint64_t *dst, *src, *len;
	struct event *ev; /* OP_RECORD, OP_WAIT: the generation recorded or awaited */
	uint64_t gen;
	struct gate *gate; /* OP_GATE */
	uint64_t table, refs; /* OP_KERNEL */
	size_t nblocks, nrefs;
	int to_device;
};

struct stream {
	uint64_t handle;
	int device;
	pthread_t thread;
	struct op *head, *tail;
	uint64_t enqueued, executed;
	/* dead: destroyed, so callers blocked on it give up; users: callers still looking at it,
	 * so it is freed only once they have gone; blocked: its thread sits at a gate or a wait. */
	int stop, hold, dead, users, blocked;
};

struct event {
	uint64_t handle;
	int device;
	unsigned flags;
	uint64_t gen, done_gen; /* records made; latest record executed */
	int timed;		/* an executed record has set t */
	double t;
	int refs; /* the handle, pending ops and blocked callers */
};

/* A gate is the test's: it lives until the test has opened it and the stream has passed it
 * (or dropped it, under a sticky fault or a reset), or until the next reset. The stream
 * dropping it first must not turn the test's own gate_open into an error. */
struct gate { uint64_t id; int open, reached, passed; struct gate *next; };

#pragma GCC visibility push(hidden)

extern pthread_mutex_t g_lock;
extern pthread_cond_t g_cond;
extern int g_ndev, g_sticky, g_draining, g_uva;
extern int g_reg_closed, g_reg_waiting, g_holding, g_last_order;
/* Callers blocked in a synchronising call (stream or event synchronize, a pageable copy, a
 * stream destroy draining its work). */
extern int g_waiting;
extern uint64_t g_touched, g_next_handle, g_next_gate;
extern struct ptrs g_streams, g_events;
extern struct stream *g_default[MAX_DEVICES];
extern struct ranges g_devmem, g_regs;
extern struct gate *g_gates;
extern long g_count[C_COUNT];
extern long g_fail_memcpy_n, g_fail_reg_n;
extern int g_fail_memcpy_code, g_fail_reg_code, g_fail_batch_mode, g_fail_batch_code;
extern size_t g_fail_batch_index;
/* Copies (memcpy or batch entries, counted as executed) to drop or to corrupt. */
extern long g_drop_copy_n, g_corrupt_copy_n;
/* Every successful registration and unregistration, in order, for tests to inspect. */
extern struct ranges g_reg_log;
extern struct ranges g_unreg_log;
extern __thread int tl_device, tl_error;

#define LOCKED(stmt) \
	do { pthread_mutex_lock(&g_lock); stmt; pthread_mutex_unlock(&g_lock); } while (0)

/* state.c */
void wait_cond(void);
void wake_all(void);
double now_s(void);
int ptrs_push(struct ptrs *p, void *x);
void ptrs_remove(struct ptrs *p, void *x);
int ranges_push(struct ranges *r, struct range x);
int contains(const struct range *r, uint64_t a);
int covers(uint64_t start, uint64_t len, uint64_t a, uint64_t n);
int overlaps(const struct range *r, uint64_t a, uint64_t n);
int valid_device(int d);
int enter(void);
int enter_quiet(void);
int leave(int rc);
int leave_driver(int rc);
void event_unref(struct event *e);
struct event *find_event(void *h);
void gate_remove(struct gate *g);
struct op *op_new(int kind);
void op_free(struct op *op);
void enqueue(struct stream *s, struct op *op);
int dropping(void);

/* streams.c */
struct stream *stream_new(int device);
void stream_retire(struct stream *s);
struct stream *resolve_stream(void *h, int *rc);
int hold_wait(struct stream *s);
int wait_executed(struct stream *s, uint64_t seq);
int build_copy(const uint64_t *dst, const uint64_t *src, const size_t *len, size_t n,
	       size_t *fail, int *pageable, struct op **out);
int submit_copy(struct stream *s, struct op *op, int pageable);

#pragma GCC visibility pop

#endif /* FAKECUDA_H */
