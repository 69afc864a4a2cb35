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
 */
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
static const char *const counter_names[C_COUNT] = {
	"memcpy_calls",	   "pageable_copies",	 "batch_ok",	  "batch_failed",    "batch_copies",
	"kernel_launches", "cross_device_calls", "event_records", "streams_created", "registers",
};

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

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cond = PTHREAD_COND_INITIALIZER;
static int g_ndev = 1, g_sticky, g_draining, g_uva = 1;
static int g_reg_closed, g_reg_waiting, g_holding, g_last_order;
/* Callers blocked in a synchronising call (stream or event synchronize, a pageable copy, a
 * stream destroy draining its work). */
static int g_waiting;
static uint64_t g_touched, g_next_handle = 1, g_next_gate = 1;
static struct ptrs g_streams, g_events;
static struct stream *g_default[MAX_DEVICES];
static struct ranges g_devmem, g_regs;
static struct gate *g_gates;
static long g_count[C_COUNT];
static long g_fail_memcpy_n, g_fail_reg_n;
static int g_fail_memcpy_code, g_fail_reg_code, g_fail_batch_mode, g_fail_batch_code;
static size_t g_fail_batch_index;
/* Copies (memcpy or batch entries, counted as executed) to drop or to corrupt. */
static long g_drop_copy_n, g_corrupt_copy_n;
/* Every successful registration and unregistration, in order, for tests to inspect. */
static struct ranges g_reg_log;
static struct ranges g_unreg_log;
static __thread int tl_device, tl_error;

#define LOCKED(stmt) \
	do { pthread_mutex_lock(&g_lock); stmt; pthread_mutex_unlock(&g_lock); } while (0)

static void wait_cond(void) { pthread_cond_wait(&g_cond, &g_lock); }
static void wake_all(void) { pthread_cond_broadcast(&g_cond); }

static double now_s(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int grow(void **v, size_t *cap, size_t n, size_t size) {
	if (n < *cap) return 0;
	size_t cap2 = *cap ? 2 * *cap : 16;
	void *p = realloc(*v, cap2 * size);
	if (!p) return -1;
	*v = p;
	*cap = cap2;
	return 0;
}

static int ptrs_push(struct ptrs *p, void *x) {
	if (grow((void **)&p->v, &p->cap, p->n, sizeof *p->v)) return -1;
	p->v[p->n++] = x;
	return 0;
}

static void ptrs_remove(struct ptrs *p, void *x) {
	for (size_t i = 0; i < p->n; i++)
		if (p->v[i] == x) {
			p->v[i] = p->v[--p->n];
			return;
		}
}

static int ranges_push(struct ranges *r, struct range x) {
	if (grow((void **)&r->v, &r->cap, r->n, sizeof *r->v)) return -1;
	r->v[r->n++] = x;
	return 0;
}

static int contains(const struct range *r, uint64_t a) {
	return a >= r->start && a - r->start < r->len;
}

/* [a, a+n) inside [start, start+len), written so that no sum can overflow. */
static int covers(uint64_t start, uint64_t len, uint64_t a, uint64_t n) {
	return a >= start && a - start <= len && n <= len - (a - start);
}

static int overlaps(const struct range *r, uint64_t a, uint64_t n) {
	return a < r->start + r->len && r->start < a + n;
}

static int valid_device(int d) { return d >= 0 && d < g_ndev; }

/* ---- entry and exit of API calls --------------------------------------------------------- */

/* Entry of every call that needs a context: marks the current device touched and answers
 * the sticky fault, if any. Takes the lock. */
static int enter(void) {
	pthread_mutex_lock(&g_lock);
	if (valid_device(tl_device)) g_touched |= 1ull << tl_device;
	return g_sticky;
}

/* Entry of the calls CUDA answers without a context. */
static int enter_quiet(void) {
	pthread_mutex_lock(&g_lock);
	return g_sticky;
}

/* Runtime calls record failures as the thread's last error; driver calls do not. As in
 * CUDA, "not ready" is an answer, not an error. */
static int leave(int rc) {
	if (rc && rc != E_NOT_READY) tl_error = rc;
	pthread_mutex_unlock(&g_lock);
	return rc;
}

static int leave_driver(int rc) {
	pthread_mutex_unlock(&g_lock);
	return rc;
}

/* ---- events, gates, ops ------------------------------------------------------------------ */

static void event_unref(struct event *e) {
	if (--e->refs == 0) free(e);
}

static struct event *find_event(void *h) {
	for (size_t i = 0; i < g_events.n; i++) {
		struct event *e = g_events.v[i];
		if (e->handle == (uint64_t)(uintptr_t)h) return e;
	}
	return NULL;
}

static void gate_remove(struct gate *g) {
	for (struct gate **p = &g_gates; *p; p = &(*p)->next)
		if (*p == g) {
			*p = g->next;
			break;
		}
	free(g);
}

static struct op *op_new(int kind) {
	struct op *op = calloc(1, sizeof *op);
	if (op) op->kind = kind;
	return op;
}

static void op_free(struct op *op) {
	/* A dropped record still counts as done, so nobody waits forever on a stream that
	 * stopped executing. */
	if (op->kind == OP_RECORD && op->ev->done_gen < op->gen) op->ev->done_gen = op->gen;
	if (op->ev) event_unref(op->ev);
	if (op->gate) {
		op->gate->passed = 1;
		if (op->gate->open) gate_remove(op->gate);
	}
	free(op->dst);
	free(op->src);
	free(op->len);
	free(op);
}

static void enqueue(struct stream *s, struct op *op) {
	if (s->tail) s->tail->next = op;
	else s->head = op;
	s->tail = op;
	s->enqueued++;
	wake_all();
}

static int dropping(void) { return g_sticky || g_draining; }

/* ---- the copy kernel --------------------------------------------------------------------- */

/* The memory tables as they were when the kernel started, so it runs without the lock. */
struct snapshot {
	struct range *dev, *host;
	size_t ndev, nhost;
	uint64_t alias; /* what the device adds to a mapped host address */
};

static int snapshot_take(struct snapshot *s, int device) {
	memset(s, 0, sizeof *s);
	s->dev = malloc((g_devmem.n + 1) * sizeof *s->dev);
	s->host = malloc((g_regs.n + 1) * sizeof *s->host);
	if (!s->dev || !s->host) return -1;
	for (size_t i = 0; i < g_devmem.n; i++)
		if (g_devmem.v[i].device == device) s->dev[s->ndev++] = g_devmem.v[i];
	for (size_t i = 0; i < g_regs.n; i++)
		if (g_regs.v[i].flags & HOST_REGISTER_MAPPED) s->host[s->nhost++] = g_regs.v[i];
	s->alias = g_uva ? 0 : ALIAS_OFFSET;
	return 0;
}

static int on_device(const struct snapshot *s, uint64_t a, uint64_t n) {
	for (size_t i = 0; i < s->ndev; i++)
		if (covers(s->dev[i].start, s->dev[i].len, a, n)) return 1;
	return 0;
}

/* The host address a device-side access to [a, a+8) reaches, or 0 if the MMU would fault. */
static uint64_t mapped_host(const struct snapshot *s, uint64_t a) {
	for (size_t i = 0; i < s->nhost; i++)
		if (covers(s->host[i].start + s->alias, s->host[i].len, a, 8)) return a - s->alias;
	return 0;
}

static int kernel_run(const struct op *op, const struct snapshot *snap) {
	size_t n = op->nblocks, nrefs = op->nrefs;
	if (n > SIZE_MAX / 24 || nrefs > SIZE_MAX / 40) return E_ILLEGAL;
	if ((op->table | op->refs) & 7) return E_MISALIGNED;
	/* The kernel reads its arguments from device memory, like the real one. */
	if (n && !on_device(snap, op->table, 24 * n)) return E_ILLEGAL;
	if (nrefs && !on_device(snap, op->refs, 40 * nrefs)) return E_ILLEGAL;
	const int64_t *ids = (const int64_t *)(uintptr_t)op->table;
	const int64_t *chunks = ids + n, *slots = ids + 2 * n;
	const int64_t *refs = (const int64_t *)(uintptr_t)op->refs;
	for (size_t i = 0; i < n; i++) {
		for (size_t r = 0; r < nrefs; r++) {
			const int64_t *ref = refs + 5 * r;
			/* Unsigned arithmetic wraps as the GPU's does; the checks catch it. */
			uint64_t dev = (uint64_t)ref[0] + (uint64_t)ids[i] * (uint64_t)ref[1];
			uint64_t host = (uint64_t)chunks[i] + (uint64_t)ref[2] +
					(uint64_t)slots[i] * (uint64_t)ref[3];
			int64_t words = ref[4] > 0 ? ref[4] / 8 : 0;
			for (int64_t w = 0; w < words; w++) {
				uint64_t d = dev + 8 * (uint64_t)w, h = host + 8 * (uint64_t)w;
				if ((d | h) & 7) return E_MISALIGNED;
				uint64_t hp = mapped_host(snap, h);
				if (!hp || !on_device(snap, d, 8)) return E_ILLEGAL;
				uint64_t *dp = (uint64_t *)(uintptr_t)d;
				uint64_t *hq = (uint64_t *)(uintptr_t)hp;
				if (op->to_device) *dp = *hq;
				else *hq = *dp;
			}
		}
	}
	return E_OK;
}

/* ---- stream threads ---------------------------------------------------------------------- */

/* One wait of a stream's thread at a gate or an event, seen by fakecuda_stream_blocked. */
static void block_stream(struct stream *s) {
	if (!s->blocked) {
		s->blocked = 1;
		wake_all();
	}
	wait_cond();
}

/* Runs one op; the lock is held on entry and exit but dropped for the slow parts. */
static void run_op(struct stream *s, struct op *op) {
	switch (op->kind) {
	case OP_COPY:
		for (size_t i = 0; i < op->n; i++) {
			/* Injected misbehaviour of an otherwise successful copy (for self-checks). */
			int drop = g_drop_copy_n > 0 && --g_drop_copy_n == 0;
			int corrupt = g_corrupt_copy_n > 0 && --g_corrupt_copy_n == 0;
			pthread_mutex_unlock(&g_lock);
			if (!drop)
				memmove((void *)(uintptr_t)op->dst[i],
					(const void *)(uintptr_t)op->src[i], op->len[i]);
			if (corrupt && op->len[i])
				*(volatile unsigned char *)(uintptr_t)op->dst[i] ^= 0x5A;
			pthread_mutex_lock(&g_lock);
		}
		break;
	case OP_RECORD:
		if (op->ev->done_gen < op->gen) {
			op->ev->done_gen = op->gen;
			op->ev->t = now_s();
			op->ev->timed = 1;
		}
		break;
	case OP_WAIT:
		while (op->ev->done_gen < op->gen && !dropping()) block_stream(s);
		s->blocked = 0;
		break;
	case OP_GATE:
		op->gate->reached = 1;
		wake_all();
		while (!op->gate->open && !dropping()) block_stream(s);
		s->blocked = 0;
		break;
	case OP_KERNEL: {
		struct snapshot snap;
		int rc = E_LAUNCH;
		if (snapshot_take(&snap, s->device) == 0) {
			pthread_mutex_unlock(&g_lock);
			rc = kernel_run(op, &snap);
			pthread_mutex_lock(&g_lock);
		}
		free(snap.dev);
		free(snap.host);
		if (rc && !g_sticky) g_sticky = rc;
		break;
	}
	}
}

static void *stream_main(void *arg) {
	struct stream *s = arg;
	pthread_mutex_lock(&g_lock);
	for (;;) {
		while (!s->head && !s->stop) wait_cond();
		if (!s->head) break;
		struct op *op = s->head;
		s->head = op->next;
		if (!s->head) s->tail = NULL;
		if (!dropping()) run_op(s, op);
		op_free(op);
		s->executed++;
		wake_all();
	}
	pthread_mutex_unlock(&g_lock);
	return NULL;
}

static struct stream *stream_new(int device) {
	struct stream *s = calloc(1, sizeof *s);
	if (!s) return NULL;
	s->device = device;
	s->handle = STREAM_BASE + 16 * g_next_handle++;
	if (pthread_create(&s->thread, NULL, stream_main, s)) {
		free(s);
		return NULL;
	}
	return s;
}

/* Waits (lock held) until `s` has executed `target` ops or a sticky fault ends the wait
 * (`sticky`), counted in g_waiting while it blocks. */
static void block_on_stream(struct stream *s, uint64_t target, int sticky) {
	if (s->executed >= target || (sticky && g_sticky)) return;
	g_waiting++;
	wake_all();
	while (s->executed < target && !(sticky && g_sticky)) wait_cond();
	g_waiting--;
	wake_all();
}

/* Drains, stops, joins and frees a stream already out of every registry. Lock held. */
static void stream_retire(struct stream *s) {
	uint64_t target = s->enqueued;
	s->dead = 1;
	s->hold = 0;
	wake_all();
	block_on_stream(s, target, 0);
	s->stop = 1;
	wake_all();
	pthread_mutex_unlock(&g_lock);
	pthread_join(s->thread, NULL);
	pthread_mutex_lock(&g_lock);
	while (s->users) wait_cond();
	free(s);
}

/* Handles 0, 1 (legacy) and 2 (per-thread) are the current device's default stream. */
static struct stream *resolve_stream(void *h, int *rc) {
	uint64_t v = (uint64_t)(uintptr_t)h;
	if (v <= 2) {
		int d = tl_device;
		if (!valid_device(d)) {
			*rc = E_DEVICE;
			return NULL;
		}
		if (!g_default[d] && !(g_default[d] = stream_new(d))) *rc = E_MEMORY;
		return g_default[d];
	}
	for (size_t i = 0; i < g_streams.n; i++) {
		struct stream *s = g_streams.v[i];
		if (s->handle == v) return s;
	}
	*rc = E_HANDLE;
	return NULL;
}

/* Blocks while a test holds submissions to `s`; E_HANDLE if it was destroyed meanwhile. */
static int hold_wait(struct stream *s) {
	if (!s->hold) return E_OK;
	s->users++;
	g_holding++;
	while (s->hold && !s->dead) wait_cond();
	g_holding--;
	s->users--;
	wake_all();
	return s->dead ? E_HANDLE : E_OK;
}

/* Blocks until `s` has executed its op number `seq`. */
static int wait_executed(struct stream *s, uint64_t seq) {
	s->users++;
	block_on_stream(s, seq, 1);
	s->users--;
	wake_all();
	return g_sticky;
}

/* ---- copies ------------------------------------------------------------------------------ */

enum { MEM_PAGEABLE, MEM_PINNED, MEM_DEVICE };

/* Where [a, a+n) lies; E_VALUE if it starts in a known range but runs past its end. *host is
 * the address to access (it differs from a for a non-UVA device alias of pinned memory). */
static int classify(uint64_t a, uint64_t n, int *kind, uint64_t *host) {
	*host = a;
	for (size_t i = 0; i < g_devmem.n; i++)
		if (contains(&g_devmem.v[i], a)) {
			const struct range *r = &g_devmem.v[i];
			*kind = MEM_DEVICE;
			return covers(r->start, r->len, a, n) ? E_OK : E_VALUE;
		}
	for (size_t i = 0; i < g_regs.n; i++) {
		const struct range *r = &g_regs.v[i];
		uint64_t alias = r->start + ALIAS_OFFSET;
		int in_alias = !g_uva && (r->flags & HOST_REGISTER_MAPPED) && a >= alias &&
			       a - alias < r->len;
		if (contains(r, a) || in_alias) {
			*kind = MEM_PINNED;
			*host = in_alias ? a - ALIAS_OFFSET : a;
			return covers(r->start, r->len, *host, n) ? E_OK : E_VALUE;
		}
	}
	*kind = MEM_PAGEABLE;
	return a ? E_OK : E_VALUE;
}

/* Validates every copy, then builds one op of them; *pageable counts the pageable ones. */
static int build_copy(const uint64_t *dst, const uint64_t *src, const size_t *len, size_t n,
		      size_t *fail, int *pageable, struct op **out) {
	struct op *op = op_new(OP_COPY);
	if (!op) return E_MEMORY;
	op->dst = malloc((n + 1) * sizeof *op->dst);
	op->src = malloc((n + 1) * sizeof *op->src);
	op->len = malloc((n + 1) * sizeof *op->len);
	int rc = op->dst && op->src && op->len ? E_OK : E_MEMORY;
	*pageable = 0;
	for (size_t i = 0; !rc && i < n; i++) {
		int kd, ks;
		uint64_t d, s;
		rc = classify(dst[i], len[i], &kd, &d);
		if (!rc) rc = classify(src[i], len[i], &ks, &s);
		if (rc) {
			*fail = i;
			break;
		}
		if (kd == MEM_PAGEABLE || ks == MEM_PAGEABLE) (*pageable)++;
		op->dst[op->n] = d;
		op->src[op->n] = s;
		op->len[op->n++] = len[i];
	}
	if (rc) op_free(op);
	else *out = op;
	return rc;
}

/* Enqueues a copy op; with pageable memory involved, waits for it as CUDA does. */
static int submit_copy(struct stream *s, struct op *op, int pageable) {
	enqueue(s, op);
	if (!pageable) return E_OK;
	g_count[C_PAGEABLE] += pageable;
	return wait_executed(s, s->enqueued);
}

/* ---- error strings ----------------------------------------------------------------------- */

static const struct { int code; const char *text; } error_texts[] = {
	{E_OK, "cudaSuccess: no error"},
	{E_VALUE, "cudaErrorInvalidValue: invalid argument"},
	{E_MEMORY, "cudaErrorMemoryAllocation: out of memory"},
	{E_DEVICE, "cudaErrorInvalidDevice: invalid device ordinal"},
	{E_HANDLE, "cudaErrorInvalidResourceHandle: invalid resource handle"},
	{E_NOT_READY, "cudaErrorNotReady: device not ready"},
	{E_ILLEGAL, "cudaErrorIllegalAddress: an illegal memory access was encountered"},
	{E_REGISTERED, "cudaErrorHostMemoryAlreadyRegistered: part or all of the requested memory "
		       "range is already mapped"},
	{E_NOT_REGISTERED, "cudaErrorHostMemoryNotRegistered: pointer does not correspond to a "
			   "registered memory region"},
	{E_MISALIGNED, "cudaErrorMisalignedAddress: misaligned address"},
	{E_LAUNCH, "cudaErrorLaunchFailure: unspecified launch failure"},
};

static const char *error_text(int code) {
	for (size_t i = 0; i < sizeof error_texts / sizeof *error_texts; i++)
		if (error_texts[i].code == code) return error_texts[i].text;
	return "unknown error";
}

const char *cudaGetErrorString(int error) { return error_text(error); }

int cuGetErrorString(int error, const char **pStr) {
	if (!pStr) return E_VALUE;
	*pStr = error_text(error);
	return E_OK;
}

/* ---- devices and errors ------------------------------------------------------------------ */

int cudaSetDevice(int device) {
	int rc = enter_quiet();
	if (!rc && !valid_device(device)) rc = E_DEVICE;
	if (!rc) tl_device = device;
	return leave(rc);
}

int cudaGetDevice(int *device) {
	int rc = enter_quiet();
	if (!rc && !device) rc = E_VALUE;
	if (!rc) *device = tl_device;
	return leave(rc);
}

int cudaGetDeviceCount(int *count) {
	int rc = enter_quiet();
	if (!rc && !count) rc = E_VALUE;
	if (!rc) *count = g_ndev;
	return leave(rc);
}

int cudaGetLastError(void) {
	int rc = enter_quiet();
	if (!rc) {
		rc = tl_error;
		tl_error = 0;
	}
	return leave_driver(rc);
}

int cudaPeekAtLastError(void) {
	int rc = enter_quiet();
	return leave_driver(rc ? rc : tl_error);
}

/* ---- streams ----------------------------------------------------------------------------- */

/* Exported functions never call each other: in a process that also loaded the real
 * libcudart globally (torch does), such calls would bind to the real library. */
static int stream_create(void **stream, unsigned int flags) {
	int rc = enter();
	if (!rc && (!stream || flags > 1)) rc = E_VALUE;
	if (!rc && !valid_device(tl_device)) rc = E_DEVICE;
	if (rc) return leave(rc);
	struct stream *s = stream_new(tl_device);
	if (!s || ptrs_push(&g_streams, s)) {
		if (s) stream_retire(s);
		return leave(E_MEMORY);
	}
	g_count[C_STREAMS]++;
	*stream = (void *)(uintptr_t)s->handle;
	return leave(E_OK);
}

int cudaStreamCreateWithFlags(void **stream, unsigned int flags) {
	return stream_create(stream, flags);
}
int cudaStreamCreate(void **stream) { return stream_create(stream, 0); }

int cudaStreamDestroy(void *stream) {
	int rc = enter();
	/* The default streams cannot be destroyed. */
	if (!rc && (uintptr_t)stream <= 2) rc = E_HANDLE;
	struct stream *s = rc ? NULL : resolve_stream(stream, &rc);
	if (s) {
		ptrs_remove(&g_streams, s);
		stream_retire(s);
	}
	return leave(rc);
}

int cudaStreamSynchronize(void *stream) {
	int rc = enter();
	struct stream *s = rc ? NULL : resolve_stream(stream, &rc);
	if (s) rc = wait_executed(s, s->enqueued);
	return leave(rc);
}

int cudaStreamQuery(void *stream) {
	int rc = enter();
	struct stream *s = rc ? NULL : resolve_stream(stream, &rc);
	if (s && s->executed < s->enqueued) rc = E_NOT_READY;
	return leave(rc);
}

int cudaStreamWaitEvent(void *stream, void *event, unsigned int flags) {
	int rc = enter();
	struct stream *s = rc ? NULL : resolve_stream(stream, &rc);
	struct event *e = s ? find_event(event) : NULL;
	if (s && !e) rc = E_HANDLE;
	if (!rc && flags > 1) rc = E_VALUE;
	if (rc) return leave(rc);
	if (s->device != tl_device) g_count[C_CROSS]++;
	if (!e->gen) return leave(E_OK); /* never recorded: complete, nothing to wait for */
	struct op *op = op_new(OP_WAIT);
	if (!op) return leave(E_MEMORY);
	op->ev = e;
	op->gen = e->gen;
	e->refs++;
	enqueue(s, op);
	return leave(E_OK);
}

/* ---- events ------------------------------------------------------------------------------ */

static int event_create(void **event, unsigned int flags) {
	int rc = enter();
	if (!rc && (!event || flags > 7)) rc = E_VALUE;
	if (!rc && !valid_device(tl_device)) rc = E_DEVICE;
	if (rc) return leave(rc);
	struct event *e = calloc(1, sizeof *e);
	if (!e || ptrs_push(&g_events, e)) {
		free(e);
		return leave(E_MEMORY);
	}
	e->handle = EVENT_BASE + 16 * g_next_handle++;
	e->device = tl_device;
	e->flags = flags;
	e->refs = 1;
	*event = (void *)(uintptr_t)e->handle;
	return leave(E_OK);
}

int cudaEventCreateWithFlags(void **event, unsigned int flags) {
	return event_create(event, flags);
}
int cudaEventCreate(void **event) { return event_create(event, 0); }

/* The live event behind a handle, or NULL with *rc set. */
static struct event *event_of(void *h, int *rc) {
	struct event *e = *rc ? NULL : find_event(h);
	if (!*rc && !e) *rc = E_HANDLE;
	return e;
}

int cudaEventDestroy(void *event) {
	int rc = enter();
	struct event *e = event_of(event, &rc);
	if (e) {
		ptrs_remove(&g_events, e);
		event_unref(e);
	}
	return leave(rc);
}

int cudaEventRecord(void *event, void *stream) {
	int rc = enter();
	struct event *e = event_of(event, &rc);
	struct stream *s = rc ? NULL : resolve_stream(stream, &rc);
	if (s && s->device != e->device) rc = E_HANDLE;
	struct op *op = rc ? NULL : op_new(OP_RECORD);
	if (!rc && !op) rc = E_MEMORY;
	if (rc) return leave(rc);
	op->ev = e;
	op->gen = ++e->gen;
	e->refs++;
	g_count[C_RECORDS]++;
	enqueue(s, op);
	return leave(E_OK);
}

int cudaEventQuery(void *event) {
	int rc = enter();
	struct event *e = event_of(event, &rc);
	if (e && e->done_gen < e->gen) rc = E_NOT_READY;
	return leave(rc);
}

int cudaEventSynchronize(void *event) {
	int rc = enter();
	struct event *e = event_of(event, &rc);
	if (e) {
		uint64_t target = e->gen;
		e->refs++;
		if (e->done_gen < target && !g_sticky) {
			g_waiting++;
			wake_all();
			while (e->done_gen < target && !g_sticky) wait_cond();
			g_waiting--;
			wake_all();
		}
		rc = g_sticky;
		event_unref(e);
	}
	return leave(rc);
}

int cudaEventElapsedTime(float *ms, void *start, void *end) {
	int rc = enter();
	struct event *a = event_of(start, &rc), *b = event_of(end, &rc);
	if (!rc && !ms) rc = E_VALUE;
	/* CUDA: timing disabled, or never recorded, is an invalid handle. */
	else if (!rc && ((a->flags | b->flags) & EVENT_DISABLE_TIMING || !a->gen || !b->gen))
		rc = E_HANDLE;
	else if (!rc && (a->done_gen < a->gen || b->done_gen < b->gen)) rc = E_NOT_READY;
	else if (!rc && (!a->timed || !b->timed)) rc = E_HANDLE;
	if (!rc) {
		double diff = (b->t - a->t) * 1e3;
		/* Two records can execute within the clock's resolution; a later record must still
		 * read as later, and callers divide by this. */
		*ms = (float)(diff >= 0 && diff < 1e-6 ? 1e-6 : diff);
	}
	return leave(rc);
}

/* ---- copies: API ------------------------------------------------------------------------- */

int cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, void *stream) {
	int rc = enter();
	if (!rc) g_count[C_MEMCPY]++;
	if (!rc && g_fail_memcpy_n > 0 && --g_fail_memcpy_n == 0) rc = g_fail_memcpy_code;
	struct stream *s = rc ? NULL : resolve_stream(stream, &rc);
	if (!rc && (kind < 0 || kind > 4)) rc = E_VALUE;
	if (!rc) rc = hold_wait(s);
	if (rc || !count) return leave(rc);
	if (s->device != tl_device) g_count[C_CROSS]++;
	uint64_t d = (uint64_t)(uintptr_t)dst, sr = (uint64_t)(uintptr_t)src;
	size_t fail;
	int pageable;
	struct op *op;
	rc = build_copy(&d, &sr, &count, 1, &fail, &pageable, &op);
	return leave(rc ? rc : submit_copy(s, op, pageable));
}

static int batch(const uint64_t *dsts, const uint64_t *srcs, const size_t *sizes, size_t count,
		 const CUmemcpyAttributes *attrs, const size_t *attrsIdxs, size_t numAttrs,
		 size_t *failIdx, void *stream) {
	size_t fail = SIZE_MAX;
	int rc = enter(), pageable = 0;
	if (!rc && (!numAttrs || !attrs || !attrsIdxs || attrsIdxs[0] != 0 || !count || !dsts ||
		    !srcs || !sizes))
		rc = E_VALUE;
	for (size_t i = 0; !rc && i < numAttrs; i++)
		if (attrs[i].srcAccessOrder < 1 || attrs[i].srcAccessOrder > 3 ||
		    attrsIdxs[i] >= count || (i && attrsIdxs[i] <= attrsIdxs[i - 1]))
			rc = E_VALUE;
	struct stream *s = rc ? NULL : resolve_stream(stream, &rc);
	if (!rc) rc = hold_wait(s);
	if (!rc && s->device != tl_device) g_count[C_CROSS]++;
	struct op *op = NULL;
	if (!rc) rc = build_copy(dsts, srcs, sizes, count, &fail, &pageable, &op);
	if (!rc && g_fail_batch_mode == 1) {
		rc = g_fail_batch_code;
	} else if (!rc && g_fail_batch_mode >= 2 && count > g_fail_batch_index) {
		rc = g_fail_batch_code;
		fail = g_fail_batch_index;
		if (g_fail_batch_mode == 3) g_fail_batch_mode = 0;
	}
	if (rc) {
		if (op) op_free(op);
		g_count[C_BATCH_FAILED]++;
	} else {
		g_count[C_BATCH_OK]++;
		g_count[C_BATCH_COPIES] += (long)count;
		g_last_order = attrs[0].srcAccessOrder;
		rc = submit_copy(s, op, pageable);
	}
	if (failIdx) *failIdx = rc ? fail : SIZE_MAX;
	return leave_driver(rc);
}

int cuMemcpyBatchAsync(uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count,
		       CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
		       size_t *failIdx, void *stream) {
	return batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, stream);
}

int cuMemcpyBatchAsync_v2(uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count,
			  CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
			  void *stream) {
	return batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, NULL, stream);
}

/* ---- host registration ------------------------------------------------------------------- */

int cudaHostRegister(void *ptr, size_t size, unsigned int flags) {
	int rc = enter();
	if (!rc) {
		g_reg_waiting++;
		while (g_reg_closed) wait_cond();
		g_reg_waiting--;
		wake_all();
		rc = g_sticky;
	}
	if (!rc && g_fail_reg_n > 0 && --g_fail_reg_n == 0) rc = g_fail_reg_code;
	if (!rc && (!ptr || !size || flags > 15)) rc = E_VALUE;
	uint64_t a = (uint64_t)(uintptr_t)ptr;
	for (size_t i = 0; !rc && i < g_regs.n; i++)
		if (overlaps(&g_regs.v[i], a, size)) rc = E_REGISTERED;
	struct range r = {.start = a, .len = size, .device = -1, .flags = flags};
	if (!rc && ranges_push(&g_regs, r)) rc = E_MEMORY;
	if (!rc) {
		g_count[C_REGISTERS]++;
		r.device = tl_device;
		ranges_push(&g_reg_log, r);
	}
	return leave(rc);
}

int cudaHostUnregister(void *ptr) {
	int rc = enter();
	if (!rc) rc = ptr ? E_NOT_REGISTERED : E_VALUE;
	for (size_t i = 0; rc == E_NOT_REGISTERED && i < g_regs.n; i++)
		if (g_regs.v[i].start == (uint64_t)(uintptr_t)ptr) {
			struct range gone = g_regs.v[i];
			gone.device = tl_device;
			ranges_push(&g_unreg_log, gone);
			g_regs.v[i] = g_regs.v[--g_regs.n];
			rc = E_OK;
		}
	return leave(rc);
}

int cudaHostGetDevicePointer(void **pDevice, void *pHost, unsigned int flags) {
	int rc = enter();
	if (!rc) rc = E_VALUE;
	uint64_t a = (uint64_t)(uintptr_t)pHost;
	for (size_t i = 0; rc == E_VALUE && pDevice && !flags && i < g_regs.n; i++)
		if (contains(&g_regs.v[i], a) && (g_regs.v[i].flags & HOST_REGISTER_MAPPED)) {
			*pDevice = (void *)(uintptr_t)(g_uva ? a : a + ALIAS_OFFSET);
			rc = E_OK;
		}
	return leave(rc);
}

/* ---- test controls ----------------------------------------------------------------------- */

int fakecuda_launch_copy(void *stream, const int64_t *table, size_t num_blocks,
			 const int64_t *refs, size_t num_refs, int to_device) {
	int rc = enter();
	struct stream *s = rc ? NULL : resolve_stream(stream, &rc);
	/* A kernel launch, unlike a copy, must target a stream of the current device. */
	if (s && s->device != tl_device) rc = E_HANDLE;
	struct op *op = rc ? NULL : op_new(OP_KERNEL);
	if (!rc && !op) rc = E_MEMORY;
	if (rc) return leave(rc);
	op->table = (uint64_t)(uintptr_t)table;
	op->refs = (uint64_t)(uintptr_t)refs;
	op->nblocks = num_blocks;
	op->nrefs = num_refs;
	op->to_device = to_device;
	g_count[C_KERNELS]++;
	enqueue(s, op);
	return leave(E_OK);
}

int fakecuda_reset(int devices) {
	if (devices < 1 || devices > MAX_DEVICES) return E_VALUE;
	pthread_mutex_lock(&g_lock);
	/* Draining makes stream threads drop their ops and leave gates and waits, so every
	 * stream can be joined whatever state the previous test left it in. */
	g_draining = 1;
	g_reg_closed = 0;
	wake_all();
	while (g_streams.n) stream_retire(g_streams.v[--g_streams.n]);
	for (int d = 0; d < MAX_DEVICES; d++) {
		struct stream *s = g_default[d];
		g_default[d] = NULL;
		if (s) stream_retire(s);
	}
	while (g_events.n) event_unref(g_events.v[--g_events.n]);
	while (g_gates) gate_remove(g_gates);
	while (g_reg_waiting || g_holding) wait_cond();
	g_devmem.n = g_regs.n = g_reg_log.n = g_unreg_log.n = 0;
	g_drop_copy_n = g_corrupt_copy_n = 0;
	memset(g_count, 0, sizeof g_count);
	g_fail_memcpy_n = g_fail_reg_n = 0;
	g_fail_memcpy_code = g_fail_reg_code = g_fail_batch_mode = g_fail_batch_code = 0;
	g_fail_batch_index = 0;
	g_sticky = g_touched = g_last_order = 0;
	g_uva = 1;
	g_ndev = devices;
	g_draining = 0;
	/* Other threads keep their own device and error, as they would across CUDA calls. */
	tl_device = tl_error = 0;
	pthread_mutex_unlock(&g_lock);
	return E_OK;
}

int fakecuda_add_device_memory(int device, uint64_t ptr, size_t len) {
	int rc = E_OK, same = 0;
	pthread_mutex_lock(&g_lock);
	if (!valid_device(device) || !ptr || !len || ptr + len < ptr) rc = E_VALUE;
	for (size_t i = 0; !rc && !same && i < g_devmem.n; i++) {
		const struct range *r = &g_devmem.v[i];
		/* Declaring the same range twice is harmless (two views of one storage). */
		same = r->start == ptr && r->len == len && r->device == device;
		if (!same && overlaps(r, ptr, len)) rc = E_VALUE;
	}
	struct range added = {.start = ptr, .len = len, .device = device};
	if (!rc && !same && ranges_push(&g_devmem, added)) rc = E_MEMORY;
	pthread_mutex_unlock(&g_lock);
	return rc;
}

int fakecuda_remove_device_memory(uint64_t ptr) {
	int rc = E_VALUE;
	pthread_mutex_lock(&g_lock);
	for (size_t i = 0; rc && i < g_devmem.n; i++)
		if (g_devmem.v[i].start == ptr) {
			g_devmem.v[i] = g_devmem.v[--g_devmem.n];
			rc = E_OK;
		}
	pthread_mutex_unlock(&g_lock);
	return rc;
}

void fakecuda_fail_batch(int mode, size_t index, int code) {
	LOCKED(g_fail_batch_mode = mode; g_fail_batch_index = index; g_fail_batch_code = code);
}

void fakecuda_fail_memcpy(long nth, int code) {
	LOCKED(g_fail_memcpy_n = nth; g_fail_memcpy_code = code);
}

void fakecuda_fail_register(long nth, int code) {
	LOCKED(g_fail_reg_n = nth; g_fail_reg_code = code);
}

uint64_t fakecuda_stream_gate(void *stream) {
	uint64_t id = 0;
	int rc = E_OK;
	pthread_mutex_lock(&g_lock);
	struct stream *s = resolve_stream(stream, &rc);
	struct op *op = s ? op_new(OP_GATE) : NULL;
	struct gate *g = op ? calloc(1, sizeof *g) : NULL;
	if (g) {
		g->id = id = g_next_gate++;
		g->next = g_gates;
		g_gates = op->gate = g;
		enqueue(s, op);
	} else {
		free(op);
	}
	pthread_mutex_unlock(&g_lock);
	return id;
}

static struct gate *find_gate(uint64_t id) {
	for (struct gate *g = g_gates; g; g = g->next)
		if (g->id == id) return g;
	return NULL;
}

/* Opens a gate once: E_VALUE for a gate unknown, already opened, or cleared by a reset. */
int fakecuda_gate_open(uint64_t id) {
	int rc = E_VALUE;
	pthread_mutex_lock(&g_lock);
	struct gate *g = find_gate(id);
	if (g && !g->open) {
		rc = E_OK;
		g->open = 1;
		if (g->passed) gate_remove(g);
	}
	wake_all();
	pthread_mutex_unlock(&g_lock);
	return rc;
}

/* 1 once the stream has reached the gate (it waits there, or dropped it), 0 before, -1 for a
 * gate unknown (never made, opened and passed, or cleared by a reset). */
int fakecuda_gate_reached(uint64_t id) {
	int v = -1;
	pthread_mutex_lock(&g_lock);
	struct gate *g = find_gate(id);
	if (g) v = g->reached || g->passed;
	pthread_mutex_unlock(&g_lock);
	return v;
}

int fakecuda_hold_memcpy(void *stream, int on) {
	int rc = E_OK;
	pthread_mutex_lock(&g_lock);
	struct stream *s = resolve_stream(stream, &rc);
	if (s) s->hold = on != 0;
	wake_all();
	pthread_mutex_unlock(&g_lock);
	return rc;
}

void fakecuda_register_gate(int closed) { LOCKED(g_reg_closed = closed != 0; wake_all()); }
void fakecuda_fault(int code) { LOCKED(g_sticky = code; wake_all()); }
void fakecuda_set_uva(int on) { LOCKED(g_uva = on != 0); }

int fakecuda_holding(void) { int v; LOCKED(v = g_holding); return v; }
int fakecuda_registers_waiting(void) { int v; LOCKED(v = g_reg_waiting); return v; }
int fakecuda_waiting(void) { int v; LOCKED(v = g_waiting); return v; }
int fakecuda_sticky(void) { int v; LOCKED(v = g_sticky); return v; }
int fakecuda_last_batch_order(void) { int v; LOCKED(v = g_last_order); return v; }
uint64_t fakecuda_touched_devices(void) { uint64_t v; LOCKED(v = g_touched); return v; }
/* Explicitly created streams still alive: lets a test check the engine destroys its own. */
int fakecuda_live_streams(void) { int v; LOCKED(v = (int)g_streams.n); return v; }

long fakecuda_count(const char *name) {
	long v = -1;
	pthread_mutex_lock(&g_lock);
	for (int i = 0; name && i < C_COUNT; i++)
		if (!strcmp(name, counter_names[i])) v = g_count[i];
	pthread_mutex_unlock(&g_lock);
	return v;
}

/* A live created stream, or a default stream already made; touches nothing. */
static struct stream *peek_stream(void *stream) {
	uint64_t v = (uint64_t)(uintptr_t)stream;
	if (v <= 2) return valid_device(tl_device) ? g_default[tl_device] : NULL;
	for (size_t i = 0; i < g_streams.n; i++) {
		struct stream *s = g_streams.v[i];
		if (s->handle == v) return s;
	}
	return NULL;
}

/* Ops enqueued on a stream and not executed (or dropped) yet; -1 for an unknown handle.
 * Unlike cudaStreamQuery it answers under a sticky fault, and touches nothing. */
long fakecuda_stream_pending(void *stream) {
	long v = -1;
	pthread_mutex_lock(&g_lock);
	struct stream *s = peek_stream(stream);
	if (s) v = (long)(s->enqueued - s->executed);
	else if ((uint64_t)(uintptr_t)stream <= 2) v = 0; /* a default stream not made yet */
	pthread_mutex_unlock(&g_lock);
	return v;
}

/* 1 while the stream's thread sits at a gate or at a wait for an event, 0 otherwise, -1 for
 * an unknown handle. */
int fakecuda_stream_blocked(void *stream) {
	int v = -1;
	pthread_mutex_lock(&g_lock);
	struct stream *s = peek_stream(stream);
	if (s) v = s->blocked;
	pthread_mutex_unlock(&g_lock);
	return v;
}

/* The device of a live created stream, -1 for any other handle. Touches nothing. */
int fakecuda_stream_device(void *stream) {
	int d = -1;
	uint64_t v = (uint64_t)(uintptr_t)stream;
	pthread_mutex_lock(&g_lock);
	for (size_t i = 0; v > 2 && i < g_streams.n; i++) {
		const struct stream *s = g_streams.v[i];
		if (s->handle == v) d = s->device;
	}
	pthread_mutex_unlock(&g_lock);
	return d;
}

/* ---- injected copy misbehaviour and the registration log --------------------------------- */

void fakecuda_drop_copy(long nth) { LOCKED(g_drop_copy_n = nth); }
void fakecuda_corrupt_copy(long nth) { LOCKED(g_corrupt_copy_n = nth); }

/* Entry `i` of the registration (`unregistered` = 0) or unregistration log: start, length,
 * flags and the calling thread's device; 1 when there is no such entry. */
int fakecuda_registration(int unregistered, size_t i, uint64_t *start, uint64_t *len,
			  unsigned *flags, int *device) {
	int rc = 1;
	pthread_mutex_lock(&g_lock);
	struct ranges *log = unregistered ? &g_unreg_log : &g_reg_log;
	if (i < log->n) {
		*start = log->v[i].start;
		*len = log->v[i].len;
		*flags = log->v[i].flags;
		*device = log->v[i].device;
		rc = 0;
	}
	pthread_mutex_unlock(&g_lock);
	return rc;
}

/* Forgets every device range overlapping [ptr, ptr + len): host memory the test freed and
 * reallocated is a new allocation, whatever it was declared as before. Returns how many. */
int fakecuda_forget_device_memory(uint64_t ptr, size_t len) {
	int n = 0;
	pthread_mutex_lock(&g_lock);
	for (size_t i = 0; i < g_devmem.n;)
		if (overlaps(&g_devmem.v[i], ptr, len)) {
			g_devmem.v[i] = g_devmem.v[--g_devmem.n];
			n++;
		} else {
			i++;
		}
	pthread_mutex_unlock(&g_lock);
	return n;
}
