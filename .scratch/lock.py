import os, sys
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import bench_extract as b
from pathlib import Path
orig = b.hsx_runner
def patched(*a, **k):
    if os.environ.get("HSX_SWITCH"):
        sys.setswitchinterval(float(os.environ["HSX_SWITCH"]))
    return orig(*a, **k)
b.hsx_runner = patched
import time
_op = b.Child.one_pass
def one_pass(self):
    time.sleep(float(os.environ.get("PAUSE", "0")))
    return _op(self)
b.Child.one_pass = one_pass
if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        b.__file__ = __file__
        sys.argv = [sys.argv[0]] + sys.argv[1:]
        b.main()
    else:
        b.__file__ = __file__
        from hsx.sample_data import write_jsonl
        data = write_jsonl(Path(".scratch/x10.jsonl"), 3000, seed=0)
        b.bench_throughput(Path("models/tiny-llama"), data, "bfloat16", int(os.environ.get("ROUNDS", "4")), Path(".scratch"))
