"""ggml-cpu's thread pool under CPU contention (patch 3): a thread that waits long at the barrier
between ops sleeps instead of spinning, and the CPU backend runs its graphs on fewer threads while
a thread of the pool waits for its core, so that a parked thread costs its own share of a shared
machine and no more.

The first test's graph is a chain of custom ops in which thread 1 sleeps for 30 ms at every op while thread 0
has nothing to do: thread 0 waits at each op's barrier. Its own CPU time from one op to the next
(time.thread_time() in the op) is what that wait burns: spinning, most of the 30 ms (libgomp's
barrier spins for its spin count, about 3.6 ms per wait on the development machine, ggml's own
without a bound); sleeping, the bounded spin and yields, at most 0.2 ms. A thread's CPU time does
not count time spent waiting for a core, so this holds on a loaded machine.
"""
from __future__ import annotations

import ctypes as C
import os
import time

import pytest

from pyturbo.bench.contention import BusyCore
from pyturbo.ggml import InitParams, ggml

N_OPS = 8
SLEEP_S = 0.030  # thread 1's share of each op
MAX_WAIT_CPU_S = 0.001  # thread 0's CPU per op: its callback and the bounded wait (spin, yields)

CUSTOM1 = C.CFUNCTYPE(None, C.c_void_p, C.c_void_p, C.c_int, C.c_int, C.c_void_p)


def chain(b, ctx, fn) -> int:  # the graph's address
    """A graph of N_OPS custom ops in a row, each run by every thread; returns the graph."""
    b.ggml_map_custom1.restype = C.c_void_p
    b.ggml_map_custom1.argtypes = [C.c_void_p, C.c_void_p, CUSTOM1, C.c_int, C.c_void_p]
    x = b.ggml_new_tensor_4d(ctx, 0, 4, 1, 1, 1)  # GGML_TYPE_F32
    for _ in range(N_OPS):
        x = b.ggml_map_custom1(ctx, x, fn, -1, None)  # GGML_N_TASKS_MAX: every thread
    gf = b.ggml_new_graph(ctx)
    b.ggml_build_forward_expand(gf, x)
    return gf


def test_a_waiting_thread_sleeps_at_the_barrier():
    g = ggml()
    b, cpu = g.base, g.cpu
    seen: list[tuple[int, int, float]] = []

    def op(dst, a, ith, nth, userdata):
        seen.append((ith, nth, time.thread_time()))
        if ith == 1:
            time.sleep(SLEEP_S)

    fn = CUSTOM1(op)
    ctx = b.ggml_init(InitParams(16 << 20, None, False))
    try:
        gf = chain(b, ctx, fn)
        assert cpu.ggml_graph_compute_with_ctx(ctx, gf, 2) == 0
    finally:
        b.ggml_free(ctx)
    assert sorted({(i, n) for i, n, _ in seen}) == [(0, 2), (1, 2)] and len(seen) == 2 * N_OPS, \
        "both threads run every op"
    t0 = [t for i, _, t in seen if i == 0]
    waits = [b - a for a, b in zip(t0, t0[1:])]  # thread 0's CPU from one op to the next
    assert max(waits) < MAX_WAIT_CPU_S, f"thread 0 spun at the barrier: {[round(w * 1e3, 2) for w in waits]} ms CPU per op"


def test_a_backend_whose_thread_waits_for_its_core_runs_on_fewer_threads_and_tries_them_all_again():
    """Thread 1 of a 2-thread CPU backend does each op's work on a core that a busy process also
    runs on, so the scheduler parks it for time slices. Within a few graphs the backend runs them
    on one thread; once a second (GGML_THREADS_FIT_PROBE_US) it runs one graph on both again, which
    keeps both when neither waited for its core. Without the fit, every graph ran on 2 threads."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: nothing to share")
    g = ggml()
    b, cpu = g.base, g.cpu
    vp = C.c_void_p
    cpu.ggml_backend_cpu_init.restype = vp
    cpu.ggml_backend_cpu_set_n_threads.argtypes = [vp, C.c_int]
    b.ggml_backend_graph_compute.restype = C.c_int
    b.ggml_backend_graph_compute.argtypes = [vp, vp]
    b.ggml_backend_free.argtypes = [vp]
    shared: list[int] = []  # the busy core, while thread 1 works on it
    seen: list[int] = []  # each graph's thread count, as its ops see it

    def op(dst, a, ith, nth, userdata):
        if ith == 0:
            seen.append(nth)
        if ith == 1 and shared:
            mask = os.sched_getaffinity(0)  # this thread's own (pid 0)
            os.sched_setaffinity(0, set(shared))
            try:
                end = time.thread_time() + 0.004  # 4 ms of its own CPU time, on the shared core
                while time.thread_time() < end:
                    pass
            finally:
                os.sched_setaffinity(0, mask)

    fn = CUSTOM1(op)
    ctx = b.ggml_init(InitParams(16 << 20, None, False))
    backend = cpu.ggml_backend_cpu_init()
    try:
        cpu.ggml_backend_cpu_set_n_threads(backend, 2)
        gf = chain(b, ctx, fn)

        def graph() -> int:
            n = len(seen)
            assert b.ggml_backend_graph_compute(backend, gf) == 0
            assert len(seen) == n + N_OPS
            return seen[-1]

        with BusyCore() as busy:
            shared.append(busy.cpu)
            counts = [graph() for _ in range(6)]
        shared.clear()
        assert counts[0] == 2, counts
        assert 1 in counts, f"every graph ran on 2 threads while thread 1 waited for its core: {counts}"
        assert counts[-1] == 1, counts
        time.sleep(1.1)
        assert graph() == 2, "no graph on every thread after a second"
    finally:
        b.ggml_backend_free(backend)
        b.ggml_free(ctx)
