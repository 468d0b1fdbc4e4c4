"""The paper's Transformer on 16 GPUs, parameter server: the rate where dist_sync is as slow as the
paper's baseline, then ps-scheduled there at two grains (what sweep --compare-paper does, at one GPU count)."""
import json, math, time
from bytescheduler_tools.sim.sweep import Sweep, effective_rate
from bytescheduler_tools.sim.paper import paper_profile, reported_seconds, reported_speedup

MiB = 1024 ** 2
sweep = Sweep(paper_profile("transformer-v100"), system="ps-scheduled", latency=5e-6)
out = {"gpus": 16, "reported_speedup": reported_speedup("transformer-v100", 16)}
t = time.time()
rate = effective_rate(sweep, 16, reported_seconds("transformer-v100", 16), low=1e8, high=2e10)
out["rate_bytes_per_s"] = rate
print("rate", rate * 8 / 1e9, "Gbit/s", time.time() - t, flush=True)
if not math.isnan(rate):
    out["framework_seconds"] = sweep.framework_seconds(16, rate)
    for grain in (1 * MiB, 4 * MiB):
        s = sweep.seconds(16, rate, grain, 64 * MiB)
        out[f"grain_{grain // MiB}MiB_credit_64MiB_seconds"] = s
        print(grain // MiB, "MiB", s, out["framework_seconds"] / s, time.time() - t, flush=True)
json.dump(out, open("paper-ps-transformer-16.json", "w"), indent=1)
print(out)
