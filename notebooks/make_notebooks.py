"""Writes the example notebooks (sources kept here, in plain Python, so they diff well).

    python notebooks/make_notebooks.py      # rewrites notebooks/*.ipynb (outputs empty)

The test suite executes every notebook (tests/test_notebooks.py).
"""

from pathlib import Path

import nbformat as nbf

HERE = Path(__file__).parent

NOTEBOOKS = {
    "01_moe_forward.ipynb": [
        ("md", "# 01 - `moe_forward` on a real layer\n\nLoad one MoE layer of a checkpoint "
               "saved by Hugging Face transformers (a tiny random Qwen2-MoE shipped with the "
               "tests), route tokens, look at the expert load, and run the layer."),
        ("code", """\
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import atlas_jax as aj

root = Path.cwd() if (Path.cwd() / "tests").is_dir() else Path.cwd().parent
path = root / "tests" / "fixtures" / "moe" / "qwen2_moe_norm"
params = aj.checkpoint.load_moe_layer(path, 0)
cfg = params.config
print(cfg.num_experts, "experts, top", cfg.top_k, "| shared expert:", cfg.shared_intermediate_size)"""),
        ("code", """\
x = jax.random.normal(jax.random.key(0), (512, cfg.hidden_size))
r = aj.moe.route(params, x)
load = np.bincount(np.asarray(r.expert_ids).ravel(), minlength=cfg.num_experts)
plt.bar(range(cfg.num_experts), load)
plt.xlabel("expert"); plt.ylabel("tokens routed"); plt.title("expert load, 512 random tokens")
plt.savefig("/tmp/atlas_expert_load.png")
print(load, "total", load.sum(), "= 512 x", cfg.top_k)"""),
        ("code", """\
y_prefill = jax.jit(aj.moe_forward, static_argnames="kernels")(
    params, x, kernels=aj.KernelConfig(moe_path="prefill"))
y_decode = aj.moe_forward(params, x[:4], kernels=aj.KernelConfig(moe_path="decode"))
print(y_prefill.shape, float(jnp.abs(y_decode - y_prefill[:4]).max()))"""),
    ],
    "02_weight_formats.ipynb": [
        ("md", "# 02 - Weight formats\n\nQuantize one expert stack to every format, dequantize "
               "it, and compare the error and the bytes."),
        ("code", """\
import jax, jax.numpy as jnp, numpy as np
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from atlas_jax import quant

w = jax.random.normal(jax.random.key(0), (4, 256, 512)) / 512**0.5   # [E, N, K]
rows = []
for fmt in quant.Format:
    q = quant.quantize(w, fmt)
    err = float(jnp.linalg.norm(quant.dequantize(q) - w) / jnp.linalg.norm(w))
    rows.append((fmt.value, err, q.nbytes / w.size))
    print(f"{fmt.value:10s} rel. error {err:.4f}  bytes/weight {q.nbytes / w.size:.3f}")"""),
        ("code", """\
names, errs, bpw = zip(*rows)
fig, ax = plt.subplots(1, 2, figsize=(8, 3))
ax[0].bar(names, errs); ax[0].set_yscale("log"); ax[0].set_title("relative error")
ax[1].bar(names, bpw); ax[1].set_title("bytes per weight")
fig.savefig("/tmp/atlas_formats.png")"""),
        ("md", "FP8 layers run weight-only by default (the dequantized weights times bf16 "
               "activations, as transformers' `dequantize=True`). W8A8 quantizes the "
               "activations too, to e4m3 per token per 128 of K (transformers' FP8 layers on "
               "a GPU do this); on a GPU the decode kernels then multiply e4m3 by e4m3."),
        ("code", """\
import dataclasses
import atlas_jax as aj

cfg = aj.MoEConfig(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2,
                   expert_format="fp8_block")
params = aj.moe.init_params(jax.random.key(1), cfg, dtype=jnp.bfloat16)
x = jax.random.normal(jax.random.key(2), (4, 256), jnp.bfloat16)
w8a16 = aj.moe_forward(params, x)
w8a8_cfg = dataclasses.replace(cfg, gate_up_act_quant="fp8", down_act_quant="fp8")
w8a8 = aj.moe_forward(dataclasses.replace(params, config=w8a8_cfg), x)
diff = jnp.linalg.norm((w8a8 - w8a16).astype(jnp.float32)) / jnp.linalg.norm(
    w8a16.astype(jnp.float32))
print(f"W8A8 vs weight-only FP8: rel. difference {float(diff):.3f}")"""),
    ],
    "03_paged_decode.ipynb": [
        ("md", "# 03 - Paged decode\n\nA Qwen3-style attention layer over a paged KV cache: "
               "scattered pages, chunked prefill, then token-by-token decode, with timings."),
        ("code", """\
import time
import jax, jax.numpy as jnp, numpy as np
import atlas_jax as aj

cfg = aj.AttentionConfig(hidden_size=128, num_heads=8, num_kv_heads=2, head_dim=16)
params = aj.attention.init_params(jax.random.key(0), cfg, dtype=jnp.float32)
cache = aj.PagedKVCache.create(num_pages=16, page_size=4, cfg=cfg, dtype=aj.KVDtype.FP8)
tables = jnp.array([[3, 9, 1, 12, 6], [0, 14, 7, 2, 10]], jnp.int32)  # scattered pages
x = jax.random.normal(jax.random.key(1), (2, 12, 128))"""),
        ("code", """\
prefill = jax.jit(aj.attention.prefill)
y1, cache = prefill(params, x[:, :8], cache, tables, jnp.array([0, 0]))      # chunk 1
y2, cache = prefill(params, x[:, 8:], cache, tables, jnp.array([8, 8]))      # chunk 2
fresh = aj.PagedKVCache.create(16, 4, cfg, dtype=aj.KVDtype.FP8)
y_all, _ = prefill(params, x, fresh, tables, jnp.array([0, 0]))
print("chunked == one-shot:", float(jnp.abs(jnp.concatenate([y1, y2], 1) - y_all).max()))"""),
        ("code", """\
decode = jax.jit(aj.attention.decode)
seq = jnp.array([12, 12])
times = []
for step in range(4):
    tok = jax.random.normal(jax.random.key(10 + step), (2, 1, 128))
    seq = seq + 1
    t0 = time.perf_counter()
    y, cache = decode(params, tok, cache, tables, seq)
    y.block_until_ready()
    times.append(time.perf_counter() - t0)
print("decode step times (first includes compilation):", [f"{t*1e3:.1f} ms" for t in times])"""),
    ],
}


def main() -> None:
    for name, cells in NOTEBOOKS.items():
        nb = nbf.v4.new_notebook()
        nb.cells = [nbf.v4.new_markdown_cell(src) if kind == "md" else nbf.v4.new_code_cell(src)
                    for kind, src in cells]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nbf.write(nb, HERE / name)


if __name__ == "__main__":
    main()
