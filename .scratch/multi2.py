"""Lockstep of several configs with per-component timings."""
import os, sys, time, json, collections
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import bench_extract as b
from pathlib import Path
import numpy as np

acc = collections.defaultdict(float)
def install_timing():
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]="0"
    def wrap(cls, name, label):
        orig = getattr(cls, name)
        def f(*a, **k):
            t = time.perf_counter()
            try: return orig(*a, **k)
            finally: acc[label] += time.perf_counter() - t
        setattr(cls, name, f)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.core.sched.scheduler import Scheduler
    wrap(LLMEngine, "step", "llm_step")
    wrap(LLMEngine, "add_request", "add_request")
    wrap(Scheduler, "schedule", "schedule")
    wrap(Scheduler, "update_from_output", "update")
    wrap(GPUModelRunner, "_model_forward", "forward")
    wrap(GPUModelRunner, "sample_tokens", "sample_tokens")
    wrap(GPUModelRunner, "propose_draft_token_ids", "propose")
    wrap(GPUModelRunner, "_prepare_inputs", "prepare")
    if os.environ.get("KIND") == "hsx":
        import hsx.engine.connector as C
        wrap(C.HsxHiddenStatesConnector, "wait_for_save", "conn_save")
        import hsx.engine.vllm_engine as E
        wrap(E.VllmHiddenStateEngine, "_take", "take")

def timed(runner):
    def make(*a, **k):
        install_timing()
        if os.environ.get("HSX_NOGC"):
            import gc; gc.disable()
        if os.environ.get("HSX_GCLOG"):
            import gc
            gstats = {"n": 0, "t": 0.0, "t0": 0.0}
            def cb(phase, info):
                if info["generation"] != 2: return
                if phase == "start": gstats["t0"] = time.perf_counter()
                else: gstats["n"] += 1; acc["gc2"] += time.perf_counter() - gstats["t0"]
            gc.callbacks.append(cb)
        if os.environ.get("HSX_SWITCH"):
            sys.setswitchinterval(float(os.environ["HSX_SWITCH"]))
        one = runner(*a, **k)
        def run():
            acc.clear()
            r = one()
            r.update({k: round(v, 3) for k, v in acc.items()})
            return r
        return run
    return make
b.hsx_runner = timed(b.hsx_runner)
b.plain_runner = timed(b.plain_runner)

if __name__ == "__main__":
    b.__file__ = __file__
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        b.main(); sys.exit()
    from hsx.sample_data import write_jsonl
    data = write_jsonl(Path(".scratch/x10.jsonl"), 3000, seed=0)
    if os.environ.get("CHAT"):
        data = write_jsonl(Path(".scratch/chat.jsonl"), 400, seed=0, chat_lengths=True)
    model = Path("models/tiny-llama")
    variants = json.loads(sys.argv[1])
    children = {}
    base_env = dict(os.environ)
    for name, env in variants.items():
        os.environ.clear(); os.environ.update(base_env); os.environ.update(env)
        if name == "plain":
            os.environ["KIND"] = "plain"
            children[name] = b.Child("serve-plain", str(model), str(data), "bfloat16")
        else:
            os.environ["KIND"] = "hsx"
            children[name] = b.Child("serve-hsx", str(model), str(data), "bfloat16", f".scratch/{name}.zarr")
    names = list(children)
    res = {n: [] for n in names}
    rounds = int(os.environ.get("ROUNDS", "6"))
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        if (r // len(names)) % 2: order = order[::-1]
        for n in order:
            time.sleep(float(os.environ.get("PAUSE", "1")))
            res[n].append(children[n].one_pass())
        print(f"round {r}: " + ", ".join(f"{n} {res[n][-1]['tokens_per_s']:,.0f}" for n in names), flush=True)
    for c in children.values(): c.close()
    keys = ["gc2", "seconds", "llm_step", "add_request", "take", "forward", "sample_tokens", "propose", "conn_save", "prepare", "schedule", "update", "cpu_seconds"]
    for n in names:
        print(n, " ".join(f"{k}={np.median([x.get(k, 0) for x in res[n]]):.3f}" for k in keys))
    for n in names:
        if n == "plain": continue
        ratios = np.array([x["tokens_per_s"] for x in res[n]]) / np.array([x["tokens_per_s"] for x in res["plain"]])
        print(f"{n}: median ratio {np.median(ratios):.3f} (range {ratios.min():.3f}-{ratios.max():.3f})")
