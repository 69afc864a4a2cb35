/* fakecuda: the shared state, locking, API entry and exit, events, gates and ops (see
 * fakecuda.h). */
#include "fakecuda.h"

pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t g_cond = PTHREAD_COND_INITIALIZER;
int g_ndev = 1, g_sticky, g_draining, g_uva = 1;
int g_reg_closed, g_reg_waiting, g_holding, g_last_order;
/* Callers blocked in a synchronising call (stream or event synchronize, a pageable copy, a
 * stream destroy draining its work). */
int g_waiting;
uint64_t g_touched, g_next_handle = 1, g_next_gate = 1;
struct ptrs g_streams, g_events;
struct stream *g_default[MAX_DEVICES];
struct ranges g_devmem, g_regs;
struct gate *g_gates;
long g_count[C_COUNT];
long g_fail_memcpy_n, g_fail_reg_n;
int g_fail_memcpy_code, g_fail_reg_code, g_fail_batch_mode, g_fail_batch_code;
size_t g_fail_batch_index;
/* Copies (memcpy or batch entries, counted as executed) to drop or to corrupt. */
long g_drop_copy_n, g_corrupt_copy_n;
/* Every successful registration and unregistration, in order, for tests to inspect. */
struct ranges g_reg_log;
struct ranges g_unreg_log;
__thread int tl_device, tl_error;

void wait_cond(void) { pthread_cond_wait(&g_cond, &g_lock); }
void wake_all(void) { pthread_cond_broadcast(&g_cond); }

double now_s(void) {
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

int ptrs_push(struct ptrs *p, void *x) {
	if (grow((void **)&p->v, &p->cap, p->n, sizeof *p->v)) return -1;
	p->v[p->n++] = x;
	return 0;
}

void ptrs_remove(struct ptrs *p, void *x) {
	for (size_t i = 0; i < p->n; i++)
		if (p->v[i] == x) {
			p->v[i] = p->v[--p->n];
			return;
		}
}

int ranges_push(struct ranges *r, struct range x) {
	if (grow((void **)&r->v, &r->cap, r->n, sizeof *r->v)) return -1;
	r->v[r->n++] = x;
	return 0;
}

int contains(const struct range *r, uint64_t a) {
	return a >= r->start && a - r->start < r->len;
}

/* [a, a+n) inside [start, start+len), written so that no sum can overflow. */
int covers(uint64_t start, uint64_t len, uint64_t a, uint64_t n) {
	return a >= start && a - start <= len && n <= len - (a - start);
}

int overlaps(const struct range *r, uint64_t a, uint64_t n) {
	return a < r->start + r->len && r->start < a + n;
}

int valid_device(int d) { return d >= 0 && d < g_ndev; }

/* ---- entry and exit of API calls --------------------------------------------------------- */

/* Entry of every call that needs a context: marks the current device touched and answers
 * the sticky fault, if any. Takes the lock. */
int enter(void) {
	pthread_mutex_lock(&g_lock);
	if (valid_device(tl_device)) g_touched |= 1ull << tl_device;
	return g_sticky;
}

/* Entry of the calls CUDA answers without a context. */
int enter_quiet(void) {
	pthread_mutex_lock(&g_lock);
	return g_sticky;
}

/* Runtime calls record failures as the thread's last error; driver calls do not. As in
 * CUDA, "not ready" is an answer, not an error. */
int leave(int rc) {
	if (rc && rc != E_NOT_READY) tl_error = rc;
	pthread_mutex_unlock(&g_lock);
	return rc;
}

int leave_driver(int rc) {
	pthread_mutex_unlock(&g_lock);
	return rc;
}

/* ---- events, gates, ops ------------------------------------------------------------------ */

void event_unref(struct event *e) {
	if (--e->refs == 0) free(e);
}

struct event *find_event(void *h) {
	for (size_t i = 0; i < g_events.n; i++) {
		struct event *e = g_events.v[i];
		if (e->handle == (uint64_t)(uintptr_t)h) return e;
	}
	return NULL;
}

void gate_remove(struct gate *g) {
	for (struct gate **p = &g_gates; *p; p = &(*p)->next)
		if (*p == g) {
			*p = g->next;
			break;
		}
	free(g);
}

struct op *op_new(int kind) {
	struct op *op = calloc(1, sizeof *op);
	if (op) op->kind = kind;
	return op;
}

void op_free(struct op *op) {
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

void enqueue(struct stream *s, struct op *op) {
	if (s->tail) s->tail->next = op;
	else s->head = op;
	s->tail = op;
	s->enqueued++;
	wake_all();
}

int dropping(void) { return g_sticky || g_draining; }
