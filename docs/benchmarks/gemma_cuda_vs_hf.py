"""Where Gemma 2 on CUDA parts from HF (docs/models.md): for tiny Gemma 2/3 models, greedy
tokens against HF's eager reference (graphs on and off), each decoder layer's and attention's output on one
prefill against HF with its default attention, and core's CUDA run against core's CPU run module by module. The HF side
runs with the checkpoint's default attention implementation, which is what exposed
transformers 5.17's SDPA path dropping Gemma 2's soft-cap. On the GPU machine:

    PYTHONPATH=. python3 docs/benchmarks/gemma_cuda_vs_hf.py        (PLAT=cpu runs it on the CPU)
"""
import json, os, sys, tempfile, pathlib, torch
PLAT = os.environ.get("PLAT", "cuda")
sys.path.insert(0, ".")
from core import LLM, SamplingParams
from tests.integration.test_engine_hf import hf_greedy, random_prompts, run
from tests.integration.test_models_hf import VOCAB, tiny_dir
from transformers import AutoModelForCausalLM

tmp = pathlib.Path(tempfile.mkdtemp())
for case in ["gemma2-capped", "gemma2-mqa-uncapped", "gemma3-local-global"]:
    path = tiny_dir(tmp, case, hidden_size=256, head_dim=64, query_pre_attn_scalar=48)
    prompts = random_prompts(6, VOCAB, seed=5, lo=5, hi=50)
    expected = hf_greedy(path, prompts, 16)
    for variant, kw in [("graphs", {}), ("eager", dict(enforce_eager=True))]:
        llm = LLM(model=str(path), platform=PLAT, dtype="float32", block_size=16, enable_prefix_caching=False, **kw)
        got = run(llm, prompts, max_new=16)
        same = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), 16) for g, e in zip(got, expected)]
        print(f"{case} {variant}: first difference per prompt {same}", flush=True)
        if variant == "eager":
            model = llm.engine.core.executor.runner.model
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            ours, theirs = {}, {}
            for i, layer in enumerate(model.model.layers):
                layer.register_forward_hook(lambda m, a, o, i=i: ours.__setitem__(i, (o[0] + o[1]).detach().float().cpu()))
                layer.self_attn.register_forward_hook(lambda m, a, o, i=i: ours.__setitem__(f"attn{i}", o.detach().float().cpu()))
            for i, layer in enumerate(hf.model.layers):
                layer.register_forward_hook(lambda m, a, o, i=i: theirs.__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0].detach().float()))
                layer.self_attn.register_forward_hook(lambda m, a, o, i=i: theirs.__setitem__(f"attn{i}", o[0][0].detach().float()))
            p = prompts[0]
            llm.generate([p], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            with torch.no_grad():
                hf(torch.tensor([p]))
            for key in theirs:
                a, b = ours[key], theirs[key]
                err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-9)
                rows = ((a - b).abs().amax(-1) > 1e-3 * b.abs().max()).nonzero().flatten().tolist()
                print(f"  {case} {key}: rel max err {err:.2e}; rows off {rows[:12]} of {len(p)}", flush=True)
        del llm
        torch.cuda.empty_cache() if PLAT == "cuda" else None

# core on CUDA against core on CPU, module by module (same weights, same prompt, eager)
def grab(llm, store):
    model = llm.engine.core.executor.runner.model
    for name, mod in model.named_modules():
        if name:
            def hook(m, a, o, name=name):
                t = o[0] if isinstance(o, tuple) else o
                if isinstance(t, torch.Tensor):
                    store.setdefault(name, t.detach().float().cpu().clone())
            mod.register_forward_hook(hook)

for case in ["gemma2-capped", "gemma2-mqa-uncapped"]:
    path = tiny_dir(tmp, case, hidden_size=256, head_dim=64, query_pre_attn_scalar=48)
    p = random_prompts(6, VOCAB, seed=5, lo=5, hi=50)[0]
    outs = {}
    for plat in ["cpu", PLAT]:
        llm = LLM(model=str(path), platform=plat, dtype="float32", block_size=16,
                  enable_prefix_caching=False, enforce_eager=True)
        outs[plat] = {}
        grab(llm, outs[plat])
        llm.generate([p], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        del llm
    for name, ref in outs["cpu"].items():
        got = outs[PLAT].get(name)
        if got is None or got.shape != ref.shape:
            print(f"  {case} {name}: shapes {None if got is None else tuple(got.shape)} vs {tuple(ref.shape)}")
            continue
        err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-9)
        print(f"  {case} cuda-vs-cpu {name}: rel max err {err:.2e}", flush=True)
