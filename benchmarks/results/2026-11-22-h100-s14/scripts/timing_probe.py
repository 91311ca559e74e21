"""bench attn's timing (time_calls) of the general path and SDPA-flash at B4 S4096 H32/8 D128 causal,
with the spread of the per-call times and the SM clock sampled by nvidia-smi meanwhile."""
import statistics, subprocess, time
import torch
from barqtrain.bench.attention import AttentionCase, case_inputs, implementations, run_forward_backward
from barqtrain.bench import timing

case = AttentionCase(4, 4096, 32, 8, 128, True)
inputs = case_inputs(case, torch.device("cuda"))
impls = implementations()
orig = timing._timed_batch
for name in ["barqtrain-general", "sdpa-flash", "barqtrain-general", "sdpa-flash-det", "barqtrain-hopper"]:
    fn = impls[name]
    seen = []
    def batch(run, it, host_ms, calls, seen=seen):
        out = orig(run, it, host_ms, calls)
        seen.extend(out)
        return out
    timing._timed_batch = batch
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    t = timing.time_calls(lambda b: run_forward_backward(fn, case, b), [inputs])
    smi.terminate()
    samples = [line.split(",") for line in smi.stdout.read().splitlines() if "," in line]
    clocks = [float(s[0]) for s in samples]; power = [float(s[1]) for s in samples]
    print(f"{name:18s} median {t.gpu_ms:.2f} ms ({3.5 * case.forward_flops / t.gpu_ms / 1e9:.0f} TFLOP/s) host {t.host_ms:.2f} ms "
          f"calls {len(seen)} min {min(seen):.2f} max {max(seen):.2f} | SM MHz {min(clocks):.0f}-{max(clocks):.0f} "
          f"median {statistics.median(clocks):.0f}, W median {statistics.median(power):.0f} max {max(power):.0f}", flush=True)
    time.sleep(2)
