"""Eight threads of mixed calls on one policy or manager, checked against a serial replay.

``tests/hostile/test_hostile_threads.py`` runs ``main(target, seed)`` in a fresh interpreter (a hang
or a crash then fails one test); ``python -m tests.support.threads_driver lru`` runs it by hand.

The calls are made as vLLM's scheduler would on a busy system, but with everything that makes
Python code run *inside* a call: keys are generators, request contexts are plain classes whose
methods kvcache must call (no fast path), ARC's key sets are set subclasses with their own
``__contains__``, and the switch interval is tiny. Those callbacks also release the GIL
(``time.sleep(0)``), so other threads try to enter the object while a call is under way.

Order of effect. Each mutating call is made through ``Recorder.run``: the thread takes a gate,
then calls; the first piece of Python code the call runs (a generator step, a context method:
the "hook") appends the call's id to the log and opens the gate for the next thread, while the
call goes on. A call that runs no Python code logs itself after it returns, still holding the
gate. Hooks run inside the object's serialised section, so the log is the order in which calls
entered the object, and at most one thread stands between the gate and the object at a time:
the log is exact, and a thread that finds the object busy (a call still inside, past its hook)
must wait. Read-only calls (``get``, ``lookup``, ``len`` ...) take no gate and may arrive at any
moment. Every context stays alive to the end, so no request state dies at a moment the garbage
collector chooses.

Checks: no call raised anything the serial replay of the log does not raise at the same call
(a ``KvCacheError`` that the replay also raises is an ordinary outcome, e.g. a load of a key
another thread evicted between the lookup and the load); each call's result equals the
replay's; the final state equals the replay's; ``validate()`` passes.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import kvcache

N_THREADS = 8
OPS_PER_THREAD = 150


def key(owner: int, i: int) -> bytes:
    """A 36-byte key (vLLM's block hash + group); owner 255 is shared by every thread."""
    return bytes([owner]) + i.to_bytes(3, "big") + bytes(28) + (0).to_bytes(4, "big")


SHARED = [key(255, i) for i in range(8)]


class Ctx:
    """A request context with vLLM's ``ReqContext`` methods as plain Python methods."""

    def __init__(self, cid: int, positions: dict[bytes, int], hook: Callable[[], None]) -> None:
        self.cid = cid
        self.positions = positions
        self.hook = hook
        self.state: dict[type, Any] = {}

    def get_state(self, cls: type) -> Any:
        self.hook()
        return self.state.get(cls)

    def set_state(self, value: Any) -> None:
        self.hook()
        self.state[type(value)] = value

    def get_offload_key_position(self, key: bytes) -> int | None:
        self.hook()
        return self.positions.get(key)


class HookSet(set):
    """ARC's key sets, with a ``__contains__`` that runs Python code."""

    def __init__(self, items: Any, hook: Callable[[], None]) -> None:
        super().__init__(items)
        self.hook = hook

    def __contains__(self, item: object) -> bool:
        self.hook()
        return set.__contains__(self, item)


def gen(items: list[Any], hook: Callable[[], None]) -> Iterator[Any]:
    for item in items:
        hook()
        yield item


def no_hook() -> None:
    pass


class Recorder:
    """The gate, the log, and the hook (see the module docs)."""

    def __init__(self) -> None:
        self.gate = threading.Lock()
        self.log: list[int] = []
        self.local = threading.local()
        self.inside = 0  # calls past their hook and not yet returned
        self.contended = 0  # calls that entered the gate while another call was inside
        self.counter = threading.Lock()

    def hook(self) -> None:
        op = getattr(self.local, "pending", None)
        if op is not None:
            self.local.pending = None
            self.local.hooked = True
            with self.counter:
                self.inside += 1
            self.log.append(op)
            self.gate.release()
        time.sleep(0)  # let other threads run, and try to enter, while this call is inside

    def run(self, op: int, call: Callable[[], Any]) -> Any:
        self.gate.acquire()
        with self.counter:
            if self.inside:
                self.contended += 1
        self.local.pending = op
        self.local.hooked = False
        try:
            return call()
        finally:
            if self.local.pending is not None:  # no Python code ran inside: log it now
                self.local.pending = None
                self.log.append(op)
                self.gate.release()
            elif self.local.hooked:
                with self.counter:
                    self.inside -= 1


# --- calls, shared by the threaded run and the replay -----------------------------------------


def result_of(value: Any) -> Any:
    """A JSON-comparable form of a call's result."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [result_of(v) for v in value]
    if isinstance(value, kvcache.ChunkStatus):
        return ["chunk", value.chunk_id]
    if hasattr(value, "keys_to_store"):
        return [
            result_of(list(value.keys_to_store)),
            np.asarray(value.store_spec.block_ids).tolist(),
            result_of(list(value.evicted_keys)),
        ]
    if hasattr(value, "block_ids"):
        return np.asarray(value.block_ids).tolist()
    if hasattr(value, "removed"):
        return [result_of(list(value.keys)), value.removed, value.metadata_only]
    return type(value).__name__


def call_policy(
    policy: Any, op: str, args: dict[str, Any], ctx: Any, hook: Callable[[], None]
) -> Any:
    if op == "insert":
        chunk = kvcache.ChunkStatus(args["chunk_id"])
        chunk.ref_cnt = 0
        return policy.insert(args["key"], chunk, ctx)
    if op == "touch":
        return policy.touch(gen(args["keys"], hook), ctx)
    if op == "miss":
        return policy.on_store_miss(gen(args["keys"], hook), ctx)
    if op == "access":
        return policy.on_request_access(gen(args["keys"], hook), ctx)
    if op == "finish":
        return policy.on_request_finished(
            gen(args["groups"], hook),
            HookSet(args["inserted"], hook),
            HookSet(args["reused"], hook),
            ctx,
        )
    if op == "evict":
        return policy.evict(args["n"], gen(args["protected"], hook))
    raise ValueError(op)


def call_manager(
    manager: Any, op: str, args: dict[str, Any], ctx: Any, hook: Callable[[], None]
) -> Any:
    if op == "new":
        return manager.on_new_request(ctx)
    if op == "store":
        return manager.prepare_store(gen(args["keys"], hook), ctx)
    if op == "complete_store":
        return manager.complete_store(gen(args["keys"], hook), ctx, args["success"])
    if op == "load":
        return manager.prepare_load(gen(args["keys"], hook), ctx)
    if op == "complete_load":
        return manager.complete_load(gen(args["keys"], hook), ctx)
    if op == "touch":
        return manager.touch(gen(args["keys"], hook), ctx)
    if op == "finish":
        return manager.on_request_finished(ctx)
    if op == "events":
        return manager.take_events()
    raise ValueError(op)


# --- threads ----------------------------------------------------------------------------------


class Run:
    """One threaded run: the object, the recorder, and everything each call was given."""

    def __init__(self, target: str, seed: int, serialise: bool) -> None:
        self.target = target
        self.seed = seed
        self.obj = Serialised(make(target)) if serialise else make(target)
        self.recorder = Recorder()
        self.ops: dict[int, tuple[str, dict[str, Any], int | None]] = {}
        self.results: dict[int, Any] = {}
        self.positions: dict[int, dict[bytes, int]] = {}
        self.contexts: list[Ctx] = []  # kept alive to the end
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def new_ctx(self, thread: int, rng: random.Random, keys: list[bytes]) -> Ctx:
        with self.lock:
            cid = len(self.contexts)
            order = rng.sample(keys, len(keys))
            self.positions[cid] = {k: 16 * (i + 1) for i, k in enumerate(order)}
            ctx = Ctx(cid, dict(self.positions[cid]), self.recorder.hook)
            self.contexts.append(ctx)
        return ctx

    def call(self, thread: int, step: int, op: str, args: dict[str, Any], ctx: Ctx | None) -> Any:
        op_id = thread * 100_000 + step
        self.ops[op_id] = (op, args, None if ctx is None else ctx.cid)
        do = call_policy if self.target.startswith("policy") else call_manager
        try:
            value = self.recorder.run(
                op_id, lambda: do(self.obj, op, args, ctx, self.recorder.hook)
            )
        except BaseException as exc:
            self.results[op_id] = ["error", type(exc).__name__]
            if not isinstance(exc, kvcache.KvCacheError) or type(exc).__name__ in (
                "ReentrantCallError",
            ):
                self.errors.append(f"{op}: {type(exc).__name__}: {exc}")
            return exc
        self.results[op_id] = result_of(value)
        return value

    def read(self, call: Callable[[], Any]) -> Any:
        """A read-only call, made without the gate (it must wait or run, never fail)."""
        try:
            return call()
        except BaseException as exc:
            self.errors.append(f"read: {type(exc).__name__}: {exc}")
            return exc

    # -- the two workloads --

    def policy_thread(self, t: int) -> None:
        rng = random.Random(self.seed * 1000 + t)
        own = [key(t, i) for i in range(16)]
        anyone = lambda: key(rng.randrange(N_THREADS), rng.randrange(16))  # noqa: E731
        p = self.obj
        ctx = None
        for step in range(OPS_PER_THREAD):
            if step % 12 == 0:
                ctx = self.new_ctx(t, rng, rng.sample(own + SHARED, 12))
            mix = [*rng.sample(own, 2), anyone(), rng.choice(SHARED)]
            rng.shuffle(mix)
            r = rng.random()
            if r < 0.3:
                k = rng.choice(own)
                if self.read(lambda k=k: k in p) is False:  # only this thread inserts k
                    self.call(t, step, "insert", {"key": k, "chunk_id": t * 10_000 + step}, ctx)
                    continue
                r = 0.35
            if r < 0.45:
                self.call(t, step, "touch", {"keys": mix}, ctx)
            elif r < 0.55:
                self.call(t, step, "miss", {"keys": mix}, ctx)
            elif r < 0.65:
                self.call(t, step, "access", {"keys": mix}, ctx)
            elif r < 0.8:
                groups = [mix[:2], mix[2:]]
                args = {"groups": groups, "inserted": set(mix[:1]), "reused": set(mix[1:3])}
                self.call(t, step, "finish", args, ctx)
            elif r < 0.9:
                args = {"n": rng.randint(1, 3), "protected": rng.sample(own, 3)}
                self.call(t, step, "evict", args, None)
            else:
                self.read(lambda mix=mix: (p.get(mix[0]), mix[1] in p, len(p)))

    def manager_thread(self, t: int) -> None:
        rng = random.Random(self.seed * 1000 + t)
        own = [key(t, i) for i in range(24)]
        m = self.obj
        ctx: Ctx | None = None
        pending: list[list[bytes]] = []
        pinned: list[list[bytes]] = []
        step = 0

        def call(op: str, args: dict[str, Any], c: Ctx | None = None) -> Any:
            nonlocal step
            step += 1
            return self.call(t, step, op, args, c)

        while step < OPS_PER_THREAD:
            if ctx is None or rng.random() < 0.1:
                if ctx is not None:
                    call("finish", {}, ctx)
                ctx = self.new_ctx(t, rng, own + SHARED)
                call("new", {}, ctx)
            r = rng.random()
            if r < 0.3:
                keys = rng.sample(own + SHARED[:2], rng.randint(1, 4))
                out = call("store", {"keys": keys}, ctx)
                stored = out is not None and not isinstance(out, BaseException)
                if stored and out.keys_to_store:
                    pending.append(list(out.keys_to_store))
            elif r < 0.45 and pending:
                args = {"keys": pending.pop(0), "success": rng.random() < 0.85}
                call("complete_store", args, ctx)
            elif r < 0.6:
                wanted = rng.sample(own, 4)
                hit = kvcache.LookupResult.HIT
                hits = [k for k in wanted if self.read(lambda k=k: m.lookup(k)) is hit]
                if hits:
                    spec = call("load", {"keys": hits}, ctx)
                    if not isinstance(spec, BaseException):
                        pinned.append(hits)
            elif r < 0.7 and pinned:
                call("complete_load", {"keys": pinned.pop(0)}, ctx)
            elif r < 0.8:
                call("touch", {"keys": rng.sample(own, 3)}, ctx)
            elif r < 0.85:
                call("events", {}, None)
            else:
                k = rng.choice(own)
                self.read(lambda k=k: (m.lookup(k), len(m), m.num_evictable, m.num_write_pending))
        for keys in pending:
            call("complete_store", {"keys": keys, "success": True}, ctx)
        for keys in pinned:
            call("complete_load", {"keys": keys}, ctx)
        call("finish", {}, ctx)

    def run_threads(self) -> None:
        work = self.policy_thread if self.target.startswith("policy") else self.manager_thread

        def guarded(t: int) -> None:
            try:
                work(t)
            except BaseException:
                self.errors.append(f"thread {t} died: {traceback.format_exc()}")

        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            threads = [threading.Thread(target=guarded, args=(t,)) for t in range(N_THREADS)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        finally:
            sys.setswitchinterval(old)

    # -- the replay --

    def replay(self) -> tuple[Any, dict[int, Any]]:
        obj = make(self.target)
        ctxs = {cid: Ctx(cid, dict(pos), no_hook) for cid, pos in self.positions.items()}
        self.replay_contexts = ctxs  # alive to the end, as in the threaded run
        do = call_policy if self.target.startswith("policy") else call_manager
        results = {}
        for op_id in self.recorder.log:
            op, args, cid = self.ops[op_id]
            try:
                value = do(obj, op, args, None if cid is None else ctxs[cid], no_hook)
            except BaseException as exc:
                results[op_id] = ["error", type(exc).__name__]
            else:
                results[op_id] = result_of(value)
        return obj, results


class Serialised:
    """An object behind one lock taken at every call's entry and released at its exit, in
    Python: what kvcache is to do itself. The harness's self-test runs on it, to show that a
    correctly serialised object passes every check."""

    def __init__(self, obj: Any) -> None:
        self.wrapped = obj
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        with self.lock:
            attr = getattr(self.wrapped, name)
        if not callable(attr):
            return attr

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                return attr(*args, **kwargs)

        return locked

    def __len__(self) -> int:
        with self.lock:
            return len(self.wrapped)

    def __contains__(self, item: object) -> bool:
        with self.lock:
            return item in self.wrapped


def make(target: str) -> Any:
    kind, policy = target.split("-")
    if kind == "policy":
        return kvcache.LRUCachePolicy(48) if policy == "lru" else kvcache.ARCCachePolicy(48)
    return kvcache.OffloadingManager(32, policy, enable_events=True)


def state(obj: Any) -> Any:
    obj = getattr(obj, "wrapped", obj)
    obj.validate()
    if isinstance(obj, kvcache.BaseCachePolicy):
        return [obj._debug_state(), len(obj)]
    return [
        obj._debug_state(),
        len(obj),
        obj.num_evictable,
        obj.num_write_pending,
        obj.num_requests,
        memoryview(obj.chunk_table()).tobytes(),
    ]


def main(target: str, seed: int = 0, serialise: bool = False) -> dict[str, Any]:
    """Runs the threads, replays the log, and reports (see the module docs). ``serialise``
    puts the object behind a Python lock (the harness's self-test)."""
    run = Run(target, seed, serialise)
    run.run_threads()
    report: dict[str, Any] = {
        "ops": len(run.ops),
        "logged": len(run.recorder.log),
        "contended": run.recorder.contended,
        "errors": run.errors[:20],
        "num_errors": len(run.errors),
        "raised": sum(1 for r in run.results.values() if r and r[0] == "error"),
    }
    try:
        final = state(run.obj)
        report["validate"] = "ok"
    except AssertionError as exc:
        final = None
        report["validate"] = str(exc)
    replayed, results = run.replay()
    report["state_matches"] = final is not None and final == state(replayed)
    report["result_mismatches"] = [
        [run.ops[i][0], run.results.get(i), results[i]]
        for i in run.recorder.log
        if run.results.get(i) != results[i]
    ][:10]
    report["unlogged"] = len(set(run.ops) - set(run.recorder.log))
    return report


if __name__ == "__main__":
    args = sys.argv[1:]
    serialise = "--serialise" in args
    args = [a for a in args if a != "--serialise"]
    target = args[0] if args else "policy-lru"
    seed = int(args[1]) if len(args) > 1 else 0
    print(json.dumps(main(target, seed, serialise), indent=1))
