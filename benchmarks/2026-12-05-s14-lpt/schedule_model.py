"""A schedule model of W1's split-KV decode launches (no GPU needed): does launch order matter?

Each decode layer launches one program per (request, kv head, split). The block scheduler starts
programs in launch order on a fixed number of slots (132 SMs x 3 CTAs: the default tile's
occupancy, benchmarks/2026-12-05-s13-ptxas) and starts the next one when a slot frees. A
program's time is taken as proportional to the keys it reads (whole BLOCK_N tiles) plus a fixed
`c0` keys' worth of set-up. Every 8th decode step of W1 (the bench's own lengths: 256 requests,
prompts and outputs uniform in [100, 1024], seed 0) is modelled three ways:
  now:      grid (B, KH, splits), requests fastest (kernels/triton_attention.py default)
  lpt:      grid (KH, splits, B), requests longest context first (RANKSERVE_DECODE_LPT)
  worklist: segments of 256 / 512 / 1024 keys sorted longest first (a persistent work list;
            its partials and reduce not counted)
and compared with the ideal (all keys spread evenly over the slots, no set-up).
A model, not a measurement: it assumes programs run at a fixed speed, whatever runs beside them
(latency-bound, as the H200 profiles suggest: fp8 KV halves the bytes and W1 did not move).
Usage: python benchmarks/2026-12-05-s14-lpt/schedule_model.py
"""
import heapq

from rankserve.runtime.bench.common import WORKLOADS, make_workload

SMS, CTAS_PER_SM, KH, BLOCK_N, PPSM, MAX_SPLITS = 132, 3, 8, 128, 8, 64
SLOTS = SMS * CTAS_PER_SM


def makespan(durations):
    free = [0.0] * SLOTS
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def cost(keys, c0):
    return -(-keys // BLOCK_N) * BLOCK_N + c0 if keys > 0 else c0 / 4  # empty: early exit


def num_splits(B, max_context=40960):
    return max(1, min(-(-PPSM * SMS // (B * KH)), MAX_SPLITS, -(-max_context // BLOCK_N)))


def segments(ctx, S):
    seg = -(-(-(-ctx // S)) // BLOCK_N) * BLOCK_N
    return [max(0, min(seg, ctx - s * seg)) for s in range(S)]


def now(ctxs, c0):
    S = num_splits(len(ctxs))
    return makespan([cost(segments(c, S)[s], c0) for s in range(S) for _ in range(KH) for c in ctxs])


def lpt(ctxs, c0):
    S = num_splits(len(ctxs))
    return makespan([cost(k, c0) for c in sorted(ctxs, reverse=True) for k in segments(c, S)
                     for _ in range(KH)])


def worklist(ctxs, c0, seg):
    items = sorted((min(seg, c - i * seg) for c in ctxs for i in range(-(-c // seg))), reverse=True)
    return makespan([cost(k, c0) for k in items for _ in range(KH)])


def main():
    w = make_workload(**WORKLOADS["w1"], vocab_size=1000, seed=0)
    P, O = w.prompt_lens, w.output_lens
    for c0 in (32, 128):
        tot = dict(now=0.0, lpt=0.0, worklist=0.0, ideal=0.0)
        print(f"c0 = {c0} keys of set-up a program")
        print(f"{'step':>5} {'reqs':>5} {'splits':>6} {'now':>7} {'lpt':>7} {'worklist':>8}   (x ideal)")
        for t in range(0, max(O), 8):
            ctxs = [p + t for p, o in zip(P, O) if o > t]
            if not ctxs:
                break
            ideal = sum(ctxs) * KH / SLOTS
            r = dict(now=now(ctxs, c0), lpt=lpt(ctxs, c0),
                     worklist=min(worklist(ctxs, c0, s) for s in (256, 512, 1024)), ideal=ideal)
            for k in tot:
                tot[k] += r[k]
            if t % 128 == 0:
                print(f"{t:5d} {len(ctxs):5d} {num_splits(len(ctxs)):6d} {r['now'] / ideal:7.3f} "
                      f"{r['lpt'] / ideal:7.3f} {r['worklist'] / ideal:8.3f}")
        print(f"whole run: now {tot['now'] / tot['ideal']:.3f}, lpt {tot['lpt'] / tot['ideal']:.3f}, "
              f"worklist {tot['worklist'] / tot['ideal']:.3f} x ideal; lpt saves "
              f"{100 * (1 - tot['lpt'] / tot['now']):.1f} % of the decode attention time\n")


if __name__ == "__main__":
    main()
