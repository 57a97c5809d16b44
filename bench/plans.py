"""Will it fit? Plans (``--compile_topology``) for real model sizes on small TPU slices, compiled with real libtpu
on this machine, no TPU needed: memory per chip, estimated step time and MFU (a roofline from the compiled
program, not a measurement), the attention kernel found in the program. Writes bench/results/plans.json.

    python bench/plans.py                       # every row (each compile takes minutes on a laptop CPU)
    python bench/plans.py --only gptj-6b        # rows whose name starts with this
    python bench/plans.py --markdown            # BENCHMARKS.md's table from plans.json (between its markers)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import records

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--dtype", "bfloat16", "--remat", "full"]
GPT2_XL = "n_layer=48,n_embd=1600,n_head=25"
# Pretraining without dropout (as GPT-J's config has it); the gpt2-xl-dropout row keeps GPT-2's default 0.1
NO_DROPOUT = ",attn_pdrop=0,resid_pdrop=0,embd_pdrop=0"
BERT_LARGE = "hidden_size=1024,num_hidden_layers=24,num_attention_heads=16,intermediate_size=4096"
T5_XL = (
    "d_model=2048,d_ff=5120,num_layers=24,num_decoder_layers=24,num_heads=32,d_kv=64,"
    "feed_forward_proj=gated-gelu,tie_word_embeddings=false"
)
LLAMA3_8B = (
    "hidden_size=4096,intermediate_size=14336,num_hidden_layers=32,num_attention_heads=32,num_key_value_heads=8,"
    "vocab_size=128256,max_position_embeddings=8192"
)
LLAMA_CHAT = ["--model_type", "llama", "--config_overrides", LLAMA3_8B, "--max_seq_length", 2048]
LORA_ALL = ["--lora_rank", 16, "--lora_targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"]
LLAMA31_8B = LLAMA3_8B.replace("max_position_embeddings=8192", "max_position_embeddings=131072")
LLAMA31_128K = ["--model_type", "llama", "--config_overrides", LLAMA31_8B, "--max_seq_length", 131072, *LORA_ALL]
GEMMA2_9B = (
    "hidden_size=3584,intermediate_size=14336,num_hidden_layers=42,num_attention_heads=16,num_key_value_heads=8,"
    "head_dim=256,query_pre_attn_scalar=256,sliding_window=4096,vocab_size=256000"
)
QWEN3_8B = (
    "hidden_size=4096,intermediate_size=12288,num_hidden_layers=36,num_attention_heads=32,num_key_value_heads=8,"
    "head_dim=128,vocab_size=151936,max_position_embeddings=40960"
)
MIXTRAL_8X7B = (
    "hidden_size=4096,intermediate_size=14336,num_hidden_layers=32,num_attention_heads=32,num_key_value_heads=8,"
    "num_local_experts=8,num_experts_per_tok=2,vocab_size=32000,output_router_logits=true"
)
ATTENTION_LORA = ["--lora_rank", 16, "--lora_targets", "q_proj,k_proj,v_proj,o_proj"]
GPT_OSS_20B = (
    "hidden_size=2880,intermediate_size=2880,num_hidden_layers=24,num_attention_heads=64,num_key_value_heads=8,"
    "head_dim=64,num_local_experts=32,num_experts_per_tok=4,vocab_size=201088,sliding_window=128"
)
# model -> (script, flags): AdamW, float32 master weights and optimizer state, bf16 compute, full remat
MODELS = {
    "gptj-6b": ("pretrain_clm.py", ["--model_type", "gptj", "--block_size", 2048]),
    "gpt2-xl": (
        "pretrain_clm.py",
        ["--model_type", "gpt2", "--config_overrides", GPT2_XL + NO_DROPOUT, "--block_size", 1024],
    ),
    "gpt2-xl-dropout": (
        "pretrain_clm.py",
        ["--model_type", "gpt2", "--config_overrides", GPT2_XL, "--block_size", 1024],
    ),
    "t5-v1_1-xl": (
        "finetune_seq2seq.py",
        ["--model_type", "t5", "--config_overrides", T5_XL, "--max_source_length", 512, "--max_target_length", 128],
    ),
    "bert-large": (
        "finetune_glue.py",
        # unpacked: packing sizes its rows from the tokenized data, which a plan from a bare config has not
        [
            "--model_type",
            "bert",
            "--config_overrides",
            BERT_LARGE,
            "--max_seq_length",
            512,
            "--task_name",
            "mrpc",
            "--no_pack_sequences",
        ],
    ),
    # chat fine-tuning (jaxseq chat) of the Llama-3-8B shape: every weight, and LoRA on all seven projections
    "llama3-8b": ("finetune_chat.py", LLAMA_CHAT),
    "llama3-8b-lora": ("finetune_chat.py", [*LLAMA_CHAT, *LORA_ALL]),
    # QLoRA: the blocks' frozen kernels in nf4 (scanned layers, as --scan_layers auto under --remat full), one chip
    "llama3-8b-qlora": ("finetune_chat.py", [*LLAMA_CHAT, *LORA_ALL, "--quantize", "nf4"]),
    # decoder families at their published sizes, chat fine-tuning at 2048 tokens: every weight where it fits,
    # LoRA r16 on all projections where not; Mixtral-8x7B LoRA on the attention (experts cannot be adapted)
    # with its experts split over ep
    "gemma2-9b": (
        "finetune_chat.py",
        ["--model_type", "gemma2", "--config_overrides", GEMMA2_9B, "--max_seq_length", 2048],
    ),
    "gemma2-9b-lora": (
        "finetune_chat.py",
        ["--model_type", "gemma2", "--config_overrides", GEMMA2_9B, "--max_seq_length", 2048, *LORA_ALL],
    ),
    "qwen3-8b": (
        "finetune_chat.py",
        ["--model_type", "qwen3", "--config_overrides", QWEN3_8B, "--max_seq_length", 2048],
    ),
    "qwen3-8b-lora": (
        "finetune_chat.py",
        ["--model_type", "qwen3", "--config_overrides", QWEN3_8B, "--max_seq_length", 2048, *LORA_ALL],
    ),
    "mixtral-8x7b-lora": (
        "finetune_chat.py",
        ["--model_type", "mixtral", "--config_overrides", MIXTRAL_8X7B, "--max_seq_length", 2048, *ATTENTION_LORA],
    ),
    # Llama-3.1-8B's shape at 131,072 tokens, LoRA on all projections: whole rows (fsdp=8) against each row's tokens
    # split over 4 chips (fsdp=2,cp=4: the same rows per data-parallel replica)
    "llama3.1-8b-128k-lora": ("finetune_chat.py", LLAMA31_128K),
    "llama3.1-8b-128k-lora-cp": ("finetune_chat.py", LLAMA31_128K),
    # gpt-oss-20B at 4096 tokens, LoRA on the attention, its 32 experts (and everything else) over fsdp
    "gpt-oss-20b-lora": (
        "finetune_chat.py",
        ["--model_type", "gpt_oss", "--config_overrides", GPT_OSS_20B, "--max_seq_length", 4096, *ATTENTION_LORA],
    ),
    # the attention kernel side by side (every row above runs --attention auto: splash on TPU where it applies)
    "gpt2-small-splash": (
        "pretrain_clm.py",
        ["--model_type", "gpt2", "--config_overrides", NO_DROPOUT[1:], "--block_size", 1024, "--attention", "splash"],
    ),
    "gpt2-small-xla": (
        "pretrain_clm.py",
        ["--model_type", "gpt2", "--config_overrides", NO_DROPOUT[1:], "--block_size", 1024, "--attention", "xla"],
    ),
    "gptj-6b-xla": ("pretrain_clm.py", ["--model_type", "gptj", "--block_size", 2048, "--attention", "xla"]),
    "gptj-6b-8k-splash": (
        "pretrain_clm.py",
        [
            "--model_type",
            "gptj",
            "--config_overrides",
            "n_positions=8192",
            "--block_size",
            8192,
            "--attention",
            "splash",
        ],
    ),
    "gptj-6b-8k-xla": (
        "pretrain_clm.py",
        ["--model_type", "gptj", "--config_overrides", "n_positions=8192", "--block_size", 8192, "--attention", "xla"],
    ),
}
# the same runs with their blocks scanned, as --scan_layers auto does under --remat full, against unrolled (the rows
# without -scan): compile time flat in depth, at the memory per chip the unrolled rows show
SCANNED = ("gptj-6b", "t5-v1_1-xl", "llama3-8b", "llama3-8b-lora")
for model in SCANNED:
    script, flags = MODELS[model]
    MODELS[f"{model}-scan"] = (script, [*flags, "--scan_layers", "true"])
    MODELS[model] = (script, [*flags, "--scan_layers", "false"])
KERNEL_ROWS = ("gpt2-small-splash", "gpt2-small-xla", "gptj-6b-xla", "gptj-6b-8k-splash", "gptj-6b-8k-xla")
# Cloud TPU slice -> mesh: every chip one fsdp shard (a v4-8 is 4 chips of 32 GiB). Each model has a v5e-8 and a
# v4-8 row, and the v5e slices that bracket its smallest fit (Cloud has no v5e-2: v5e-1, v5e-4, v5e-8, ...).
MESH = {"v5e-1": "fsdp=1", "v5e-4": "fsdp=4", "v5e-8": "fsdp=8", "v4-8": "fsdp=4", "v5p-8": "fsdp=4"}
# Mixtral's experts split over ep (2 of its 8 experts a chip), the rest replicated
MODEL_MESH = {"mixtral-8x7b-lora": {"v5p-8": "ep=4"}}
# a v5p-16 is 8 chips: whole 131,072-token rows over fsdp=8, or each row split over cp=4
MODEL_MESH["llama3.1-8b-128k-lora"] = {"v5p-16": "fsdp=8"}
MODEL_MESH["llama3.1-8b-128k-lora-cp"] = {"v5p-16": "fsdp=2,cp=4"}
SLICES = {
    "gptj-6b": ["v5e-8", "v5e-4", "v4-8"],
    "gpt2-xl": ["v5e-8", "v5e-4", "v5e-1", "v4-8"],
    "gpt2-xl-dropout": ["v5e-8"],
    "t5-v1_1-xl": ["v5e-8", "v5e-4", "v5e-1", "v4-8"],
    "bert-large": ["v5e-8", "v5e-1", "v4-8"],
    "llama3-8b": ["v5e-8", "v5p-8"],
    "llama3-8b-lora": ["v5e-8", "v5p-8"],
    "llama3-8b-qlora": ["v5e-1"],
    "gemma2-9b": ["v5e-8"],
    "gemma2-9b-lora": ["v5e-8"],
    "qwen3-8b": ["v5e-8"],
    "qwen3-8b-lora": ["v5e-8"],
    "mixtral-8x7b-lora": ["v5p-8"],
    "gpt-oss-20b-lora": ["v5e-8"],
    "gpt2-small-splash": ["v5e-8"],
    "gpt2-small-xla": ["v5e-8"],
    "gptj-6b-xla": ["v5e-8"],
    "gptj-6b-8k-splash": ["v5e-8"],
    "gptj-6b-8k-xla": ["v5e-8"],
}
SLICES.update({f"{model}-scan": SLICES[model] for model in SCANNED})
SLICES.update({"llama3.1-8b-128k-lora": ["v5p-16"], "llama3.1-8b-128k-lora-cp": ["v5p-16"]})
# Qwen3.5-9B's shape (transformers' Qwen3_5TextConfig defaults: 24 Gated DeltaNet and 8 gated full attention
# layers, vocabulary 248,320), chat fine-tuning of every weight at 2048 tokens; its mixed layers run unrolled
MODELS["qwen3.5-9b"] = ("finetune_chat.py", ["--model_type", "qwen3_5_text", "--max_seq_length", 2048])
SLICES["qwen3.5-9b"] = ["v5p-8"]
# Gemma-4-31B's shape (60 layers, every sixth full attention with 512-wide heads and keys as values; sliding
# window 1024, no per-layer inputs), chat, LoRA r16 on all projections; its layers scan in 10 groups of 6. Its full
# layers keep num_key_value_heads (16; the checkpoint's num_global_key_value_heads, 4, is no field an override sets)
GEMMA4_31B = (
    "hidden_size=5376,intermediate_size=21504,num_hidden_layers=60,num_attention_heads=32,num_key_value_heads=16,"
    "head_dim=256,sliding_window=1024,vocab_size=262144,hidden_size_per_layer_input=0,attention_k_eq_v=true,"
    "final_logit_softcapping=30.0"
)
MODELS["gemma4-31b-lora"] = (
    "finetune_chat.py",
    ["--model_type", "gemma4_text", "--config_overrides", GEMMA4_31B, "--max_seq_length", 2048, *LORA_ALL],
)
SLICES["gemma4-31b-lora"] = ["v5e-8"]
# DeepSeek-V3 (transformers' DeepseekV3Config defaults: 671B, 61 layers, 256 routed experts top-8), chat, LoRA r16
# on its default targets (q_b_proj, kv_b_proj), 4096 tokens. The experts split over ep=8, the rest over fsdp. Its
# bf16 weights alone (1250 GiB) need 14 v5p chips; a v5p-32 (16 chips) does not fit, a v5p-64 does
MODELS["deepseek-v3-lora"] = (
    "finetune_chat.py",
    ["--model_type", "deepseek_v3", "--max_seq_length", 4096, "--lora_rank", 16],
)
SLICES["deepseek-v3-lora"] = ["v5p-32", "v5p-64"]
MODEL_MESH["deepseek-v3-lora"] = {"v5p-32": "fsdp=2,ep=8", "v5p-64": "fsdp=4,ep=8"}
ROWS = {  # name -> (script, flags)
    f"{model}/{slice_}": (script, [*flags, "--mesh", MODEL_MESH.get(model, MESH)[slice_]])
    for model, (script, flags) in MODELS.items()
    for slice_ in SLICES[model]
}
BATCH = {
    "gptj-6b": 1, "gpt2-xl": 4, "gpt2-xl-dropout": 4, "bert-large": 8, "t5-v1_1-xl": 2, "gpt2-small-splash": 8,
    "gpt2-small-xla": 8, "gptj-6b-xla": 1, "gptj-6b-8k-splash": 1, "gptj-6b-8k-xla": 1, "llama3-8b": 1,
    "llama3-8b-lora": 1, "llama3-8b-qlora": 1, "gemma2-9b": 1, "gemma2-9b-lora": 1, "qwen3-8b": 1,
    "qwen3-8b-lora": 1, "mixtral-8x7b-lora": 1, "gpt-oss-20b-lora": 1,
}  # fmt: skip
BATCH.update({f"{model}-scan": BATCH[model] for model in SCANNED})
BATCH.update({"llama3.1-8b-128k-lora": 1, "llama3.1-8b-128k-lora-cp": 1})
BATCH["qwen3.5-9b"] = 1
BATCH["gemma4-31b-lora"] = 1
BATCH["deepseek-v3-lora"] = 1


def run(name: str, script: str, flags: list) -> dict:
    topology = name.split("/")[1]
    model = name.split("/")[0]
    with tempfile.TemporaryDirectory() as out:
        batch = ["--per_device_train_batch_size", str(BATCH[model])]
        cmd = [sys.executable, str(ROOT / "scripts" / script), *map(str, flags), *COMMON, *batch]
        cmd += ["--compile_topology", topology, "--output_dir", out]
        result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        plan_path = Path(out) / "plan.json"
        plan = json.loads(plan_path.read_text()) if plan_path.is_file() else None
    print(f"== {name}\n{result.stdout.strip()}\n{result.stderr.strip()}", flush=True)
    env = records.environment()
    return {"name": name, "command": " ".join(cmd[1:]).replace(out, "OUT"), "exit_code": result.returncode,
            "message": _failure(result) if result.returncode else None, "plan": plan, "date": env["date"],
            "jaxseq_commit": env["jaxseq_commit"]}  # fmt: skip


def _failure(result: subprocess.CompletedProcess) -> str:
    """The last line of stderr; for a compiler that crashed (a signal), its crash line and where it was."""
    lines = result.stderr.strip().splitlines() or [""]
    if result.returncode >= 0:
        return lines[-1]
    crash = [line.strip() for line in lines if line.startswith("***") or line.strip().startswith("PC:")]
    return re.sub(r"\s+", " ", f"crashed (signal {-result.returncode}): " + " ".join(crash[:2]))


NAMES = {
    "gptj-6b": "GPT-J-6B",
    "gpt2-xl": "GPT-2 XL",
    "gpt2-xl-dropout": "GPT-2 XL, dropout 0.1",
    "t5-v1_1-xl": "T5-v1.1-XL",
    "bert-large": "BERT-large",
    "llama3-8b": "Llama-3-8B shape, chat, all weights",
    "llama3-8b-lora": "Llama-3-8B shape, chat, LoRA r16 on all projections",
    "llama3-8b-qlora": "Llama-3-8B shape, chat, QLoRA (nf4) r16 on all projections",
    "gemma2-9b": "Gemma-2-9B shape, chat, all weights",
    "gemma2-9b-lora": "Gemma-2-9B shape, chat, LoRA r16 on all projections",
    "qwen3-8b": "Qwen3-8B shape, chat, all weights",
    "qwen3-8b-lora": "Qwen3-8B shape, chat, LoRA r16 on all projections",
    "mixtral-8x7b-lora": "Mixtral-8x7B shape, chat, LoRA r16 on attention, experts on ep",
    "gpt-oss-20b-lora": "gpt-oss-20B shape, chat, LoRA r16 on attention",
    "gpt2-small-splash": "GPT-2 small, no dropout, --attention splash",
    "gpt2-small-xla": "GPT-2 small, no dropout, --attention xla",
    "gptj-6b-xla": "GPT-J-6B, --attention xla",
    "gptj-6b-8k-splash": "GPT-J-6B, --attention splash",
    "gptj-6b-8k-xla": "GPT-J-6B, --attention xla",
}
NAMES.update({f"{model}-scan": f"{NAMES[model]}, scanned layers" for model in SCANNED})
NAMES["llama3.1-8b-128k-lora"] = "Llama-3.1-8B shape, chat, LoRA r16 on all projections"
NAMES["llama3.1-8b-128k-lora-cp"] = "Llama-3.1-8B shape, chat, LoRA r16 on all projections, context parallel"
NAMES["qwen3.5-9b"] = "Qwen3.5-9B shape, chat, all weights"
NAMES["gemma4-31b-lora"] = "Gemma-4-31B shape, chat, LoRA r16 on all projections"
NAMES["deepseek-v3-lora"] = "DeepSeek-V3 (671B), chat, LoRA r16 on q_b_proj and kv_b_proj"
GiB = 2**30


def _flag(command: str, name: str) -> str | None:
    found = re.search(rf"--{name} (\S+)", command)
    return found.group(1) if found else None


def _tokens(command: str) -> str:
    """``rows x length`` per chip from the recorded command (seq2seq: source + target)."""
    rows = _flag(command, "per_device_train_batch_size")
    source, target = _flag(command, "max_source_length"), _flag(command, "max_target_length")
    length = f"({source} + {target})" if source else _flag(command, "block_size") or _flag(command, "max_seq_length")
    return f"{rows} x {length}"


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _cells(row: dict) -> list[str]:
    model, slice_ = row["name"].split("/")
    plan = row["plan"]
    head = [f"{NAMES.get(model, model)}, {_tokens(row['command'])}"]
    if plan is None:  # failed before a plan was written: the error's line
        message = re.sub(r"\*\*\*.*\*\*\* PC: @ \S+ \(unknown\)", "in", row["message"] or "")  # a crash: where
        return [*head, f"{slice_}, -", "-", "-", "-", "-", f"**failed**: {message}", "-", "-", "-", "-"]
    mesh = ",".join(f"{axis}={n}" for axis, n in plan["mesh"].items() if n > 1) or "one chip"
    memory, hbm = plan["bytes_per_device"], plan["hbm_bytes_per_device"]
    verdict = "fits" if plan["fits"] else "refused"
    step, mfu = plan["estimated_step_seconds"], plan["estimated_mfu"]
    return [
        *head,
        f"{plan['accelerator']}, {mesh}",
        _gib(memory["parameters"]),
        _gib(memory["optimizer_state"]),
        _gib(memory["temporaries"]),
        f"**{memory['total'] / GiB:.2f} / {hbm / GiB:.2f} GiB: {verdict}**",
        f"{step * 1e3:.0f} ms" if step else "-",
        f"{mfu:.0%}" if mfu else "-",
        plan["attention_kernel"] or "-",
        f"{plan['compile_seconds']:.0f} s" if plan["fits"] else "-",
    ]


def _smallest(model: str, rows: list[dict]) -> str:
    """The smallest v5e slice of ``rows`` that fits (a model planned on no v5e slice: its smallest slice), and
    what the next smaller one planned needs."""
    ours = [r["plan"] for r in rows if r["plan"] and r["name"].startswith(f"{model}/")]
    plans = sorted([p for p in ours if p["accelerator"].startswith("v5e-")] or ours, key=_chips)
    fits = [plan for plan in plans if plan["fits"]]
    if not fits:
        planned = ", ".join(plan["accelerator"] for plan in plans)
        return f"- {NAMES.get(model, model)}: fits none of the slices planned ({planned})"
    best, below = fits[0], [plan for plan in plans if _chips(plan) < _chips(fits[0])]
    line = f"- {NAMES.get(model, model)}: **{best['accelerator']}**, {_gib(best['bytes_per_device']['total'])} per chip"
    if below:
        refused = below[-1]
        need, usable = refused["bytes_per_device"]["total"] / GiB, refused["hbm_bytes_per_device"] / GiB
        return line + f"; {refused['accelerator']} needs {need:.2f} of {usable:.2f} GiB"
    return line + ("" if _chips(best) == 1 else "; no smaller slice planned")


def _chips(plan: dict) -> int:
    return plan["devices"]


def markdown(results: dict) -> str:
    """The table of BENCHMARKS.md's "Will it fit?", one row per plan, then each model's smallest v5e slice."""
    columns = ["model, tokens per chip", "slice, mesh", "params", "opt. state", "temporaries",
               "total / usable HBM", "est. step", "est. MFU", "attention", "compile"]  # fmt: skip
    lines = [f"Plans of {results['date']} ({results['settings']}):", "", "| " + " | ".join(columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in results["rows"]]
    lines += ["", "Smallest v5e slice that fits (Cloud TPU has no v5e-2; the smallest v4 slice is v4-8):", ""]
    models = dict.fromkeys(row["name"].split("/")[0] for row in results["rows"])
    lines += [_smallest(model, results["rows"]) for model in models if model not in KERNEL_ROWS]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="run only the rows whose name starts with this")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "plans.json"))
    parser.add_argument("--markdown", action="store_true", help="compile nothing: write BENCHMARKS.md's table")
    args = parser.parse_args()
    path = Path(args.output)
    if args.markdown:
        table = markdown(json.loads(path.read_text()))
        records.replace_table("plans", table)
        print(table)
        return
    previous = json.loads(path.read_text())["rows"] if path.is_file() else []
    rows = {row["name"]: row for row in previous}
    for name, (script, flags) in ROWS.items():
        if name.startswith(args.only):
            rows[name] = run(name, script, flags)
    path.parent.mkdir(parents=True, exist_ok=True)
    env = records.environment()
    path.write_text(json.dumps({
        "date": env["date"], "jaxseq_commit": env["jaxseq_commit"], "machine": f"{env['machine']} (no TPU)",
        "settings": "AdamW, float32 trained parameters and optimizer state, bfloat16 compute (LoRA's frozen base "
        "stored in it), --remat full; each row's date and commit are its own compile's",
        "rows": [rows[n] for n in ROWS if n in rows],
    }, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
