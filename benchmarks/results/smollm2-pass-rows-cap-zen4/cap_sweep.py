"""k2-both tokens/s and tokens/pass with MAX_PASS_ROWS 6 / 8 / 10 / 12, interleaved, 22 held-out prompts."""
import time, torch, statistics
from hf_tidar import cpu
from hf_tidar.assets import SHIPPED_ADAPTER
from hf_tidar.bench.prompts import load_prompt_set, encode
from hf_tidar.checkpoints import load_smollm2
from hf_tidar.generation import branch_decoder
from hf_tidar.training.gated_lora import load_tidar_adapter
torch.set_num_threads(2)
ar, tok = load_smollm2(quiet=True)
model = load_tidar_adapter(ar, SHIPPED_ADAPTER, tokenizer=tok, lean=True).eval()
cpu.enable(model)
prompts = [torch.tensor([encode(tok, p)]) for p in load_prompt_set("code") + load_prompt_set("chat")]
def run(cap):
    branch_decoder.MAX_PASS_ROWS = cap
    toks = passes = 0; t = time.perf_counter()
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False, strategy="tidar",
                                 draft_length=2, draft_source="both", return_dict_in_generate=True)
        toks += out.sequences.shape[1] - ids.shape[1]; passes += int(out.forward_passes.sum())
    return toks / (time.perf_counter() - t), toks / passes
run(8)
res = {c: [] for c in (6, 8, 10, 12)}
for rep in range(3):
    for c in (res if rep % 2 == 0 else list(res)[::-1]):
        res[c].append(run(c))
for c, v in res.items():
    print(c, "tok/s", [round(x[0], 1) for x in v], "median", round(statistics.median(x[0] for x in v), 1), "tok/pass", round(v[0][1], 3))
