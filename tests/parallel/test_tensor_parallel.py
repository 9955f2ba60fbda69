"""Tensor parallelism: head layouts, and sharded models on several gloo processes against HF transformers and the
single-process model; SmolLM2 through ``gqa generate --tp 3`` and two torchrun "nodes"; failures that end a launch.

The multi-process tests start real processes (``gqa.parallel.distributed.launch_local``, torchrun); they are kept few
and small (one launch per world size runs every case for it) and every process group has a 60 s timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from gqa import kernels
from gqa.models import ModelConfig
from gqa.parallel.tensor_parallel import check_tp, head_layout, rank_shard, rank_weight_bytes, shard_state, working_tp

transformers = pytest.importorskip("transformers")

from helpers import tp_workers  # noqa: E402 - after the skip: the workers import nothing optional, but only these tests use them

TIMEOUT = "60"


@pytest.fixture(autouse=True)
def _short_timeout(monkeypatch):
    monkeypatch.setenv("GQA_DIST_TIMEOUT", TIMEOUT)


# --- layouts (no processes) ---


@pytest.mark.parametrize(
    "H_q, H_kv, tp, expected",
    [
        (4, 4, 2, [(range(0, 2), range(0, 2), 1), (range(2, 4), range(2, 4), 1)]),
        (9, 3, 2, [(range(0, 6), range(0, 2), 1), (range(6, 9), range(2, 3), 1)]),  # uneven: 6 q + 2 kv, 3 q + 1 kv
        (9, 3, 3, [(range(3 * r, 3 * r + 3), range(r, r + 1), 1) for r in range(3)]),
        (4, 1, 2, [(range(0, 2), range(0, 1), 2), (range(2, 4), range(0, 1), 2)]),  # MQA: the KV head on both ranks
        (8, 2, 4, [(range(2 * r, 2 * r + 2), range(r // 2, r // 2 + 1), 2) for r in range(4)]),  # replicated
        (
            18,
            6,
            4,
            [
                (range(0, 6), range(0, 2), 1),
                (range(6, 12), range(2, 4), 1),
                (range(12, 15), range(4, 5), 1),
                (range(15, 18), range(5, 6), 1),
            ],
        ),
    ],
)
def test_head_layout(H_q, H_kv, tp, expected):
    layout = head_layout(H_q, H_kv, tp)
    assert layout == expected
    G = H_q // H_kv
    assert sorted(h for q, _, _ in layout for h in q) == list(range(H_q))  # every query head on exactly one rank
    for q, kv, _ in layout:
        assert all(h // G in kv for h in q)  # a rank holds the KV head each of its query heads reads


@pytest.mark.parametrize(
    "H_q, H_kv, tp, works",
    [
        (8, 2, 3, "1, 2, 4, 8"),
        (9, 3, 4, "1, 2, 3, 9"),
        (4, 1, 3, "1, 2, 4"),
        (6, 2, 8, "1, 2, 6"),
        (4, 4, 5, "1, 2, 3, 4"),
    ],
)
def test_bad_layouts_name_heads_tp_and_what_works(H_q, H_kv, tp, works):
    with pytest.raises(ValueError) as e:
        check_tp(H_q, H_kv, tp)
    assert f"H_q={H_q}" in str(e.value) and f"H_kv={H_kv}" in str(e.value) and f"tp={tp}" in str(e.value)
    assert str(e.value).endswith(f"tp values that work: {works}")
    assert working_tp(H_q, H_kv) == [int(t) for t in works.split(", ")]


def test_layout_argument_errors():
    with pytest.raises(TypeError, match="tp must be an int"):
        check_tp(4, 2, True)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        check_tp(4, 2, 0)
    with pytest.raises(ValueError, match="rank must be in"):
        rank_shard(ModelConfig(num_heads=4, num_kv_heads=2, intermediate_size=8), 2, 2)


def test_shard_state_slices_and_bytes():
    """Each rank's slices, put back together in rank order, are the whole tensors (replicated KV heads once)."""
    cfg, state, _ = _hf_case("llama", 9, 3)
    D = cfg.head_dim
    shards = [shard_state(cfg, state, rank_shard(cfg, 2, r)) for r in range(2)]
    assert [(c.num_heads, c.num_kv_heads, c.intermediate_size) for c, _ in shards] == [(6, 2, 20), (3, 1, 20)]
    name = "model.layers.1.self_attn."
    torch.testing.assert_close(torch.cat([s[name + "q_proj.weight"] for _, s in shards]), state[name + "q_proj.weight"])
    torch.testing.assert_close(
        torch.cat([s[name + "o_proj.weight"] for _, s in shards], 1), state[name + "o_proj.weight"]
    )
    assert shards[1][1][name + "k_proj.weight"].shape == (D, cfg.hidden_size)
    mlp = "model.layers.0.mlp.down_proj.weight"
    torch.testing.assert_close(torch.cat([s[mlp] for _, s in shards], 1), state[mlp])
    for vocab in ("model.embed_tokens.weight", "lm_head.weight"):  # 61 rows: 31 + 30
        assert [s[vocab].shape[0] for _, s in shards] == [31, 30]
        torch.testing.assert_close(torch.cat([s[vocab] for _, s in shards]), state[vocab], rtol=0, atol=0)
    norm = "model.norm.weight"
    assert shards[0][1][norm] is state[norm] and shards[1][1][norm] is state[norm]  # replicated, not copied
    total = sum(t.numel() for t in state.values()) * 2
    per_rank = [rank_weight_bytes(cfg, state, rank_shard(cfg, 2, r), torch.bfloat16) for r in range(2)]
    replicated = sum(t.numel() for n, t in state.items() if "norm" in n) * 2
    assert sum(per_rank) == total + replicated  # the sharded parts add up; the replicated ones count on each rank


# --- sharded models on gloo processes ---


def _hf_case(arch: str, H_q: int, H_kv: int, tied: bool = False, seed: int = 0):
    """A random HF model: its config as gqa reads it, its state dict (HF names), and the model."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=61, hidden_size=8 * H_q, intermediate_size=40, num_hidden_layers=2, num_attention_heads=H_q,
              num_key_value_heads=H_kv, head_dim=8, max_position_embeddings=64, tie_word_embeddings=tied,
              initializer_range=0.15)  # fmt: skip
    config = transformers.LlamaConfig(**kw) if arch == "llama" else transformers.Qwen2Config(**kw)
    model_cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    hf = model_cls(config).eval()
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return ModelConfig.from_hf(config.to_dict()), state, hf


def _cases(specs):
    cases, refs = [], []
    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    for arch, H_q, H_kv, tied in specs:
        cfg, state, hf = _hf_case(arch, H_q, H_kv, tied)
        with torch.no_grad():
            hf_logits = hf(ids).logits
        cases.append({"cfg": cfg, "state": state, "ids": ids, "mask": mask, "prompts": [[5, 6, 7, 8], [9, 10]]})
        refs.append(hf_logits)
    return cases, refs


def _single_process(case):
    from gqa.models import CausalLM

    model = CausalLM.from_state(case["cfg"], case["state"])
    with torch.no_grad():
        padded = model(case["ids"], attention_mask=case["mask"])
    return model, padded, model.generate(case["prompts"], max_new_tokens=8)


@pytest.mark.parametrize(
    "tp, specs",
    [
        (2, [("llama", 4, 4, False), ("llama", 4, 1, True), ("qwen2", 9, 3, False)]),  # even, MQA, uneven + biases
        (3, [("llama", 9, 3, True), ("qwen2", 4, 4, False)]),  # one group each; 2+1+1 KV heads
        (4, [("llama", 8, 2, False)]),  # KV heads replicated on 2 ranks each
    ],
)
def test_sharded_model_matches_hf_and_one_process(tp, specs):
    from gqa.parallel.distributed import launch_local

    cases, hf_logits = _cases(specs)
    results = launch_local(tp, tp_workers.run_cases, cases, tp == 2)  # tp=2 decodes through a compiled step
    for i, case in enumerate(cases):
        cfg = case["cfg"]
        _, padded, tokens = _single_process(case)
        for rank in range(tp):
            got = results[rank][i]
            torch.testing.assert_close(got["logits"], hf_logits[i], atol=1e-4, rtol=1e-4)
            real = case["mask"].bool()
            torch.testing.assert_close(got["padded"][real], padded[real], atol=1e-4, rtol=1e-4)
            assert got["tokens"] == tokens  # greedy, batched, left-padded: identical to one process
            assert got["sampled"] == results[0][i]["sampled"]  # unseeded sampling: every rank drew the same
            shard = rank_shard(cfg, tp, rank)
            assert got["heads"] == (len(shard.q_heads), len(shard.kv_heads))
            assert got["cache"] == [(2, len(shard.kv_heads), 16, cfg.head_dim)] * cfg.num_layers  # only its heads
            assert got["cache_bytes"] == 2 * 2 * len(shard.kv_heads) * 16 * cfg.head_dim * 4 * cfg.num_layers
            assert got["allreduces_per_token"] == 2 * cfg.num_layers + 1  # o_proj, down_proj; the embedding


@pytest.fixture(scope="module")
def kv32_folders(tmp_path_factory):
    """Random Llama checkpoints whose head dim (32) takes quantized KV caches: 8 query / 2 KV heads (one KV head a
    rank at tp=2) and 4 / 1 (MQA: the KV head replicated on both ranks)."""
    from helpers.checkpoints import tiny_dir

    root = tmp_path_factory.mktemp("tp-kv")
    return str(tiny_dir(root / "gqa", heads=8, kv=2, head_dim=32)), str(tiny_dir(root / "mqa", heads=4, kv=1,
                                                                                   head_dim=32))  # fmt: skip


def test_sharded_model_with_a_quantized_cache_decodes_as_one_process(kv32_folders):
    """``load_model(tensor_parallel=True, kv_dtype=...)`` at tp=2: each rank's caches hold its KV heads as blocks,
    and the greedy tokens (batched, left-padded) and logits are the single process's with the same cache (float32:
    the two ranks' partial sums add up to the one process's within rounding, and the blocks they write are the same;
    in bf16 the two-part all-reduce rounds differently, float cache or not). The ranks decode in the one native call,
    as one process does: it reads the blocks where they lie and all-reduces each layer's partial products inside."""
    from gqa.parallel.distributed import launch_local

    gqa_dir, mqa_dir = kv32_folders
    cases = [(gqa_dir, "q8_0"), (gqa_dir, ("q8_0", "q4_0")), (mqa_dir, "q4_0")]
    ranks = launch_local(2, tp_workers.quantized_cache_runs, cases)
    one = tp_workers.quantized_cache_runs(cases)
    (plain,) = tp_workers.quantized_cache_runs([(gqa_dir, "auto")])
    rows = {"q8_0": 34, "q4_0": 18}  # bytes of a 32-value block
    for i, (_, kv) in enumerate(cases):
        k, v = kv if isinstance(kv, tuple) else (kv, kv)
        for rank in range(2):
            got = ranks[rank][i]
            assert got["kinds"] == one[i]["kinds"] == (k, v)
            assert got["key"] == (2, 1, 24, rows[k]) and got["value"] == (2, 1, 24, rows[v])  # its one KV head
            assert got["tokens"] == one[i]["tokens"]
            torch.testing.assert_close(got["logits"], one[i]["logits"], atol=1e-5, rtol=1e-5)
            assert got["step"] == one[i]["step"] == ("native" if kernels.vectorized() else "eager")
    # the blocks change the logits far beyond that tolerance: a rank holding a float cache would not pass
    assert (one[0]["logits"] - plain["logits"]).abs().max() > 1e-3


def test_generate_tp2_passes_the_kv_cache_dtype_to_every_rank(kv32_folders):
    """``gqa generate --tp 2 --kv-cache-dtype-k q8_0 --kv-cache-dtype-v q4_0``: every rank's model (loaded by the
    command's own rank function) holds a q8_0 K and a q4_0 V cache."""
    import argparse
    import functools

    from gqa.cli import generate
    from gqa.cli.parallel import run_on_ranks

    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    argv = ["the cat sat", "--raw", "--model", kv32_folders[0], "--dtype", "fp32", "--tp", "2", "--max-new-tokens",
            "3", "--kv-cache-dtype-k", "q8_0", "--kv-cache-dtype-v", "q4_0"]  # fmt: skip
    check = functools.partial(tp_workers.generate_checking_kv, expected=("q8_0", "q4_0"))
    assert run_on_ranks(parser.parse_args(argv), check) == 0  # 3 from a rank whose caches are otherwise


def test_failing_rank_ends_the_launch_with_its_message():
    from gqa.parallel.distributed import DistributedError, launch_local

    start = time.perf_counter()
    with pytest.raises(DistributedError, match=r"rank 1 of 2 failed: ValueError: no such thing"):
        launch_local(2, tp_workers.fail_on_rank_one, "no such thing")
    assert time.perf_counter() - start < float(TIMEOUT)  # the launcher stops the waiting rank: no timeout needed


def test_bad_layout_refused_before_any_process(monkeypatch, tmp_path, capsys):
    """H_q=8, H_kv=2 at tp=3: ``gqa generate --tp 3`` refuses from config.json alone (there are no weights to
    read): nothing is launched, no process group made."""
    import json

    import torch.distributed as dist

    from gqa.cli import main as cli
    from gqa.cli import parallel

    cfg = ModelConfig(num_heads=8, num_kv_heads=2, hidden_size=32, head_dim=8, intermediate_size=40, num_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    monkeypatch.setattr(parallel, "launch_local", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(parallel, "launched_world", lambda *a, **k: pytest.fail("process group"))
    assert cli(["generate", "hi", "--model", str(tmp_path), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "H_q=8 query heads and H_kv=2 KV heads over tp=3 ranks" in err and "tp values that work: 1, 2, 4, 8" in err
    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: the same check, before init_process_group
    assert cli(["generate", "hi", "--model", str(tmp_path), "--tp", "3"]) == 2
    assert "--tp 3 differs from torchrun's world size 2" in capsys.readouterr().err


# --- SmolLM2, from the command line ---


@pytest.fixture(scope="module")
def smollm2_answer():
    """The single-process greedy answer (32 tokens) of the embedded SmolLM2 to a question."""
    import gqa

    model = gqa.load_model(dtype=torch.float32)
    tok = model.tokenizer
    ids = tok.apply_chat([{"role": "user", "content": PROMPT}])
    new = model.generate(ids, max_new_tokens=32)
    return tok.decode([t for t in new if t not in tok.eos_token_ids])


PROMPT = "Name three planets of the solar system."


def _env():
    return os.environ | {"GQA_DIST_TIMEOUT": TIMEOUT, "OMP_NUM_THREADS": "1"}


def test_smollm2_generate_tp3_from_the_cli(smollm2_answer):
    """``gqa generate --tp 3``: three local ranks, one SmolLM2 KV head each: the same 32 greedy tokens."""
    run = subprocess.run(
        [sys.executable, "-m", "gqa", "generate", PROMPT, "--tp", "3", "--max-new-tokens", "32"],
        capture_output=True, text=True, env=_env(), timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == smollm2_answer.strip()
    assert run.stderr.count("Loading") == 1  # rank 0 alone talks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_on_localhost(smollm2_answer):
    """``torchrun --nnodes 2 --node-rank 0/1`` (one process each, static rendezvous at 127.0.0.1): the 2-rank
    SmolLM2 (one rank with 2 KV heads, one with 1) answers as one process does."""
    port = str(_free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port]
    args = ["-m", "gqa", "generate", PROMPT, "--max-new-tokens", "12"]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *common, "--node-rank", str(rank), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for rank in (0, 1)
    ]
    outs = [node.communicate(timeout=240) for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [e[-2000:] for _, e in outs]
    assert smollm2_answer.startswith(outs[0][0].strip()) and len(outs[0][0].strip()) > 10
    assert outs[1][0] == ""  # rank 1 prints nothing


def test_hf_tp_plan_auto_runs_gqa_attention(tmp_path):
    """transformers' own ``tp_plan="auto"`` (DistributedConfig) on 2 gloo ranks with ``attn_implementation="gqa"``:
    each rank's attention sees its 4 query heads and 1 KV head, and the logits are the single-process model's."""
    from gqa.parallel.distributed import launch_local

    _, _, hf = _hf_case("llama", 8, 2)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(3, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
    results = launch_local(2, tp_workers.hf_tp_plan_logits, str(tmp_path), ids, mask)
    for rank in (0, 1):
        assert results[rank]["heads"] == [(4, 1)]
        real = mask.bool()
        torch.testing.assert_close(results[rank]["logits"][real], expected[real], atol=1e-5, rtol=1e-5)


# --- gqa info --tp and gqa bench model --tp ---


def test_info_tp_table(tmp_path, capsys):
    """8 query / 2 KV heads at tp=4: every rank shows 2 query heads and 1 KV head held on 2 ranks, and the bytes."""
    from helpers.checkpoints import tiny_dir

    from gqa.cli import main as cli

    folder = tiny_dir(tmp_path / "m")  # 8 query, 2 KV heads of 4 dims, hidden 24, MLP 40, 2 layers, tied
    assert cli(["info", "--model", str(folder), "--tp", "4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3 |") or "| 0 |" in line]
    # rank 0: q_proj 8x24, k/v 4x24, o 24x8, MLP 3 x 10x24, 2 norms of 24, per layer; 8 of the tied embeddings' 32
    # rows, the final norm
    per_layer = 8 * 24 + 2 * 4 * 24 + 24 * 8 + 3 * 10 * 24 + 2 * 24
    weights = 2 * per_layer + 8 * 24 + 24
    kv_per_token = 2 * 2 * 1 * 4 * 4  # K and V, 2 layers, 1 KV head, 4 dims, fp32
    assert (
        rows[0] == f"| 0 | 2 (0-1) | 1 (0), on 2 ranks | 10 | 0-7 | {weights * 4 / 1024:.1f} KiB | {kv_per_token} B |"
    )
    assert rows[-1].startswith("| 3 | 2 (6-7) | 1 (1), on 2 ranks | 10 | 24-31 |")
    assert cli(["info", "--model", str(folder), "--tp", "3"]) == 2
    assert "tp values that work: 1, 2, 4, 8" in capsys.readouterr().err


def test_bench_model_tp(kv32_folders, tmp_path):
    """``gqa bench model --tp 1 2 --kv-cache-dtypes auto q8_0``: a result per (KV cache type, tp) with every rank's
    heads and bytes (a q8_0 cache's counted in the rank's caches: 34 bytes per 32 values against float32's 128), and
    all-reduce shares."""
    import json

    from gqa.cli import main as cli

    out = tmp_path / "tp.json"
    argv = ["bench", "model", "--model", kv32_folders[0], "--tp", "1", "2", "--dtypes", "fp32", "--kv-cache-dtypes",
            "auto", "q8_0", "--contexts", "8", "--new-tokens", "3", "--json", str(out), "--markdown",
            str(tmp_path / "tp.md")]  # fmt: skip
    assert cli(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["kv_dtype"], r["tp"], len(r["ranks"])) for r in results] == [
        ("fp32", 1, 1), ("fp32", 2, 2), ("q8_0", 1, 1), ("q8_0", 2, 2)
    ]  # fmt: skip
    one, two = results[0]["ranks"][0], results[1]["ranks"]
    assert one["heads"] == [8, 2] and [r["heads"] for r in two] == [[4, 1], [4, 1]]
    assert one["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads of 32 values, float32
    assert [r["kv_bytes_per_token"] for r in two] == [one["kv_bytes_per_token"] // 2] * 2
    q8_one, q8_two = results[2]["ranks"][0], results[3]["ranks"]
    assert q8_one["kv_bytes_per_token"] * 128 == one["kv_bytes_per_token"] * 34
    assert [r["kv_bytes_per_token"] for r in q8_two] == [q8_one["kv_bytes_per_token"] // 2] * 2
    assert all(r["weight_bytes"] < one["weight_bytes"] for r in two)
    assert 0 < two[0]["rows"][0]["allreduce_share"] < 1 and two[0]["rows"][0]["decode_tok_s"] > 0
    md = (tmp_path / "tp.md").read_text()
    assert "| fp32 | fp32 | 2 | 8 |" in md and "| fp32 | q8_0 | 2 | 8 |" in md


def test_bad_tp_flags_and_timeout_are_clear_errors(monkeypatch, capsys):
    """``--tp 0``, a non-positive ``GQA_DIST_TIMEOUT`` and ``--tp`` with options it does not take: errors naming
    them, before any process is started."""
    from gqa.cli import main as cli
    from gqa.cli import parallel
    from gqa.parallel.distributed import timeout_seconds

    monkeypatch.setattr(parallel, "launch_local", lambda *a, **k: pytest.fail("launched"))
    assert cli(["generate", "hi", "--tp", "0"]) == 2
    assert "--tp must be >= 1, got 0" in capsys.readouterr().err
    for bad in ("0", "-5", "soon"):
        monkeypatch.setenv("GQA_DIST_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"GQA_DIST_TIMEOUT must be a positive number of seconds, got '{bad}'"):
            timeout_seconds()
    monkeypatch.setenv("GQA_DIST_TIMEOUT", "12.5")
    assert timeout_seconds() == 12.5
    with pytest.raises(SystemExit):
        cli(["bench", "model", "--tp", "1", "2", "--kv-heads", "1"])
    assert "--plot, --kv-heads and --engines do not apply" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["bench", "model", "--tp", "0"])
    assert "--tp must be positive, got [0]" in capsys.readouterr().err
