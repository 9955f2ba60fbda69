"""Converting models larger than memory (issue 26): the sharded safetensors writer, the layer-by-layer conversion
against the in-memory one (a ~1.1 GB bf16 checkpoint under a stated peak-RSS bound, measured in a subprocess; an MHA
model 8 -> 2; SmolLM2 9 -> 3), sharded output loading in gqa and transformers, ``--dry-run``, and healing across two
gloo processes against one process (``heal`` and ``torchrun -m gqa convert``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import gqa
from gqa.cli import main as cli
from gqa.convert import _calibration_activations, convert, convert_state, refit_convert_state
from gqa.convert.shards import INDEX_NAME, ShardedWriter, TensorSpec, parse_size
from gqa.loaders import load_tokenizer, read_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from helpers.checkpoints import WORDS, logits_hf, tiny_dir  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------------
# Helpers


def stored(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder's weights, as stored, read with the safetensors library through the index (or
    the single file)."""
    index = folder / INDEX_NAME
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]  # fmt: skip
    out = {}
    for name in files:
        with safe_open(folder / name, framework="pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    return out


def words(n: int, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())


# ---------------------------------------------------------------------------------------------------------------------
# The sharded writer


def test_sharded_writer_round_trips_in_any_order(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=g).bfloat16(), "b": torch.randn(7, generator=g),
               "c": torch.randn(2, 2, generator=g).half(), "d": torch.zeros(0, 3),
               "e": torch.randn(4, 4, generator=g)}  # fmt: skip
    writer = ShardedWriter(tmp_path, [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], 40)
    for name in ["e", "c", "a", "d", "b"]:
        writer.write(name, tensors[name])
    files = writer.close()
    shards = [f.name for f in files if f.suffix == ".safetensors"]
    # a (30 B) | b (28 B) + c (8 B) + d (0 B) | e (64 B, over the limit: alone)
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in range(1, 4)]
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 30 + 28 + 8 + 64
    assert index["weight_map"] == {"a": shards[0], "b": shards[1], "c": shards[1], "d": shards[1], "e": shards[2]}
    got = stored(tmp_path)
    assert got.keys() == tensors.keys()
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)


def test_sharded_writer_single_file_and_errors(tmp_path):
    spec = [TensorSpec("w", torch.float32, (2, 3))]
    writer = ShardedWriter(tmp_path, spec)
    with pytest.raises(ValueError, match=r"w has shape \(3, 2\), planned \(2, 3\)"):
        writer.write("w", torch.zeros(3, 2))
    with pytest.raises(ValueError, match="x is not one of the planned tensors"):
        writer.write("x", torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="never written: w"):
        writer.close()
    writer.write("w", torch.arange(6.0).view(2, 3).double())  # cast to the planned dtype
    with pytest.raises(ValueError, match="written already"):
        writer.write("w", torch.zeros(2, 3))
    assert [f.name for f in writer.close()] == ["model.safetensors"] and not (tmp_path / INDEX_NAME).exists()
    assert torch.equal(stored(tmp_path)["w"], torch.arange(6.0).view(2, 3))
    with pytest.raises(TypeError, match="int64"):
        ShardedWriter(tmp_path, [TensorSpec("i", torch.int64, (1,))])


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size(1234) == 1234
    assert parse_size("1.5 kb") == 1500
    for bad in ("five", "0", -1, "5PB", True):
        with pytest.raises(ValueError, match="max shard size"):
            parse_size(bad)


# ---------------------------------------------------------------------------------------------------------------------
# MHA -> GQA on a random bf16 sharded checkpoint: streaming equals the in-memory conversion; both libraries load it


@pytest.fixture(scope="module")
def mha(tmp_path_factory) -> Path:
    """A random Llama with MHA (8 query heads, 8 KV heads, D=6), untied, saved by transformers as sharded bf16."""
    folder = tiny_dir(tmp_path_factory.mktemp("mha") / "src", "llama", heads=8, kv=8, head_dim=6)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    for f in folder.glob("model*.safetensors"):
        f.unlink()
    model.save_pretrained(folder, max_shard_size="10KB")  # several shards and an index, as big checkpoints come
    assert (folder / INDEX_NAME).exists()
    return folder


@pytest.mark.parametrize(("method", "refit"), [("pca", True), ("pca", False), ("mean", False)])
def test_mha_to_gqa_streaming_equals_in_memory(mha, tmp_path, method, refit):
    text = words(700)
    dst = convert(mha, tmp_path / "out", kv_heads=2, method=method, refit=refit, calibration_text=text,
                  max_shard_size="8KB", progress=False)  # fmt: skip
    cfg, state = read_model(mha)  # float32, the whole model in memory
    ids = load_tokenizer(mha).encode(text)
    if refit:
        _, want = refit_convert_state(cfg, state, 2, method, ids)
    else:
        acts = _calibration_activations(cfg, state, load_tokenizer(mha), ids) if method == "pca" else None
        _, want = convert_state(cfg, state, 2, method, acts)
    got = stored(dst)
    assert (dst / INDEX_NAME).exists() and json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == torch.bfloat16  # bf16 in, bf16 out
        if "k_proj" in name or "v_proj" in name or "o_proj" in name or "q_proj" in name:
            torch.testing.assert_close(got[name].float(), t.bfloat16().float(), atol=1e-6, rtol=0)
        else:
            assert torch.equal(got[name], t.bfloat16()), name  # untouched: the source's own bf16 bits
    assert got["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 6, 24)


def test_sharded_output_loads_in_gqa_and_transformers_with_the_same_logits(mha, tmp_path):
    dst = convert(mha, tmp_path / "out", kv_heads=4, method="mean", max_shard_size="8KB", dtype=torch.float32,
                  progress=False)  # fmt: skip
    assert len(list(dst.glob("model-*-of-*.safetensors"))) > 1
    ids = torch.tensor([[1, 5, 3, 9, 4, 7, 2, 8, 6, 3], [4, 4, 7, 1, 9, 3, 5, 2, 2, 6]])
    with torch.inference_mode():
        ours = gqa.load_model(dst, tokenizer=False, dtype=torch.float32)(ids)
    torch.testing.assert_close(logits_hf(dst, ids), ours, atol=1e-4, rtol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    assert hf.config.num_key_value_heads == 4 and hf.model.layers[0].self_attn.k_proj.weight.shape == (24, 24)


def test_dtype_can_be_asked(mha, tmp_path):
    dst = convert(mha, tmp_path / "out", kv_heads=8, dtype=torch.float16, progress=False)
    got = stored(dst)
    assert {t.dtype for t in got.values()} == {torch.float16} and not (dst / INDEX_NAME).exists()
    with pytest.raises(TypeError, match="dtype must be None or one of"):
        convert(mha, tmp_path / "bad", kv_heads=8, dtype=torch.int8)
    with pytest.raises(ValueError, match="max shard size"):
        convert(mha, tmp_path / "bad", kv_heads=8, max_shard_size="lots")
    with pytest.raises(ValueError, match="no CUDA GPU") if not torch.cuda.is_available() else pytest.raises(TypeError):
        convert(mha, tmp_path / "bad", kv_heads=8, device="cuda")


def test_dry_run_writes_nothing(mha, tmp_path, capsys):
    assert cli(["convert", str(mha), str(tmp_path / "out"), "--kv-heads", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    from gqa.convert.calibration import default_calibration_text
    from gqa.loaders import load_tokenizer

    tokens = len(load_tokenizer(mha).encode(default_calibration_text()))  # no chat template: the docstrings alone
    assert f"plan         KV heads 8 -> 2; method pca, refit, ~{tokens:,} calibration tokens; on cpu" in out
    assert "memory       peak ~" in out and "time         ~" in out and "GFLOP/s" in out
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------------
# A ~1.1 GB bf16 checkpoint converted within a memory bound


BIG = dict(hidden_size=1024, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=8,
           head_dim=128, vocab_size=49152)  # fmt: skip  # 570M parameters: 1.14 GB in bf16, 2.28 GB in float32


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """A random Llama checkpoint as big checkpoints come: bf16, 4 shards with HF's index, written shard by shard with
    the safetensors library; the SmolLM2 tokenizer (same vocabulary size) for calibration."""
    folder = tmp_path_factory.mktemp("big") / "src"
    folder.mkdir()
    cfg = transformers.LlamaConfig(**BIG, max_position_embeddings=2048, tie_word_embeddings=False, dtype="bfloat16")
    cfg.save_pretrained(folder)
    load_tokenizer(None).hf.save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    E, F, D, H = BIG["hidden_size"], BIG["intermediate_size"], BIG["head_dim"], BIG["num_attention_heads"]

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).bfloat16()

    groups = [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]
    weight_map = {}
    for k, layers in enumerate(groups):
        shard = {}
        if k == 0:
            shard["model.embed_tokens.weight"] = rand(BIG["vocab_size"], E)
        for i in layers:
            p = f"model.layers.{i}."
            shard |= {p + "input_layernorm.weight": 1 + rand(E, std=0.1),
                      p + "post_attention_layernorm.weight": 1 + rand(E, std=0.1),
                      p + "self_attn.q_proj.weight": rand(H * D, E), p + "self_attn.k_proj.weight": rand(H * D, E),
                      p + "self_attn.v_proj.weight": rand(H * D, E), p + "self_attn.o_proj.weight": rand(E, H * D),
                      p + "mlp.gate_proj.weight": rand(F, E), p + "mlp.up_proj.weight": rand(F, E),
                      p + "mlp.down_proj.weight": rand(E, F)}  # fmt: skip
        if k == len(groups) - 1:
            shard |= {"model.norm.weight": 1 + rand(E, std=0.1), "lm_head.weight": rand(BIG["vocab_size"], E)}
        name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
        del shard
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


CONVERT_IN_SUBPROCESS = textwrap.dedent("""
    import json, sys
    import transformers  # imported before the baseline is taken, as everything convert() imports
    import gqa
    from gqa.convert import convert
    from gqa.loaders import load_tokenizer

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    src, dst, text = sys.argv[1:4]
    load_tokenizer(src)
    baseline = status("VmRSS:")
    convert(src, dst, kv_heads=2, method="pca", refit=False, calibration_text=open(text).read(),
            max_shard_size="400MB", progress=False)
    print(json.dumps({"baseline": baseline, "peak": status("VmHWM:")}))
""")


def test_big_bf16_checkpoint_streams_under_a_memory_bound_and_equals_the_in_memory_conversion(big, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text(gqa.convert.default_calibration_text()[:3000])  # ~800 tokens: the calibration is not the point
    dst = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    run = subprocess.run([sys.executable, "-c", CONVERT_IN_SUBPROCESS, str(big), str(dst), str(text)], env=env,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rss = json.loads(run.stdout.strip().splitlines()[-1])
    whole_fp32 = 570_000_000 * 4  # read_model: the whole model in float32
    layer_fp32 = 29_360_128 * 4  # the largest layer: 4 * 1024^2 + 3 * 1024 * 8192 parameters
    embedding = 49152 * 1024 * 2  # bf16, while the calibration windows are embedded
    grown = rss["peak"] - rss["baseline"]
    print(f"streaming conversion: peak RSS {rss['peak'] / 1e6:.0f} MB, {grown / 1e6:.0f} MB over the baseline")
    # The bound: 3 layers in float32 plus the embedding (~450 MB): the layer as stored and in float32, the merged
    # attention, the hidden states, allocator slack. Loading the model whole would be 5x that.
    assert grown < 3 * layer_fp32 + embedding, f"peak RSS grew by {grown / 1e6:.0f} MB (baseline {rss['baseline']})"
    assert whole_fp32 > 5 * (3 * layer_fp32 + embedding)

    files = sorted(p.name for p in dst.glob("*.safetensors"))  # 1.0 GB in 400 MB shards
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] and (dst / INDEX_NAME).exists()
    got = stored(dst)
    cfg, state = read_model(big)
    tok = load_tokenizer(big)
    _, want = convert_state(cfg, state, 2, "pca", _calibration_activations(cfg, state, tok, text.read_text()))
    del state
    assert got.keys() == want.keys()
    for name, t in want.items():
        if ".k_proj." in name or ".v_proj." in name or ".q_proj." in name or ".o_proj." in name:
            torch.testing.assert_close(got[name].float(), t.bfloat16().float(), atol=1e-6, rtol=0)
        else:
            assert torch.equal(got[name], t.bfloat16()), name
    assert got["model.layers.15.self_attn.v_proj.weight"].shape == (256, 1024)


# ---------------------------------------------------------------------------------------------------------------------
# Healing across processes equals healing in one


@pytest.mark.parametrize(("sharding", "train"), [("ddp", "attention"), ("fsdp", "attention+mlp-lora")])
def test_heal_on_two_gloo_processes_equals_one_process(sharding, train):
    from helpers import heal_workers
    from helpers.checkpoints import tiny_pair

    from gqa.parallel.distributed import launch_local

    teacher, student = tiny_pair()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (400,), generator=g)
    weights = torch.rand(400, generator=g) * 2  # the ranks' windows weigh differently: the global denominator counts
    kwargs = dict(steps=5, lr=3e-3, seq_len=16, batch_size=4, seed=1, precision="fp32", train=train)
    cfgs = (teacher.config, student.config)
    states = [{k: v.clone() for k, v in m.state_dict().items()} for m in (teacher, student)]
    one = heal_workers.heal_tiny(*states, cfgs, ids, weights, kwargs)
    two = launch_local(2, heal_workers.heal_tiny, *states, cfgs, ids, weights, kwargs | {"sharding": sharding})
    assert one["sharding"] == "none" and two[0]["sharding"] == two[1]["sharding"] == sharding
    for rank in (0, 1):
        torch.testing.assert_close(two[rank]["losses"], one["losses"], atol=1e-6, rtol=1e-5)
        assert two[rank]["lrs"] == one["lrs"]
        for name, t in one["state"].items():  # AdamW divides by the gradients' RMS: a ~0 gradient's float noise
            torch.testing.assert_close(two[rank]["state"][name], t, atol=1e-4, rtol=1e-4)  # shows, scaled to lr
    moved = max((one["state"][n] - states[1][n]).abs().max().item() for n in states[1])
    assert moved > 5e-3, moved  # 5 steps of lr 3e-3 moved the weights: agreeing to 1e-4 is not trivial
    if train != "attention":  # the adapters were folded into the MLP weights on every rank
        assert not torch.equal(one["state"]["model.layers.0.mlp.down_proj.weight"],
                               states[1]["model.layers.0.mlp.down_proj.weight"])  # fmt: skip
        assert set(two[0]["state"]) == set(states[1])
    if sharding == "ddp":
        with pytest.raises(Exception, match=r"batch_size \(3\) must be a multiple of the number of processes \(2\)"):
            launch_local(2, heal_workers.heal_tiny, *states, cfgs, ids, weights, kwargs | {"batch_size": 3})


@pytest.mark.parametrize("sharding", ["auto", "fsdp"])
def test_torchrun_convert_heals_data_parallel_and_rank_zero_writes(mha, tmp_path, sharding):
    text = tmp_path / "heal.txt"
    text.write_text(words(3000, seed=1))
    common = [str(mha), "--kv-heads", "2", "--method", "mean", "--heal-steps", "4", "--heal-batch", "2",
              "--heal-seq-len", "16", "--heal-lr", "3e-3", "--heal-text", str(text), "--heal-precision", "fp32",
              "--max-shard-size", "8KB"]  # fmt: skip
    env = dict(os.environ, GQA_DIST_TIMEOUT="120", OMP_NUM_THREADS="1")
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "gqa", "convert", *common[:1], str(tmp_path / "two"), *common[1:],
                          "--heal-sharding", sharding],
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    # rank 0 reports, once; by default half the steps are layer-local (every rank runs them, then rank 0's weights
    # are broadcast), the other half data-parallel end-to-end
    assert two.stdout.count("healed       2 steps") == two.stdout.count("layer-local  2 steps") == 1, two.stdout
    assert cli(["convert", common[0], str(tmp_path / "one"), *common[1:]]) == 0
    logs = [json.loads((tmp_path / d / "heal_log.json").read_text()) for d in ("one", "two")]
    assert (logs[0]["processes"], logs[1]["processes"]) == (1, 2)
    assert (logs[0]["sharding"], logs[1]["sharding"]) == ("none", "ddp" if sharding == "auto" else "fsdp")
    torch.testing.assert_close(logs[1]["losses"], logs[0]["losses"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(logs[1]["local"]["losses"], logs[0]["local"]["losses"], atol=1e-6, rtol=1e-5)
    one, two_ = stored(tmp_path / "one"), stored(tmp_path / "two")
    assert one.keys() == two_.keys() and all(t.dtype == torch.bfloat16 for t in two_.values())
    for name, t in one.items():
        torch.testing.assert_close(two_[name].float(), t.float(), atol=1e-2, rtol=0)  # bf16 roundings
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heal.txt", "one", "two"]  # no staging folders left


def test_auto_sharding_picks_fsdp_when_replicas_do_not_fit(monkeypatch):
    from helpers.checkpoints import tiny_pair

    from gqa.convert import healing

    teacher, student = tiny_pair()
    params = healing.trainable_parameters(student, "attention")
    weights = sum(p.numel() * 4 for m in (teacher, student) for p in m.parameters())
    optimizer = 3 * sum(p.numel() * 4 for p in params)
    need = weights + optimizer  # both models' weights, and the student's gradients and AdamW moments
    for memory, want in ((2 * need, False), (int(need / healing.FSDP_SHARE) + 8, False), (need, True)):
        monkeypatch.setattr(healing, "_device_memory", lambda device, world, m=memory: m)
        assert healing.fsdp_needed(student, teacher, params, torch.device("cpu"), 2) == want, memory
