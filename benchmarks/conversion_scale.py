"""Converting checkpoints larger than memory (docs/conversion.md, "Large models"): peak memory and time per layer of
the layer-by-layer conversion (``gqa convert``) against loading the model whole, on random Llama checkpoints written
here as big ones come (bf16, sharded with HF's index) at a few sizes.

Each conversion runs in a fresh process (``gqa convert SRC DST --kv-heads N ...``) whose peak resident memory is read
from ``/proc/self/status`` (``VmHWM``) at its end; its growth over the process after imports is what the conversion
itself holds. "Whole" is a process that only reads the model in float32 (``gqa.loaders.read_model``), as an in-memory
conversion must first. ``--dry-run``'s estimate is printed next to the measurement.

    .venv/bin/python benchmarks/conversion_scale.py --json results/conversion-scale.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

# name -> (layers, hidden, intermediate, heads, head_dim, vocab); MHA sources (KV heads = heads)
SIZES = {
    "0.6B": (16, 1024, 8192, 8, 128, 49152),
    "1.6B": (24, 2048, 8192, 16, 128, 49152),
    "3.3B": (26, 3072, 8192, 24, 128, 49152),
}

RUN = """
import json, sys, time
import transformers, gqa
from gqa.loaders import load_tokenizer, read_model
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
mode, src, dst, args = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
load_tokenizer(src)
baseline = status("VmRSS:")
t = time.perf_counter()
if mode == "whole":
    read_model(src)
else:
    from gqa.cli import main
    main(["convert", src, dst, *args])
print(json.dumps({"baseline": baseline, "peak": status("VmHWM:"), "seconds": time.perf_counter() - t}))
"""


def write_checkpoint(folder: Path, layers: int, hidden: int, ffn: int, heads: int, head_dim: int, vocab: int) -> int:
    """A random bf16 Llama checkpoint (one shard per 4 layers, untied head) with the SmolLM2 tokenizer; its bytes."""
    import transformers

    from gqa.loaders import load_tokenizer

    folder.mkdir(parents=True)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                      head_dim=head_dim, max_position_embeddings=2048, tie_word_embeddings=False,
                                      dtype="bfloat16")  # fmt: skip
    config.save_pretrained(folder)
    load_tokenizer(None).hf.save_pretrained(folder)
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).bfloat16()

    groups = [range(i, min(i + 4, layers)) for i in range(0, layers, 4)]
    weight_map, total = {}, 0
    for k, group in enumerate(groups):
        shard = {"model.embed_tokens.weight": rand(vocab, hidden)} if k == 0 else {}
        for i in group:
            p, q = f"model.layers.{i}.", heads * head_dim
            shard |= {p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                      p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                      p + "self_attn.q_proj.weight": rand(q, hidden), p + "self_attn.k_proj.weight": rand(q, hidden),
                      p + "self_attn.v_proj.weight": rand(q, hidden), p + "self_attn.o_proj.weight": rand(hidden, q),
                      p + "mlp.gate_proj.weight": rand(ffn, hidden), p + "mlp.up_proj.weight": rand(ffn, hidden),
                      p + "mlp.down_proj.weight": rand(hidden, ffn)}  # fmt: skip
        if k == len(groups) - 1:
            shard |= {
                "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                "lm_head.weight": rand(vocab, hidden),
            }
        name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
        total += sum(t.nbytes for t in shard.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))  # fmt: skip
    return total


def run(mode: str, src: Path, dst: Path, args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", RUN, mode, str(src), str(dst), json.dumps(args)], capture_output=True,
                         text=True, check=False)  # fmt: skip
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) | {"stdout": lines[:-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--calibration-tokens", type=int, default=4096, help="calibration text length (pca)")
    parser.add_argument("--whole", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure loading each model whole in float32")  # fmt: skip
    parser.add_argument("--refit-sizes", nargs="*", default=["0.6B"], help="sizes also converted with the refit")
    parser.add_argument("--json", type=Path, default=None)
    ns = parser.parse_args()
    from gqa.convert import default_calibration_text
    from gqa.loaders import load_tokenizer

    tok = load_tokenizer(None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = tmp / "calibration.txt"
        ids = tok.encode(default_calibration_text())[: ns.calibration_tokens]
        text.write_text(tok.decode(ids))
        for size in ns.sizes:
            layers = SIZES[size][0]
            src = tmp / f"src-{size}"
            t = time.perf_counter()
            nbytes = write_checkpoint(src, *SIZES[size])
            print(f"{size}: wrote {nbytes / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s", flush=True)
            variants = {"mean": ["--method", "mean"],
                        "pca": ["--method", "pca", "--no-refit", "--calibration-text", str(text)]}  # fmt: skip
            if size in ns.refit_sizes:
                variants["pca+refit"] = ["--method", "pca", "--refit", "--calibration-text", str(text)]
            row = {"size": size, "layers": layers, "bytes": nbytes, "params": nbytes // 2}
            if ns.whole:
                whole = run("whole", src, tmp / "unused", [])
                row["whole"] = {"grown": whole["peak"] - whole["baseline"], "seconds": whole["seconds"]}
                print(f"  whole fp32 load: +{row['whole']['grown'] / 2**30:.2f} GiB", flush=True)
            for name, args in variants.items():
                common = ["--kv-heads", str(ns.kv_heads), "--no-conversations", *args]
                dry = run("convert", src, tmp / "dry", [*common, "--dry-run"])
                got = run("convert", src, tmp / "dst", [*common, "--force"])
                row[name] = {"grown": got["peak"] - got["baseline"], "peak": got["peak"], "seconds": got["seconds"],
                             "seconds_per_layer": got["seconds"] / layers, "dry_run": dry["stdout"]}  # fmt: skip
                grown, secs = row[name]["grown"] / 2**30, got["seconds"]
                print(f"  {name}: +{grown:.2f} GiB, {secs:.0f} s ({secs / layers:.1f} s/layer); dry run: "
                      f"{dry['stdout'][3:5]}", flush=True)  # fmt: skip
            rows.append(row)
            shutil.rmtree(src)
            shutil.rmtree(tmp / "dst", ignore_errors=True)
    if ns.json is not None:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(rows, indent=1) + "\n")
    print("| model | bf16 size | whole, fp32 | " + " | ".join(k for k in ("mean", "pca", "pca+refit")) + " |")
    for r in rows:
        cells = [f"+{r[k]['grown'] / 2**30:.2f} GiB, {r[k]['seconds_per_layer']:.1f} s/layer" if k in r else "-"
                 for k in ("mean", "pca", "pca+refit")]  # fmt: skip
        whole = f"+{r['whole']['grown'] / 2**30:.2f} GiB" if "whole" in r else "-"
        print(
            f"| {r['size']} ({r['layers']} layers) | {r['bytes'] / 1e9:.2f} GB | {whole} | " + " | ".join(cells) + " |"
        )


if __name__ == "__main__":
    main()
