/* fakecuda: the controls and probes the tests call (see fakecuda.h). */
#include "fakecuda.h"

/* ---- test controls ----------------------------------------------------------------------- */

static const char *const counter_names[C_COUNT] = {
	"memcpy_calls",	   "pageable_copies",	 "batch_ok",	  "batch_failed",    "batch_copies",
	"kernel_launches", "cross_device_calls", "event_records", "streams_created", "registers",
};


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
