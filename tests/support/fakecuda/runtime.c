/* fakecuda: CUDA's runtime and driver entry points (see fakecuda.h). */
#include "fakecuda.h"

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
