import sys, time, os, collections
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]="0"
from vllm.v1.core.sched.scheduler import Scheduler
orig = Scheduler.schedule
log = []
def schedule(self, *a, **k):
    out = orig(self, *a, **k)
    log.append((time.perf_counter(), out.total_num_scheduled_tokens, len(out.num_scheduled_tokens)))
    return out
Scheduler.schedule = schedule
import bench_extract as b
from pathlib import Path
from hsx.sample_data import write_jsonl
kind = sys.argv[1]
data = write_jsonl(Path(".scratch/x10.jsonl"), 3000, seed=0)
model = Path("models/tiny-llama")
run = b.hsx_runner(model, data, "bfloat16", ".scratch/p.zarr") if kind == "hsx" else b.plain_runner(model, data, "bfloat16")
for i in range(2):
    log.clear()
    r = run()
    steps = [x for x in log if x[1] > 0]
    toks = [x[1] for x in steps]
    empty = len(log) - len(steps)
    dts = [b2[0]-a[0] for a,b2 in zip(log, log[1:])]
    print(kind, f"{r['tokens_per_s']:.0f} tok/s", "steps", len(steps), "empty", empty, "mean tokens", sum(toks)/len(toks), "min", min(toks), "reqs mean", sum(x[2] for x in steps)/len(steps), "max step gap ms", max(dts)*1000 if dts else 0, flush=True)
    print(sorted(collections.Counter(t//1024 for t in toks).items()))
