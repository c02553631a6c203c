"""The prediction side of benchmarks/lowrank_scaling.py: each measured point priced by the cost
model (workbench.lowrank.dp_scaling), in sample and, beyond 2 ranks, out of sample; the table
and the verdict."""

from __future__ import annotations

from typing import Any, Dict, List

MICRO_BATCH = 2  # sequences per rank and step
MODEL = ["model=gpt_small", "model.seq_len=128", "data.max_bytes=1000000", "tracking=none",
         "layout=ddp", "train.eval_every=100000", "train.eval_batches=1",
         "train.ckpt_every=100000", "train.warmup_steps=2"]


def predict_all(out: Dict[str, Any], modes: List[str], worlds: List[int],
                rate_mbit: float) -> List[Dict[str, Any]]:
    from workbench.compose import compose
    from workbench.lowrank.dp_scaling import collectives, model_shape
    from workbench.lowrank.dp_scaling import powersgd_hook_s as hook_model

    model = compose(MODEL).model
    out["hook_model_s"] = hook_model(model_shape(model, None), out["host_copy_bytes_per_s"])
    rows = []
    for m in modes:
        for n in worlds:
            p = out["points"][f"{m}/{n}"]
            pr = _prediction(out, model, m, n, rate_mbit, p.get("free_cores", out["cores"]))
            tok = MICRO_BATCH * n * model.seq_len
            oos = {}
            smaller = [w for w in worlds if 1 < w < n]
            if 2 in smaller:  # out of sample: the cores the largest smaller run had, not n's
                below = out["points"][f"{m}/{max(smaller)}"]
                step_s = _prediction(out, model, m, n, rate_mbit,
                                     below.get("free_cores", out["cores"])).step_s
                oos = {"oos_pred_step_s": step_s, "oos_pred_tokens_per_s": tok / step_s}
            rows.append({"mode": m, "world": n, "step_s": p["step_s"],
                         "collective_s": out.get("collective_s", {}).get(str(n)),
                         "hook_s": out.get("powersgd_hook_s", 0.0),
                         "tokens_per_s": tok / p["step_s"], "bytes": p["bytes"],
                         "pred_bytes": pr.payload_bytes if n > 1 else 0.0,
                         "pred_step_s": pr.step_s, "pred_tokens_per_s": tok / pr.step_s,
                         "pred_efficiency": pr.efficiency,
                         "collectives": p.get("collectives", 0.0),
                         "pred_collectives": collectives(pr.payload_bytes, kind(m))
                         if n > 1 else 0,
                         "free_cores": p.get("free_cores", out["cores"]), **oos})
    one = {r["mode"]: r["tokens_per_s"] for r in rows if r["world"] == 1}
    for r in rows:
        r["efficiency"] = r["tokens_per_s"] / (r["world"] * one[r["mode"]])
        for pred, err in (("pred", "error"), ("oos_pred", "oos_error")):
            if f"{pred}_tokens_per_s" in r:
                r[f"{err}_pct"] = 100 * (r[f"{pred}_tokens_per_s"] / r["tokens_per_s"] - 1)
    return rows


def kind(mode: str) -> str:
    """The cost model's name for a benchmark mode (adaptive and fixed both train low rank)."""
    return {"adaptive": "lowrank", "fixed": "lowrank"}.get(mode, mode)


def report(rows: List[Dict[str, Any]], out: Dict[str, Any], rate_mbit: float,
           verdict: bool = True) -> bool:
    """The table and, unless `verdict` is off (a smoke test), the PASS/FAIL lines; whether
    every check passed."""
    print(f"\n{'mode':<9} {'N':>2} {'free':>4} {'MB/step':>8} {'pred MB':>8} {'s/step':>7} "
          f"{'tokens/s':>9} {'eff':>5} {'coll':>4} | {'coll':>4} {'pred s':>7} "
          f"{'pred tok/s':>10} {'pred eff':>8} {'err':>6}")
    for r in rows:
        print(f"{r['mode']:<9} {r['world']:>2} {r['free_cores']:>4.2f} {r['bytes'] / 1e6:>8.2f} "
              f"{r['pred_bytes'] / 1e6:>8.2f} {r['step_s']:>7.3f} {r['tokens_per_s']:>9.0f} "
              f"{r['efficiency']:>5.2f} {r['collectives']:>4.0f} | "
              f"{r['pred_collectives']:>4.0f} {r['pred_step_s']:>7.3f} "
              f"{r['pred_tokens_per_s']:>10.0f} {r['pred_efficiency']:>8.2f} "
              f"{r['error_pct']:>+5.0f}%")
    oos = [r for r in rows if "oos_error_pct" in r]
    if oos:
        print("\nfrom 1-2 ranks (out of sample: the cores the 2-rank run had, the link's own "
              "4 KB all-reduce at N ranks measured before the run, nothing of the N-rank run):")
    for r in oos:
        print(f"{r['mode']:<9} {r['world']:>2} ranks: predicted {r['oos_pred_tokens_per_s']:.0f} "
              f"tokens/s from 1-2 ranks, measured {r['tokens_per_s']:.0f} "
              f"({r['oos_error_pct']:+.0f}%); with the cores of the {r['world']}-rank run "
              f"itself {r['pred_tokens_per_s']:.0f} ({r['error_pct']:+.0f}%)")
    scored = [r["oos_error_pct"] if "oos_error_pct" in r else r["error_pct"] for r in rows]
    ok = all(abs(e) <= 20 for e in scored)
    print(f"\none-thread memory bandwidth (copy, read + write): "
          f"{out['host_copy_bytes_per_s'] / 1e9:.1f} GB/s; PowerSGD hook measured "
          f"{out.get('powersgd_hook_s', 0.0):.3f} s/step (the hook model at that bandwidth: "
          f"{out.get('hook_model_s', 0.0):.3f}); cores: {out['cores']}")
    print("collectives per step (coll) measured by the engine's counter and in the model; "
          "a 4 KB all-reduce over the link, measured: " + ", ".join(
              f"{1e3 * v:.2f} ms at {k} ranks" for k, v in out.get("collective_s", {}).items()))
    for n, c in out.get("link_counters", {}).items():
        print(f"link at world {n}: tbf sent {c['sent_bytes'] / 1e9:.2f} GB, dropped "
              f"{c['dropped']} packets; TCP retransmitted {c['retrans_segs']} segments, "
              f"{c['timeouts']} timeouts")
    print("link probe (one TCP stream, payload): "
          + ", ".join(f"{v:.0f} Mbit/s at tc rate {k}" for k, v in out["probe_mbit"].items()))
    by = {(r["mode"], r["world"]): r for r in rows}
    for m in ("adaptive", "fixed", "powersgd"):
        for n in (2, 4):
            if (m, n) in by and ("off", n) in by:
                print(f"{m} vs full rank at world {n}: "
                      f"{by[m, n]['tokens_per_s'] / by['off', n]['tokens_per_s']:.2f}x tokens/s, "
                      f"{by[m, n]['bytes'] / by['off', n]['bytes']:.3f}x bytes")
    rc = out.get("rate_check")
    if rc and ("off", 2) in by:
        slow = by["off", 2]["step_s"]
        responds = rc["step_s"] < 0.85 * slow
        ok = ok and responds
        print(f"{'PASS' if responds else 'FAIL'}  full rank at world 2: {slow:.3f} s/step at "
              f"{rate_mbit:g} Mbit/s, {rc['step_s']:.3f} s/step at {rc['rate_mbit']:g} Mbit/s "
              f"(the step follows the tc rate)")
    largest = max(abs(e) for e in scored)
    if not verdict:
        print(f"(--quick: a smoke test, no verdict; largest error {largest:.0f}%)")
        return True
    print(f"{'PASS' if ok else 'FAIL'}  predicted tokens/s within 20% of measured "
          f"(largest error {largest:.0f}%{'; beyond 2 ranks from 1-2 ranks' if oos else ''})")
    return ok


def _prediction(out: Dict[str, Any], model: Any, mode: str, n: int, rate_mbit: float,
                cores: float) -> Any:
    """The cost model's step of `mode` at `n` ranks from the run's one-rank step, hook time
    and link latency at n, given the cores the n ranks are taken to have."""
    from workbench.lowrank.dp_scaling import cpu_prediction

    one = out["points"][f"{mode}/1"]
    return cpu_prediction(model, mode, one["step_s"], n, rate_mbit, cores,
                          out.get("powersgd_hook_s", 0.0), one.get("free_cores", out["cores"]),
                          one.get("step_samples", ()), out.get("collective_s", {}).get(str(n)))
