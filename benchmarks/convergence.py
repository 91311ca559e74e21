"""Convergence study: BarqTrain LoRA/QLoRA against HF+PEFT's own run-to-run spread.

A measuring script, not part of the barqtrain package. It fine-tunes a small real checkpoint
(stories260K, a trained Llama in HF format) on real instruction data (LLaMA-Factory's
alpaca_en_demo) with LoRA r=8 in bf16 on the CPU, for several model families (the same weights
as Llama, Qwen2 with zero q/k/v biases, Mistral) and for QLoRA (NF4 base), and compares:

  hf           plain peft.get_peft_model: fp32 adapters, PEFT's fp32 LoRA arithmetic
  hf_autocast  the same under torch.autocast("cpu", torch.bfloat16)
  barq_mixed   barqtrain.get_peft_model(..., lora_precision="mixed") (the default)
  barq_peft    barqtrain.get_peft_model(..., lora_precision="peft")

Each variant runs with seeds 0, 1, 2; the seed sets the LoRA init and the dropout masks, the data
order is the same for every run. HF+PEFT's spread is the per-step min/max over its seeds of a
trailing moving average of the training loss, and the range of its final eval losses.

    python benchmarks/convergence.py --out benchmarks/results/convergence-cpu.json \
        --plot benchmarks/results/convergence-cpu.png

See docs/convergence.md for the results and how to read them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
MODEL_DIR = SHARED_DATA / "models" / "stories260K-hf"
DATA_FILE = SHARED_DATA / "instruct" / "llama-factory" / "alpaca_en_demo.json"

FAMILIES = ("llama", "qwen2", "mistral")
VARIANTS = ("hf", "hf_autocast", "barq_mixed", "barq_peft")
REFERENCE = "hf"  # the variant whose seeds give the spread

PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


@dataclass
class Settings:
    seq_len: int = 128
    batch_size: int = 8
    steps: int = 200
    eval_every: int = 50
    eval_fraction: float = 0.05
    eval_rows: int = 64  # cap on the held-out rows evaluated (CPU time)
    lr: float = 1e-3
    weight_decay: float = 0.0
    r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    data_seed: int = 1234
    smooth: int = 10  # trailing moving-average window for the spread envelope
    threads: int = 1
    model_dir: str = str(MODEL_DIR)
    data_file: str = str(DATA_FILE)


@dataclass(frozen=True)
class RunSpec:
    family: str  # llama | qwen2 | mistral
    variant: str  # one of VARIANTS
    seed: int
    quant: str | None = None  # None or "nf4"

    @property
    def group(self) -> str:
        return self.family + ("-qlora-" + self.quant if self.quant else "-lora")


@dataclass
class RunResult:
    spec: RunSpec
    losses: list[float]
    evals: dict[int, float]
    seconds: float
    lora_layers: int = 0
    quantized_layers: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- data


def load_examples(path: str) -> list[dict]:
    text = Path(path).read_text()
    if path.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def tokenize_example(tokenizer, example: dict) -> tuple[list[int], list[int]]:
    """input ids and labels of one example: BOS + prompt (masked with -100) + response + EOS."""
    template = PROMPT_WITH_INPUT if example.get("input") else PROMPT
    prompt = template.format(instruction=example["instruction"], input=example.get("input", ""))
    prompt_ids = tokenizer(prompt, add_special_tokens=True).input_ids  # BOS first
    response_ids = tokenizer(example["output"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return prompt_ids + response_ids, [-100] * len(prompt_ids) + response_ids


def pack(examples: list[tuple[list[int], list[int]]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the examples into one stream and cut it into rows of seq_len (the remainder is
    dropped): no padding. A row's first label is never predicted (the model shifts labels)."""
    ids = [t for e in examples for t in e[0]]
    labels = [t for e in examples for t in e[1]]
    rows = len(ids) // seq_len
    shape = (rows, seq_len)
    return (torch.tensor(ids[: rows * seq_len]).view(shape), torch.tensor(labels[: rows * seq_len]).view(shape))


def prepare_data(settings: Settings) -> dict:
    """Tokenized, packed train and held-out rows; the train rows in the (fixed) order of the run."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.model_dir)
    examples = load_examples(settings.data_file)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(settings.data_seed)).tolist()
    n_eval = max(1, round(settings.eval_fraction * len(examples)))
    eval_examples = [examples[i] for i in order[:n_eval]]
    train_examples = [examples[i] for i in order[n_eval:]]
    train_ids, train_labels = pack([tokenize_example(tokenizer, e) for e in train_examples], settings.seq_len)
    eval_ids, eval_labels = pack([tokenize_example(tokenizer, e) for e in eval_examples], settings.seq_len)
    needed = settings.steps * settings.batch_size
    if needed > train_ids.shape[0]:
        raise ValueError(f"{settings.steps} steps of {settings.batch_size} rows need {needed} rows; the data has {train_ids.shape[0]}")
    rows = torch.randperm(train_ids.shape[0], generator=torch.Generator().manual_seed(settings.data_seed + 1))
    return {
        "train_ids": train_ids[rows], "train_labels": train_labels[rows],
        "eval_ids": eval_ids[: settings.eval_rows], "eval_labels": eval_labels[: settings.eval_rows],
        "stats": {
            "examples": len(examples), "train_examples": len(train_examples), "eval_examples": len(eval_examples),
            "train_rows": int(train_ids.shape[0]), "eval_rows_total": int(eval_ids.shape[0]),
            "eval_rows_used": int(min(settings.eval_rows, eval_ids.shape[0])),
            "train_rows_used": needed,
            "train_loss_tokens_fraction": float((train_labels != -100).float().mean()),
        },
    }


# ---------------------------------------------------------------------------- models


def load_model(family: str, settings: Settings, dtype: torch.dtype = torch.bfloat16):
    """The stories260K weights as `family`: llama is the checkpoint itself; qwen2 and mistral are
    the same weights under those classes (Qwen2's q/k/v biases zero), computing the same function."""
    from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    llama = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=torch.float32)
    if family == "llama":
        model = llama
    else:
        c = llama.config
        common = dict(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
            max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
            rope_parameters=dict(c.rope_parameters), tie_word_embeddings=c.tie_word_embeddings,
            bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, attention_dropout=0.0,
        )
        if family == "qwen2":
            config = Qwen2Config(**common, use_sliding_window=False)
            cls = Qwen2ForCausalLM
        elif family == "mistral":
            config = MistralConfig(**common, sliding_window=None)
            cls = MistralForCausalLM
        else:
            raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
        torch.manual_seed(0)  # the (overwritten) random init
        model = cls(config).to(torch.float32)
        state = llama.state_dict()
        missing, unexpected = model.load_state_dict(state, strict=False)
        extra = [k for k in missing if not k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) and k != "lm_head.weight"]
        if extra or unexpected:
            raise RuntimeError(f"{family}: weights do not map: missing {extra}, unexpected {unexpected}")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_proj.bias"):
                    p.zero_()
        model.tie_weights()
    model.config.use_cache = False
    return model.to(dtype)


def conversion_check(settings: Settings, ids: torch.Tensor) -> dict:
    """Max |logits(family) - logits(llama)| in fp32 and in bf16 on a batch of real rows."""
    out = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            ref = load_model("llama", settings, dtype)(input_ids=ids).logits.float()
            for family in FAMILIES[1:]:
                got = load_model(family, settings, dtype)(input_ids=ids).logits.float()
                out[f"{family}_{str(dtype).removeprefix('torch.')}_max_abs_logit_diff"] = float((got - ref).abs().max())
            out[f"llama_{str(dtype).removeprefix('torch.')}_max_abs_logit"] = float(ref.abs().max())
    return out


def lora_config(settings: Settings):
    import peft

    return peft.LoraConfig(
        task_type="CAUSAL_LM", r=settings.r, lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout, target_modules="all-linear",
    )


def build(spec: RunSpec, settings: Settings):
    """The model of a run, with its LoRA adapters initialised from spec.seed."""
    import peft

    import barqtrain

    model = load_model(spec.family, settings)
    quantized = []
    if spec.quant:
        quantized = barqtrain.quant.quantize_model(model, spec.quant)
    torch.manual_seed(spec.seed)  # the LoRA init (and, below, the dropout masks)
    config = lora_config(settings)
    if spec.variant in ("hf", "hf_autocast"):
        model = peft.get_peft_model(model, config)
    elif spec.variant == "barq_mixed":
        model = barqtrain.get_peft_model(model, config, lora_precision="mixed")
    elif spec.variant == "barq_peft":
        model = barqtrain.get_peft_model(model, config, lora_precision="peft")
    else:
        raise ValueError(f"unknown variant {spec.variant!r}; one of {VARIANTS}")
    return model, quantized


# ---------------------------------------------------------------------------- training


def _autocast(spec: RunSpec):
    if spec.variant == "hf_autocast":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def evaluate(model, spec: RunSpec, data: dict, batch_size: int) -> float:
    """Mean loss per predicted token over the held-out rows, dropout off."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), _autocast(spec):
        for i in range(0, data["eval_ids"].shape[0], batch_size):
            ids, labels = data["eval_ids"][i : i + batch_size], data["eval_labels"][i : i + batch_size]
            n = int((labels[:, 1:] != -100).sum())
            total += float(model(input_ids=ids, labels=labels).loss) * n
            count += n
    model.train()
    return total / count


def train(spec: RunSpec, settings: Settings, data: dict) -> RunResult:
    """One run: `steps` AdamW steps on the fixed batch order; eval at 0, every eval_every steps
    and at the end."""
    torch.set_num_threads(settings.threads)
    start = time.perf_counter()
    model, quantized = build(spec, settings)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    torch.manual_seed(spec.seed)  # the dropout masks
    losses, evals = [], {0: evaluate(model, spec, data, settings.batch_size)}
    for step in range(settings.steps):
        rows = slice(step * settings.batch_size, (step + 1) * settings.batch_size)
        with _autocast(spec):
            loss = model(input_ids=data["train_ids"][rows], labels=data["train_labels"][rows]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"{spec}: loss {value} at step {step}")
        losses.append(value)
        done = step + 1
        if done % settings.eval_every == 0 or done == settings.steps:
            evals[done] = evaluate(model, spec, data, settings.batch_size)
    lora_layers = sum(1 for n, _ in model.named_modules() if n.endswith("lora_A"))
    return RunResult(spec, losses, evals, time.perf_counter() - start, lora_layers, quantized)


# ---------------------------------------------------------------------------- statistics


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first window-1 points average what there is)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def rel_diffs(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


def summarize(results: list[RunResult], settings: Settings) -> dict:
    """Per group (family, LoRA/QLoRA): HF+PEFT's spread over its seeds, and each other variant
    against it (same-seed differences, the fraction of steps inside the envelope, final eval)."""
    groups: dict[str, dict[str, dict[int, RunResult]]] = {}
    for r in results:
        groups.setdefault(r.spec.group, {}).setdefault(r.spec.variant, {})[r.spec.seed] = r
    summary = {}
    for group, variants in groups.items():
        if REFERENCE not in variants or len(variants[REFERENCE]) < 2:
            continue
        ref = variants[REFERENCE]
        seeds = sorted(ref)
        last = settings.steps
        sm = {s: smooth(ref[s].losses, settings.smooth) for s in seeds}
        lo = [min(v) for v in zip(*sm.values(), strict=True)]
        hi = [max(v) for v in zip(*sm.values(), strict=True)]
        mid = [sum(v) / len(v) for v in zip(*sm.values(), strict=True)]
        hf_evals = [ref[s].evals[last] for s in seeds]
        pair_raw, pair_sm = [], []
        for i, s in enumerate(seeds):
            for t in seeds[i + 1 :]:
                pair_raw.append(rel_diffs(ref[s].losses, ref[t].losses))
                pair_sm.append(rel_diffs(sm[s], sm[t]))
        spread = {
            "seeds": seeds,
            "envelope_rel_width_mean": sum((h - l) / m for h, l, m in zip(hi, lo, mid)) / last,
            "envelope_rel_width_max": max((h - l) / m for h, l, m in zip(hi, lo, mid)),
            "seed_pairs_raw_rel_diff_mean": sum(map(sum, pair_raw)) / sum(map(len, pair_raw)),
            "seed_pairs_raw_rel_diff_max": max(map(max, pair_raw)),
            "seed_pairs_smoothed_rel_diff_mean": sum(map(sum, pair_sm)) / sum(map(len, pair_sm)),
            "seed_pairs_smoothed_rel_diff_max": max(map(max, pair_sm)),
            "final_eval": dict(zip(map(str, seeds), hf_evals)),
            "final_eval_min": min(hf_evals),
            "final_eval_max": max(hf_evals),
            "final_eval_range": max(hf_evals) - min(hf_evals),
            "start_eval": ref[seeds[0]].evals[0],
            "first_train_loss_mean": sum(ref[s].losses[0] for s in seeds) / len(seeds),
            "last_smoothed_train_loss_mean": sum(sm[s][-1] for s in seeds) / len(seeds),
        }
        compared = {}
        for variant, runs in variants.items():
            if variant == REFERENCE:
                continue
            per_seed = {}
            for s, run in sorted(runs.items()):
                if s not in ref:
                    continue
                run_sm = smooth(run.losses, settings.smooth)
                raw = rel_diffs(run.losses, ref[s].losses)
                smd = rel_diffs(run_sm, sm[s])
                inside = [l <= x <= h for x, l, h in zip(run_sm, lo, hi)]
                # how far outside, in units of the envelope's width at that step
                outside = [max(l - x, x - h, 0.0) / max(h - l, 1e-12) for x, l, h in zip(run_sm, lo, hi)]
                final = run.evals[last]
                per_seed[str(s)] = {
                    "same_seed_raw_rel_diff_max": max(raw),
                    "same_seed_raw_rel_diff_mean": sum(raw) / len(raw),
                    "same_seed_smoothed_rel_diff_max": max(smd),
                    "same_seed_smoothed_rel_diff_mean": sum(smd) / len(smd),
                    "first_step_above_1e-2": next((i for i, d in enumerate(raw) if d > 1e-2), None),
                    "envelope_fraction_inside": sum(inside) / len(inside),
                    "envelope_max_excess_in_widths": max(outside),
                    "final_eval": final,
                    "final_eval_minus_hf_same_seed": final - ref[s].evals[last],
                    "final_eval_in_hf_range": min(hf_evals) <= final <= max(hf_evals),
                    "final_eval_distance_to_hf_range": max(min(hf_evals) - final, final - max(hf_evals), 0.0),
                }
            vals = list(per_seed.values())
            compared[variant] = {
                "per_seed": per_seed,
                "envelope_fraction_inside_mean": sum(v["envelope_fraction_inside"] for v in vals) / len(vals),
                "same_seed_raw_rel_diff_max": max(v["same_seed_raw_rel_diff_max"] for v in vals),
                "same_seed_raw_rel_diff_mean": sum(v["same_seed_raw_rel_diff_mean"] for v in vals) / len(vals),
                "same_seed_smoothed_rel_diff_max": max(v["same_seed_smoothed_rel_diff_max"] for v in vals),
                "final_eval_all_in_hf_range": all(v["final_eval_in_hf_range"] for v in vals),
                "final_eval_max_abs_diff_same_seed": max(abs(v["final_eval_minus_hf_same_seed"]) for v in vals),
                "final_eval_max_distance_to_hf_range": max(v["final_eval_distance_to_hf_range"] for v in vals),
            }
        summary[group] = {"reference": REFERENCE, "hf_spread": spread, "variants": compared}
    return summary


# ---------------------------------------------------------------------------- plot


def plot(results: list[RunResult], settings: Settings, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[RunResult]] = {}
    for r in results:
        groups.setdefault(r.spec.group, []).append(r)
    colors = {"hf": "black", "hf_autocast": "tab:orange", "barq_mixed": "tab:blue", "barq_peft": "tab:green"}
    fig, axes = plt.subplots(len(groups), 2, figsize=(13, 3.6 * len(groups)), squeeze=False)
    for row, (group, runs) in enumerate(sorted(groups.items())):
        ax, axd = axes[row]
        ref = {r.spec.seed: smooth(r.losses, settings.smooth) for r in runs if r.spec.variant == REFERENCE}
        steps = list(range(1, settings.steps + 1))
        if len(ref) >= 2:
            lo = [min(v) for v in zip(*ref.values())]
            hi = [max(v) for v in zip(*ref.values())]
            ax.fill_between(steps, lo, hi, color="0.8", label=f"HF+PEFT envelope (seeds {sorted(ref)})")
        seen = set()
        for r in sorted(runs, key=lambda r: (r.spec.variant, r.spec.seed)):
            label = None if r.spec.variant in seen else r.spec.variant
            seen.add(r.spec.variant)
            ax.plot(steps, smooth(r.losses, settings.smooth), color=colors[r.spec.variant], lw=0.8, alpha=0.8, label=label)
            if r.spec.variant != REFERENCE and r.spec.seed in ref:
                d = rel_diffs(smooth(r.losses, settings.smooth), ref[r.spec.seed])
                axd.plot(steps, d, color=colors[r.spec.variant], lw=0.8, alpha=0.8,
                         label=r.spec.variant if r.spec.seed == min(ref) else None)
        if len(ref) >= 2:
            seeds = sorted(ref)
            width = [max(abs(ref[a][i] - ref[b][i]) / ref[b][i] for a in seeds for b in seeds if a != b)
                     for i in range(settings.steps)]
            axd.plot(steps, width, color="0.5", ls="--", lw=1, label="HF+PEFT max seed-to-seed")
        ax.set_title(f"{group}: training loss (moving average of {settings.smooth})")
        ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.legend(fontsize=7)
        axd.set_title(f"{group}: |smoothed loss - HF+PEFT same seed| / HF+PEFT")
        axd.set_yscale("log"); axd.set_xlabel("step"); axd.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------- main


def _worker(args):
    spec, settings, data = args
    result = train(spec, settings, data)
    print(f"  {spec.group:16s} {spec.variant:12s} seed {spec.seed}: loss {result.losses[0]:.4f} -> "
          f"{result.losses[-1]:.4f}, eval {result.evals[settings.steps]:.4f}, {result.seconds:.0f} s", flush=True)
    return result


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import peft
    import transformers

    return {"device": "CPU", "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}


def markdown(record: dict) -> str:
    """The results table of docs/convergence.md, from a saved JSON record."""
    lines = [
        "| group | variant | same-seed rel. diff per step, max / mean | smoothed, max | steps inside HF envelope "
        "(seeds 0/1/2) | final eval (seeds 0/1/2) | in HF range? | max dist. to HF range |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for group, s in record["summary"].items():
        sp = s["hf_spread"]
        ev = "/".join(f"{v:.4f}" for v in sp["final_eval"].values())
        lines.append(
            f"| {group} | hf (reference) | seed-to-seed: {sp['seed_pairs_raw_rel_diff_max']:.2e} / "
            f"{sp['seed_pairs_raw_rel_diff_mean']:.2e} | seed-to-seed: {sp['seed_pairs_smoothed_rel_diff_max']:.2e} | "
            f"envelope width mean {sp['envelope_rel_width_mean']:.2%} | {ev} | range {sp['final_eval_range']:.4f} | |"
        )
        for variant, c in s["variants"].items():
            ps = c["per_seed"]
            inside = "/".join(f"{v['envelope_fraction_inside']:.0%}" for v in ps.values())
            ev = "/".join(f"{v['final_eval']:.4f}" for v in ps.values())
            lines.append(
                f"| {group} | {variant} | {c['same_seed_raw_rel_diff_max']:.2e} / {c['same_seed_raw_rel_diff_mean']:.2e} | "
                f"{c['same_seed_smoothed_rel_diff_max']:.2e} | {inside} | {ev} | "
                f"{'yes' if c['final_eval_all_in_hf_range'] else 'NO'} | {c['final_eval_max_distance_to_hf_range']:.4f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--variants", default=",".join(VARIANTS), help="LoRA variants for the first family")
    p.add_argument("--family-variants", default="hf,barq_mixed", help="LoRA variants for the other families")
    p.add_argument("--qlora-variants", default="hf,barq_mixed", help="empty for no QLoRA runs")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--workers", type=int, default=2, help="processes (each with --threads threads)")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--report", default=None, help="print the markdown table of a saved JSON record and exit")
    for f, default in asdict(Settings()).items():
        p.add_argument("--" + f.replace("_", "-"), type=type(default), default=default)
    a = p.parse_args(argv)
    if a.report:
        print(markdown(json.loads(Path(a.report).read_text())))
        return 0
    settings = Settings(**{f: getattr(a, f) for f in asdict(Settings())})
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    families, seeds = split(a.families), [int(s) for s in split(a.seeds)]
    specs = [RunSpec(families[0], v, s) for v in split(a.variants) for s in seeds]
    specs += [RunSpec(f, v, s) for f in families[1:] for v in split(a.family_variants) for s in seeds]
    specs += [RunSpec("llama", v, s, "nf4") for v in split(a.qlora_variants) for s in seeds]

    t0 = time.perf_counter()
    data = prepare_data(settings)
    print(f"data: {data['stats']}", flush=True)
    conversions = conversion_check(settings, data["eval_ids"][:4])
    print(f"conversions: {conversions}", flush=True)
    print(f"{len(specs)} runs of {settings.steps} steps, {a.workers} workers x {settings.threads} threads", flush=True)
    jobs = [(s, settings, data) for s in specs]
    if a.workers > 1:
        with multiprocessing.get_context("spawn").Pool(a.workers) as pool:
            results = pool.map(_worker, jobs, chunksize=1)
    else:
        results = [_worker(j) for j in jobs]
    summary = summarize(results, settings)
    wall = time.perf_counter() - t0

    for group, s in summary.items():
        sp = s["hf_spread"]
        print(f"\n{group}: HF+PEFT seeds {sp['seeds']}: envelope width mean {sp['envelope_rel_width_mean']:.2%}, "
              f"final eval {sp['final_eval_min']:.4f}..{sp['final_eval_max']:.4f}")
        for v, c in s["variants"].items():
            print(f"  {v:12s} same-seed rel diff max {c['same_seed_raw_rel_diff_max']:.2e} "
                  f"mean {c['same_seed_raw_rel_diff_mean']:.2e}; inside envelope {c['envelope_fraction_inside_mean']:.0%}; "
                  f"final eval in HF range: {c['final_eval_all_in_hf_range']} "
                  f"(max |diff| same seed {c['final_eval_max_abs_diff_same_seed']:.2e})")
    print(f"\nwall time {wall:.0f} s")

    if a.out:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
            dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "python"], cwd=REPO,
                                        capture_output=True, text=True).stdout.strip())
        except OSError:
            commit, dirty = "unknown", None
        import barqtrain

        record = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit,
            "python_tree_dirty": dirty,
            "barqtrain_imported_from": str(Path(barqtrain.__file__).parent),
            "command": "python " + " ".join([os.path.relpath(__file__, REPO)] + (sys.argv[1:] if argv is None else list(argv))),
            "machine": machine(),
            "wall_seconds": wall,
            "settings": {**asdict(settings), "model_dir": os.path.relpath(settings.model_dir, REPO),
                         "data_file": os.path.relpath(settings.data_file, REPO)},
            "data": data["stats"],
            "family_conversions": conversions,
            "summary": summary,
            "runs": [
                {"family": r.spec.family, "quant": r.spec.quant, "variant": r.spec.variant, "seed": r.spec.seed,
                 "lora_layers": r.lora_layers, "quantized_layers": len(r.quantized_layers),
                 "seconds": round(r.seconds, 1), "losses": [round(x, 6) for x in r.losses],
                 "evals": {str(k): round(v, 6) for k, v in sorted(r.evals.items())}}
                for r in results
            ],
        }
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {a.out}")
    if a.plot:
        plot(results, settings, a.plot)
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
