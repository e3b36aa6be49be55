"""ggml-cpu's barrier between ops (patch 2): a thread that waits long at it sleeps instead of
spinning, so that a parked thread of the pool costs its own share of a shared machine and no more.

The graph is a chain of custom ops in which thread 1 sleeps for 30 ms at every op while thread 0
has nothing to do: thread 0 waits at each op's barrier. Its own CPU time from one op to the next
(time.thread_time() in the op) is what that wait burns: spinning, most of the 30 ms (libgomp's
barrier spins for its spin count, about 3.6 ms per wait on the development machine, ggml's own
without a bound); sleeping, the bounded spin and yields, at most 0.2 ms. A thread's CPU time does
not count time spent waiting for a core, so this holds on a loaded machine.
"""
from __future__ import annotations

import ctypes as C
import time

from pyturbo.ggml import InitParams, ggml

N_OPS = 8
SLEEP_S = 0.030  # thread 1's share of each op
MAX_WAIT_CPU_S = 0.001  # thread 0's CPU per op: its callback and the bounded wait (spin, yields)

CUSTOM1 = C.CFUNCTYPE(None, C.c_void_p, C.c_void_p, C.c_int, C.c_int, C.c_void_p)


def test_a_waiting_thread_sleeps_at_the_barrier():
    g = ggml()
    b, cpu = g.base, g.cpu
    b.ggml_map_custom1.restype = C.c_void_p
    b.ggml_map_custom1.argtypes = [C.c_void_p, C.c_void_p, CUSTOM1, C.c_int, C.c_void_p]
    seen: list[tuple[int, int, float]] = []

    def op(dst, a, ith, nth, userdata):
        seen.append((ith, nth, time.thread_time()))
        if ith == 1:
            time.sleep(SLEEP_S)

    fn = CUSTOM1(op)
    ctx = b.ggml_init(InitParams(16 << 20, None, False))
    try:
        x = b.ggml_new_tensor_4d(ctx, 0, 4, 1, 1, 1)  # GGML_TYPE_F32
        for _ in range(N_OPS):
            x = b.ggml_map_custom1(ctx, x, fn, -1, None)  # GGML_N_TASKS_MAX: every thread
        gf = b.ggml_new_graph(ctx)
        b.ggml_build_forward_expand(gf, x)
        assert cpu.ggml_graph_compute_with_ctx(ctx, gf, 2) == 0
    finally:
        b.ggml_free(ctx)
    assert sorted({(i, n) for i, n, _ in seen}) == [(0, 2), (1, 2)] and len(seen) == 2 * N_OPS, \
        "both threads run every op"
    t0 = [t for i, _, t in seen if i == 0]
    waits = [b - a for a, b in zip(t0, t0[1:])]  # thread 0's CPU from one op to the next
    assert max(waits) < MAX_WAIT_CPU_S, f"thread 0 spun at the barrier: {[round(w * 1e3, 2) for w in waits]} ms CPU per op"
