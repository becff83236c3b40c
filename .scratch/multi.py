"""Lockstep of several configs: plain vs hsx variants (env per child). Ratios to plain per round."""
import os, sys, time, json
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import bench_extract as b
from pathlib import Path
import numpy as np

def patched_runner(*a, **k):
    if os.environ.get("HSX_SWITCH"):
        sys.setswitchinterval(float(os.environ["HSX_SWITCH"]))
    if os.environ.get("HSX_NOWRITE"):
        import hsx.extract as ex
        def append(self, samples, states):
            self._written_tokens += sum(x.num_tokens for x in samples)
        def finish(self):
            return {}
        ex.ChunkWriter.append = append
        ex.ChunkWriter.finish = finish
    return orig(*a, **k)
orig = b.hsx_runner
b.hsx_runner = patched_runner

if __name__ == "__main__":
    b.__file__ = __file__
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        b.main(); sys.exit()
    from hsx.sample_data import write_jsonl
    data = write_jsonl(Path(".scratch/x10.jsonl"), 3000, seed=0)
    model = Path("models/tiny-llama")
    variants = json.loads(sys.argv[1])  # {"name": {"ENV": "v"}, ...}; "plain" is the baseline
    children = {}
    base_env = dict(os.environ)
    for name, env in variants.items():
        os.environ.clear(); os.environ.update(base_env); os.environ.update(env)
        if name == "plain":
            children[name] = b.Child("serve-plain", str(model), str(data), "bfloat16")
        else:
            children[name] = b.Child("serve-hsx", str(model), str(data), "bfloat16", f".scratch/{name}.zarr")
    names = list(children)
    rates = {n: [] for n in names}
    rounds = int(os.environ.get("ROUNDS", "6"))
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        if (r // len(names)) % 2: order = order[::-1]
        for n in order:
            time.sleep(float(os.environ.get("PAUSE", "1")))
            rates[n].append(children[n].one_pass()["tokens_per_s"])
        print(f"round {r}: " + ", ".join(f"{n} {rates[n][-1]:,.0f}" for n in names), flush=True)
    for c in children.values(): c.close()
    for n in names:
        if n == "plain": continue
        ratios = np.array(rates[n]) / np.array(rates["plain"])
        print(f"{n}: median ratio {np.median(ratios):.3f} mean {ratios.mean():.3f} (range {ratios.min():.3f}-{ratios.max():.3f}); sum ratio {sum(rates[n])/sum(rates['plain']):.3f}")
