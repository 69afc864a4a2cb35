/* fakecuda: stream threads, the copy kernel and copies (see fakecuda.h). */
#include "fakecuda.h"

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

struct stream *stream_new(int device) {
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
void stream_retire(struct stream *s) {
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
struct stream *resolve_stream(void *h, int *rc) {
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
int hold_wait(struct stream *s) {
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
int wait_executed(struct stream *s, uint64_t seq) {
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
int build_copy(const uint64_t *dst, const uint64_t *src, const size_t *len, size_t n,
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
int submit_copy(struct stream *s, struct op *op, int pageable) {
	enqueue(s, op);
	if (!pageable) return E_OK;
	g_count[C_PAGEABLE] += pageable;
	return wait_executed(s, s->enqueued);
}
