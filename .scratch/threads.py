import sys, os, collections, time
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import bench_extract as b
from pathlib import Path
from hsx.sample_data import write_jsonl
import threading
def snap():
    names = {str(t.native_id): t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f: s = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f: name = f.read().strip()
        except FileNotFoundError: continue
        fields = s[s.rindex(")")+2:].split()
        out[tid] = (names.get(tid, name + tid[-0:0]).split('_')[0], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return out
kind = sys.argv[1]
data = write_jsonl(Path(".scratch/x10.jsonl"), 3000, seed=0)
model = Path("models/tiny-llama")
run = b.hsx_runner(model, data, "bfloat16", ".scratch/p.zarr") if kind == "hsx" else b.plain_runner(model, data, "bfloat16")
for i in range(3):
    a = snap(); r = run(); c = snap()
    per = collections.Counter()
    for tid, (name, t) in c.items():
        per[name] += t - a.get(tid, (name, 0))[1]
    print(kind, f"{r['seconds']:.2f}s cpu {r['cpu_seconds']:.2f}", " ".join(f"{n}={v:.2f}" for n, v in per.most_common(12) if v > 0), flush=True)
