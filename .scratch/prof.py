import sys, time
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import bench_extract as b
from pathlib import Path
from hsx.sample_data import write_jsonl
kind = sys.argv[1]
data = write_jsonl(Path(".scratch/x10.jsonl"), 3000, seed=0)
model = Path("models/tiny-llama")
if kind == "hsx":
    run = b.hsx_runner(model, data, "bfloat16", ".scratch/p.zarr")
else:
    run = b.plain_runner(model, data, "bfloat16")
print("READY", flush=True)
for i in range(int(sys.argv[2])):
    r = run(); print(kind, r, flush=True)
