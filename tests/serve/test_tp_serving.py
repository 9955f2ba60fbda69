"""``gqa serve --tp 2``: the embedded SmolLM2 over two tensor-parallel ranks (gloo, one thread each), talked to with
the official ``openai`` client, answering as one process does (the engine in this process at tp 1 is the
reference); and a rank killed mid-stream ends the server with 503s, a bounded exit and no process left behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from gqa import kernels  # noqa: E402
from gqa.cli.serve_tp import LOSS_GRACE_S  # noqa: E402
from tests.helpers.server_process import MODEL, Server, post  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.vectorized(), reason="native SIMD kernels not built on this machine")

PROMPTS = ["Name three planets of the solar system.", "What is the capital of France?", "Say hello in Spanish.",
           "Count from one to five."]  # fmt: skip
TOKENS = 12
POOL = "64"  # MiB: the same token slots at tp 1 and tp 2 (tp_start.agree_on_start)


def _server(*flags: str) -> Server:
    """``gqa serve --tp 2`` in float32 (a rank's partial sums of o_proj / down_proj round differently from one
    process's whole sums; in float32 the greedy text is the same, as these tests check); collectives time out in
    20 s."""
    saved = os.environ.get("GQA_DIST_TIMEOUT")
    os.environ["GQA_DIST_TIMEOUT"] = "20"
    try:
        return Server("--tp", "2", "--dtype", "fp32", "--max-running", "8", *flags, kv_cache_mib=POOL)
    finally:
        if saved is None:
            del os.environ["GQA_DIST_TIMEOUT"]
        else:
            os.environ["GQA_DIST_TIMEOUT"] = saved


@pytest.fixture(scope="module")
def llm():
    """The engine in this process (tp 1) on the same float32 weights and pool size."""
    from gqa.serve import LLM

    return LLM(dtype="fp32", kv_cache_mib=float(POOL))


@pytest.fixture(scope="module")
def reference(llm):
    """Each prompt's greedy chat answer, served alone at tp 1."""
    from gqa.serve import SamplingParams

    params = SamplingParams(max_tokens=TOKENS, temperature=0)
    return {p: llm.generate(p, params, chat=True)[0].text for p in PROMPTS}


@pytest.fixture(scope="module")
def server():
    s = _server()
    yield s
    assert s.stop() == 0  # SIGTERM: a graceful stop of every rank


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def _ask(client, prompt: str, **kw):
    kw = {"max_tokens": TOKENS, "temperature": 0} | kw
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kw)


def test_tp2_greedy_text_equals_tp1(client, reference):
    for prompt in PROMPTS[:2]:
        assert _ask(client, prompt).choices[0].message.content == reference[prompt]


def test_tp2_streams_the_same_text(client, reference):
    stream = _ask(client, PROMPTS[2], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reference[PROMPTS[2]]


def test_tp2_concurrent_requests_each_answer_as_alone(client, server, reference):
    """Eight requests at once (batched together, prompt chunks beside decode rows): each one's text is its text
    alone, the repeated prompts' blocks found in the prefix cache (rank 0's) and read from every rank's pool."""
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        answers[i] = _ask(client, PROMPTS[i % len(PROMPTS)]).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert answers == {i: reference[PROMPTS[i % len(PROMPTS)]] for i in range(8)}
    assert server.metrics()["gqa_prefix_cache_hits_total"] > 0


def test_tp2_client_that_leaves_mid_stream_does_not_break_the_next(client, reference):
    stream = _ask(client, PROMPTS[3], stream=True, max_tokens=200, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()  # the client disconnects: rank 0 aborts the request, every rank serves on
    assert _ask(client, PROMPTS[3]).choices[0].message.content == reference[PROMPTS[3]]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    """The ids of ``pid``'s child processes (/proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return out


def test_q8_0_cache_then_a_killed_rank_ends_the_server_with_503s(llm):
    """With ``--kv-cache-dtype q8_0`` each rank stores its KV heads as q8_0 blocks and the answer is one process's;
    then rank 1 is killed mid-stream: the stream ends with an error event, a request waiting gets 503 in OpenAI's
    shape, the server exits 1 within ``LOSS_GRACE_S`` (plus the shutdown) and no rank is left running."""
    from gqa.serve import LLM, SamplingParams

    one = LLM(llm.model, kv_cache_mib=float(POOL), kv_cache_dtype="q8_0")
    expected = one.generate(PROMPTS[0], SamplingParams(max_tokens=TOKENS, temperature=0), chat=True)[0].text
    server = _server("--kv-cache-dtype", "q8_0")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
        assert _ask(client, PROMPTS[0]).choices[0].message.content == expected
        ranks = [p for p in _children(server.proc.pid) if _alive(p)]
        assert len(ranks) >= 1  # rank 1 (and multiprocessing's resource tracker)
        stream = _ask(client, PROMPTS[1], stream=True, max_tokens=2000, extra_body={"ignore_eos": True})
        next(iter(stream))
        waiting: dict = {}
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
        thread = threading.Thread(target=lambda: waiting.update(r=post(server.url + "/v1/completions", body)))
        thread.start()
        time.sleep(0.5)
        killed = time.monotonic()
        for pid in ranks:
            with open(f"/proc/{pid}/cmdline") as f:
                if "resource_tracker" not in f.read():
                    os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError) as failure:
            for _ in stream:
                pass
        assert "engine is not running" in str(failure.value)
        thread.join(60)
        status, answer, _ = waiting["r"]
        assert status == 503 and answer["error"]["message"] and "type" in answer["error"]
        assert server.proc.wait(LOSS_GRACE_S + 30) == 1
        assert time.monotonic() - killed < LOSS_GRACE_S + 30
        deadline = time.monotonic() + 10  # multiprocessing's resource tracker ends once its last user has: soon after
        while [p for p in ranks if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in ranks if _alive(p)]
    finally:
        server.stop()


def test_a_rank_with_another_model_or_kv_cache_is_refused_at_start(monkeypatch):
    """Two ranks whose models differ in depth and whose KV caches differ in kind: the start fails at once, naming
    both differences (rank 0's values first)."""
    from gqa.parallel.distributed import DistributedError, launch_local
    from tests.helpers import tp_workers

    monkeypatch.setenv("GQA_DIST_TIMEOUT", "30")
    start = time.monotonic()
    with pytest.raises(DistributedError) as refused:
        launch_local(2, tp_workers.start_serving_shards, [2, 3], ["auto", "q8_0"])
    message = str(refused.value)
    assert "rank 1 was started with another model or settings than rank 0" in message
    assert "model.num_layers: 2 (rank 0) vs 3" in message and "kv_cache_dtype: fp32 (rank 0) vs q8_0" in message
    assert time.monotonic() - start < 30


@pytest.fixture
def one_rank_world():
    """A gloo process group of this process alone (a sharded model of one rank is the whole model)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("weights", ["bf16", "q4_0"])
def test_sharded_step_is_the_one_call_step_bit_for_bit_and_batch_invariant(one_rank_world, weights):
    """The sharded step's op-by-op layers at one rank give ``gqa::decode_paged``'s logits bit for bit (bfloat16: a
    prompt chunk of two sequences beside each other, then a decode row each), and a row's logits do not depend on the
    rows beside it (20 rows: past the few rows ``Linear`` gives the native kernel, where MKL's GEMM would sum
    otherwise) — with float weights and with the layers' weights as q4_0 blocks (``shard_model`` keeps them blocks,
    the projections run the quantized kernel, ``o_proj`` / ``down_proj`` all-reduce)."""
    import torch

    from gqa.decoding import native_step
    from gqa.kernels import ops
    from gqa.models import ModelConfig
    from gqa.models.llama import CausalLM
    from gqa.models.quantized import QuantizedLinear, install_quantized, quantize
    from gqa.parallel.tensor_parallel import ReducingQuantizedLinear, shard_model
    from gqa.serve.config import EngineConfig
    from gqa.serve.paged_cache import table_tensor
    from gqa.serve.runner import ModelRunner
    from gqa.serve.tp_runner import ShardStep, encode_plan

    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=2,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=256,
    )  # SmolLM2's widths, 2 layers
    torch.manual_seed(0)
    state = {k: v.bfloat16() for k, v in CausalLM(cfg).state_dict().items()}
    config = EngineConfig(kv_cache_mib=1, block_size=8)
    whole = CausalLM.from_state(cfg, state).bfloat16()
    if weights != "bf16":
        blocks = {k: quantize(v, weights) for k, v in state.items() if k.startswith("model.layers.") and v.ndim == 2}
        state |= blocks
        install_quantized(whole, blocks, torch.bfloat16)
    sharded_model = shard_model(cfg, state, dtype=torch.bfloat16).bfloat16()
    if weights != "bf16":
        layer = sharded_model.model.layers[0]
        assert type(layer.self_attn.q_proj) is QuantizedLinear and type(layer.mlp.down_proj) is ReducingQuantizedLinear
    step = ShardStep(sharded_model, config)

    @torch.inference_mode()
    def one_call(ids: list[int], positions: list[int], tables: list[list[int]], wanted: list[int]):
        P = torch.tensor(positions)
        (cos, sin), local = native_step.rope_rows(whole, P.view(-1, 1))
        x = whole.model.embed(torch.tensor(ids).view(-1, 1)).view(len(ids), -1)
        return ops.decode_paged(x, runner.weights, cos, sin, runner.cache.key, runner.cache.value, table_tensor(tables),
                                P, None, torch.tensor(wanted), local_rope=local)  # fmt: skip

    a, b = list(range(5, 19)), [7, 3, 9, 11, 2, 40]  # 14 + 6 prompt rows
    by_ops = ShardStep(sharded_model, config)
    by_ops.weights = None  # the op-by-op layers, on a pool of their own
    assert step.weights is not None  # the one call, reducing inside it
    for shard in (step, by_ops):
        runner = ModelRunner(whole, config)  # the reference on a fresh pool too
        rows = (a + b, list(range(14)) + list(range(6)), [[3, 4]] * 14 + [[6]] * 6, [13, 19])
        sharded, _ = shard.run(encode_plan(*rows), logits=True)
        assert torch.equal(sharded, one_call(*rows))
        rows = ([1, 2], [14, 6], [[3, 4], [6]], [0, 1])
        batched, _ = shard.run(encode_plan(*rows), logits=True)
        assert torch.equal(batched, one_call(*rows))
        alone, _ = shard.run(encode_plan([2], [6], [[6]], [0]), logits=True)  # the second row again, alone
        assert torch.equal(alone[0], batched[1])


@pytest.mark.parametrize("weights, kv", [("bf16", "auto"), ("q4_0", "auto"), ("bf16", "q8_0")])
def test_two_ranks_step_in_one_call_as_op_by_op(weights, kv):
    """At tp 2 the one native call (each layer's two all-reduces inside it, torch.distributed's gloo) gives the
    op-by-op sharded layers' logits bit for bit — float and block weights — over a vocabulary of 97 rows cut 49 + 48;
    over a q8_0 pool within bfloat16's rounding (the op-by-op layers read the blocks with ``gqa::decode_attention``,
    not the one call's reading)."""
    import torch

    from gqa.parallel.distributed import launch_local
    from tests.helpers import tp_workers

    ranks = launch_local(2, tp_workers.sharded_step_both_ways, weights, kv)
    assert ranks[0]["one_call"] and ranks[1]["one_call"]
    for fused, by_ops in zip(ranks[0]["fused"], ranks[0]["by_ops"], strict=True):
        assert fused.shape == (2, 97) and torch.isfinite(fused).all()
        if kv == "auto":
            assert torch.equal(fused, by_ops)
        else:
            torch.testing.assert_close(fused.float(), by_ops.float(), rtol=0.02, atol=0.15)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tp", "4"], "H_q=9 query heads and H_kv=3 KV heads over tp=4 ranks"),  # SmolLM2: 1, 3 or 9 work
        (["--tp", "0"], "--tp must be >= 1"),
        (["--tp", "2", "--prefix-cache-dir", "."], "--prefix-cache-dir does not work with --tp"),
    ],
)
def test_bad_tp_flags_are_refused_before_any_rank_starts(monkeypatch, capsys, flags, message):
    from gqa.cli import main as cli
    from gqa.cli import serve_tp

    monkeypatch.setattr(serve_tp, "start_local_ranks", lambda *a, **k: pytest.fail("a rank was started"))
    assert cli(["serve", *flags]) == 2
    assert message in capsys.readouterr().err
