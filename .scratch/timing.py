import sys, time, os, collections
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]="0"
acc = collections.defaultdict(float)
def wrap(cls, name, label):
    orig = getattr(cls, name)
    def f(*a, **k):
        t = time.perf_counter()
        try: return orig(*a, **k)
        finally: acc[label] += time.perf_counter() - t
    setattr(cls, name, f)
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.core.sched.scheduler import Scheduler
wrap(LLMEngine, "step", "llm_step")
wrap(EngineCore, "step", "core_step")
wrap(Scheduler, "schedule", "schedule")
wrap(Scheduler, "update_from_output", "update_from_output")
wrap(GPUModelRunner, "execute_model", "execute_model")
wrap(GPUModelRunner, "_model_forward", "model_forward")
wrap(GPUModelRunner, "sample_tokens", "sample_tokens")
wrap(GPUModelRunner, "propose_draft_token_ids", "propose")
wrap(GPUModelRunner, "_sample", "_sample")
wrap(GPUModelRunner, "_prepare_inputs", "prepare_inputs")
try:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
except Exception: pass
import hsx.engine.connector as C
wrap(C.HsxHiddenStatesConnector, "wait_for_save", "conn_wait_for_save")
wrap(C.HsxHiddenStatesConnector, "build_connector_meta", "conn_build_meta")
import bench_extract as b
from pathlib import Path
from hsx.sample_data import write_jsonl
kind = sys.argv[1]
data = write_jsonl(Path(".scratch/x10.jsonl"), 3000, seed=0)
model = Path("models/tiny-llama")
run = b.hsx_runner(model, data, "bfloat16", ".scratch/p.zarr") if kind == "hsx" else b.plain_runner(model, data, "bfloat16")
for i in range(3):
    acc.clear()
    r = run()
    print(kind, f"{r['seconds']:.2f}s {r['tokens_per_s']:.0f} tok/s", " ".join(f"{k}={v:.3f}" for k, v in sorted(acc.items())), flush=True)
