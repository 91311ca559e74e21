"""barqtrain-general against sdpa-flash and sdpa-flash-det, per case, from a bench attn JSON."""
import json, sys
d = json.load(open(sys.argv[1]))
rows = {}
for r in d["results"]:
    rows.setdefault(r["case"], {})[r["implementation"]] = r
print(f"{'case':32s} {'gen fwd':>7s} {'fb':>5s} | {'flash fwd':>9s} {'fb':>5s} | fwd% fb% | det fb  det%")
for case, impls in rows.items():
    g, f, det = impls.get("barqtrain-general"), impls.get("sdpa-flash"), impls.get("sdpa-flash-det")
    if not g or not f or g.get("status") != "ok":
        continue
    gf, gb = g["forward_tflops"], g["forward_backward_tflops"]
    ff, fb = f["forward_tflops"], f["forward_backward_tflops"]
    db = det["forward_backward_tflops"] if det and det.get("status") == "ok" else float("nan")
    print(f"{case:32s} {gf:7.0f} {gb:5.0f} | {ff:9.0f} {fb:5.0f} | {100*gf/ff:4.0f} {100*gb/fb:4.0f} | {db:6.0f} {100*gb/db:4.0f}")
