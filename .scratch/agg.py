import collections,sys,re
inc=collections.Counter(); total=0
keys = sys.argv[2:]
for line in open(sys.argv[1]):
    stack, n = line.rsplit(" ",1); n=int(n)
    frames = stack.split(";")
    if "driver" not in frames[0] and "MainThread" not in frames[0]: continue
    if any("load_model" in f or "LLM.__init__" in f or "__init__ (vllm/entrypoints/llm.py" in f for f in frames): continue
    if not any(("step (" in f) or ("_run_engine" in f) for f in frames): continue
    total+=n
    seen=set()
    for f in frames:
        name=re.sub(r":\d+\)", ")", f)
        if name in seen: continue
        seen.add(name); inc[name]+=n
print("total", total)
for k,n in inc.most_common(70): print(f"{n/total*100:5.1f}%  {k[:150]}")
