#!/usr/bin/env python3
"""Per-configuration summary of a `spec-bench run` output folder (its runs.json), with a
speed-up that the machine's drift does not move.

Usage: scripts/summarize-runs.py DIR

For each configuration: the mean end-to-end speed-up against plain decoding of the same request
and repetition (spec-bench's `speedup`), by request kind; the lowest request (the mean of its
repetitions); the propose share (proposer seconds over run seconds); the mean accepted length;
greedy identity; the steps by draft length k; and the *step-priced* speed-up.

The step-priced speed-up prices every decoding step of a run at the median time of the steps
of the same configuration with the same k over the whole run (a step's time is its first
token's inter-token latency, proposing included), and plain decoding at the median step of a
`k = 0` configuration of the same run (so pass `--k 0,...`): `(tokens - 1) * plain step / sum of
the run's priced steps`. It keeps what a configuration decides (how many steps, of which k)
and drops when each step ran, so two runs of plain decoding price at 1.00 where their
wall-clock ratio spreads by several percent on a shared machine; the prefill (the first
token) is left out.
"""
import json
import statistics as st
import sys
from collections import defaultdict


def step_times(run):
    """(k, seconds) of each step after the first token's."""
    out = []
    for s in run["steps"]:
        p = s["position"]
        if p > 0:
            out.append((s["k"], run["itl_s"][p - 1]))
    return out


def main(folder):
    runs = json.load(open(f"{folder}/runs.json"))
    by_label = defaultdict(list)
    for r in runs:
        by_label[r["label"]].append(r)
    median = {}
    for label, rs in by_label.items():
        per_k = defaultdict(list)
        for r in rs:
            for k, t in step_times(r):
                per_k[k].append(t)
        median[label] = {k: st.median(v) for k, v in per_k.items()}
    plain = [median[lab][0] for lab in median if " k=0 " in lab + " " and 0 in median[lab]]
    plain_step = st.median(plain) if plain else None
    if plain_step:
        print(f"plain step (k = 0 configurations): {plain_step * 1000:.1f} ms")
    for label, rs in by_label.items():
        rs = [r for r in rs if r.get("speedup") is not None]
        if not rs:
            continue
        kinds, req, priced = defaultdict(list), defaultdict(list), defaultdict(list)
        steps_by_k = defaultdict(int)
        for r in rs:
            kinds[r["kind"]].append(r["speedup"])
            req[r["request"]].append(r["speedup"])
            for s in r["steps"]:
                steps_by_k[s["k"]] += 1
            cost = sum(median[label][k] for k, _ in step_times(r))
            if plain_step and cost > 0:
                priced[r["request"]].append((len(r["tokens"]) - 1) * plain_step / cost)
        share = sum(r["propose_s"] for r in rs) / sum(r["e2e_s"] for r in rs)
        identical = [r["greedy_identical"] for r in rs if r.get("greedy_identical") is not None]
        low = min((st.mean(v), q) for q, v in req.items())
        print(f"{label}")
        by_kind = " ".join(f"{k} {st.mean(v):.3f}" for k, v in sorted(kinds.items()))
        print(
            f"  speed-up {st.mean(r['speedup'] for r in rs):.3f} ({by_kind}); lowest request "
            f"{low[0]:.3f} (request {low[1]}); propose share {share * 100:.1f} %; mean acc. "
            f"len {st.mean(r['mean_accepted_length'] for r in rs):.2f}; greedy identical "
            f"{sum(identical)}/{len(identical)}; runs {len(rs)}"
        )
        if priced:
            all_priced = [x for v in priced.values() for x in v]
            plow = min((st.mean(v), q) for q, v in priced.items())
            print(
                f"  step-priced {st.mean(all_priced):.3f}, lowest request {plow[0]:.3f} "
                f"(request {plow[1]})"
            )
        ms = {k: round(v * 1000, 1) for k, v in sorted(median[label].items())}
        print(f"  steps by k {dict(sorted(steps_by_k.items()))}; median step ms by k {ms}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: scripts/summarize-runs.py DIR")
    main(sys.argv[1])
