"""LoRA linear r=16 as cuBLAS GEMMs three ways, bf16, H100: the frozen base alone, the composition
(base + x@A^T + addmm into y), and the K-concatenated form (y = [x | s x A^T] [W | B]^T in one
GEMM, x living in the first K columns of a wider buffer; dx = [dy | s dy B] [W ; A] likewise).
One storage Wbig [N + tail, K + tail] holds W, B (columns K:K+r) and A (rows N:N+r), zeros
beyond r, so both GEMMs read plain views; the tail is r or r padded to 64."""
import json, os, sys
import torch

dev, dt, r, s = "cuda", torch.bfloat16, 16, 2.0
# The K tail padded to a multiple of 64 (zeros beyond r): cuBLAS's K-tiling prefers it.
PADS = (r, 64)


def bench(f, iters=20):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        a.record()
        for _ in range(iters):
            f()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / iters)
    return sorted(ts)[2]


rows = []
for (M, K, N), tail in [(shape, t) for shape in [(8192, 4096, 14336), (8192, 4096, 4096), (8192, 14336, 4096)]
                        for t in PADS]:
    g = torch.Generator(device=dev).manual_seed(0)
    wbig = torch.zeros(N + tail, K + tail, device=dev, dtype=dt)
    wbig[:N + r, :K + r] = torch.randn(N + r, K + r, device=dev, dtype=dt, generator=g) * 0.02
    wbig[N:N + r, K:] = 0
    W, B, A = wbig[:N, :K], wbig[:N, K:K + r], wbig[N:N + r, :K]
    x_ext = torch.zeros(M, K + tail, device=dev, dtype=dt)
    x_ext[:, :K] = torch.randn(M, K, device=dev, dtype=dt, generator=g)
    x = x_ext[:, :K]
    dy_ext = torch.zeros(M, N + tail, device=dev, dtype=dt)
    dy_ext[:, :N] = torch.randn(M, N, device=dev, dtype=dt, generator=g)
    dy = dy_ext[:, :N]
    xc, dyc, Wc, Ac, Bc = x.contiguous(), dy.contiguous(), W.contiguous(), A.contiguous(), B.contiguous()

    base_f = bench(lambda: torch.mm(xc, Wc.t()))
    base_b = bench(lambda: torch.mm(dyc, Wc))

    def comp_fwd():
        y = torch.mm(xc, Wc.t())
        xa = torch.mm(xc, Ac.t())
        y.addmm_(xa, Bc.t(), alpha=s)
        return y, xa

    xa_saved = torch.mm(xc, Ac.t())

    def comp_bwd():
        dx = torch.mm(dyc, Wc)
        dyb = torch.mm(dyc, Bc)
        dx.addmm_(dyb, Ac, alpha=s)
        dA = torch.mm(dyb.t(), xc).mul_(s)
        dB = torch.mm(dyc.t(), xa_saved).mul_(s)
        return dx, dA, dB

    def concat_fwd():
        xa = torch.mm(x, A.t())
        x_ext[:, K:K + r] = xa * s
        return torch.mm(x_ext, wbig[:N].t()), xa

    def concat_bwd():
        dyb = torch.mm(dy, B)
        dy_ext[:, N:N + r] = dyb * s
        dx = torch.mm(dy_ext, wbig[:, :K])
        dA = torch.mm(dyb.t(), x).mul_(s)
        dB = torch.mm(dy.t(), xa_saved).mul_(s)
        return dx, dA, dB

    y_ref = comp_fwd()[0].float()
    y_cat = concat_fwd()[0].float()
    dx_ref = comp_bwd()[0].float()
    dx_cat = concat_bwd()[0].float()
    err_y = ((y_cat - y_ref).norm() / y_ref.norm()).item()
    err_dx = ((dx_cat - dx_ref).norm() / dx_ref.norm()).item()
    cf, cb = bench(comp_fwd), bench(comp_bwd)
    kf, kb = bench(concat_fwd), bench(concat_bwd)
    base = base_f + base_b
    row = dict(shape=f"{M}x{K}->{N}", rank=r, k_tail=tail, base_fwd_ms=base_f, base_bwd_ms=base_b,
               composition_fwd_ms=cf, composition_bwd_ms=cb, concat_fwd_ms=kf, concat_bwd_ms=kb,
               composition_vs_base=(cf + cb) / base, concat_vs_base=(kf + kb) / base,
               concat_fwd_vs_base=kf / base_f, concat_bwd_vs_base=kb / base_b,
               rel_err_y=err_y, rel_err_dx=err_dx)
    rows.append(row)
    print(f"{row['shape']} tail {tail}: base {base_f:.3f}+{base_b:.3f} ms; composition {cf:.3f}+{cb:.3f} "
          f"({row['composition_vs_base']:.3f}x); K-concat {kf:.3f}+{kb:.3f} ({row['concat_vs_base']:.3f}x; "
          f"fwd {row['concat_fwd_vs_base']:.3f}x bwd {row['concat_bwd_vs_base']:.3f}x); err y {err_y:.1e} dx {err_dx:.1e}")
out = os.environ.get("OUT")
if out:
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows),
              open(os.path.join(out, "lora_concat.json"), "w"), indent=1)
