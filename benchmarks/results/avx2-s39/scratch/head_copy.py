"""SmolLM2's head: the float32 packed product against the top-exact operator with this CPU's half-size copy: argmax
and its value on real hidden states and on random rows, logits recomputed per row, and ms at 1-12 rows (15
alternating calls, medians): ``python head_copy.py``."""

import statistics
import time

import torch

from hf_tidar.checkpoints import load_smollm2
from hf_tidar.cpu.kernel import packed_row_kernel
from hf_tidar.cpu.top_exact_head import _row_norms_rounded_up, half_size_head

torch.set_num_threads(2)
op, pack, name = half_size_head()
print("copy", name)
ar, tokenizer = load_smollm2(quiet=True)
weight = ar.get_output_embeddings().weight.detach().contiguous()
copy, norms, watched = pack(weight), _row_norms_rounded_up(weight), torch.tensor([], dtype=torch.long)
pack_float32, multiply = packed_row_kernel()
packed = pack_float32(weight)
N, K = weight.shape
text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
with torch.no_grad():
    hidden = ar.model(tokenizer(text, return_tensors="pt")["input_ids"]).last_hidden_state[0]
for rows in (hidden, torch.randn(64, K) * 3):
    rows = rows.contiguous()
    got, exact = op(rows, copy, weight, norms, watched), multiply(rows, packed, N, None, None, None, rows.shape[0])
    best = exact.argmax(-1)
    print("argmax equal", bool((got.argmax(-1) == best).all()),
          "value at the argmax equal", bool((got.gather(1, best[:, None]) == exact.gather(1, best[:, None])).all()),
          "exact logits a row (median)", (got == exact).sum(-1).float().median().item())
for M in (1, 2, 4, 9, 12):
    x = hidden[:M].contiguous()
    seconds = {"float32": [], name: []}
    for _ in range(15):
        start = time.perf_counter()
        multiply(x, packed, N, None, None, None, M)
        seconds["float32"].append(time.perf_counter() - start)
        start = time.perf_counter()
        op(x, copy, weight, norms, watched)
        seconds[name].append(time.perf_counter() - start)
    print(M, {k: round(statistics.median(v) * 1e3, 2) for k, v in seconds.items()}, "ms")
