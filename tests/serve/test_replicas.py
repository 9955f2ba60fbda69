"""``gqa serve --replicas 2``: two engines (one thread each) behind one front, talked to with the official ``openai``
client: each answer is the one engine's answer alone (an engine in this process is the reference), a repeated
system prompt goes to one replica and hits its prefix cache, distinct prompts spread, a stored response is found on
the replica that holds it; a replica killed mid-stream fails its request cleanly while the other keeps serving; the
last one killed ends the front with exit 1, no process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx2")

from gqa import kernels  # noqa: E402
from tests.helpers.server_process import MODEL, Server, free_port, get  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.vectorized(), reason="native SIMD kernels not built on this machine")

POOL = "48"  # MiB per replica
SYSTEM = ("You are the help desk of a small bicycle shop in Ghent. Answer in one short sentence, politely, and never "
          "invent prices. ") * 4  # fmt: skip
QUESTIONS = ["Do you repair tires?", "Are you open on Sunday?", "Can I rent a bike?", "Do you sell helmets?"]
DISTINCT = ["Name a planet.", "What is two plus two?", "Say hello in French.", "Name a colour."]
TOKENS = 10


@pytest.fixture(scope="module")
def server():
    s = Server("--replicas", "2", "--max-running", "8", kv_cache_mib=POOL)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def llm():
    from gqa.serve import LLM

    return LLM(kv_cache_mib=float(POOL))


def _health(server) -> dict:
    status, body = get(server.url + "/health")
    return {"status_code": status, **json.loads(body)}


def _by_replica(server, metric: str) -> dict[str, float]:
    out = {}
    for name, value in server.metrics().items():
        if name.startswith(metric + "{"):
            out[name.split('replica="')[1].split('"')[0]] = value
    return out


def _chat(system: str | None, question: str) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


def test_answers_equal_one_engine_alone(client, llm):
    from gqa.serve import SamplingParams

    params = SamplingParams(max_tokens=TOKENS, temperature=0)
    for question in DISTINCT[:2]:
        expected = llm.generate(question, params, chat=True)[0].text
        got = client.chat.completions.create(model=MODEL, messages=_chat(None, question), max_tokens=TOKENS,
                                             temperature=0)  # fmt: skip
        assert got.choices[0].message.content == expected
        stream = client.chat.completions.create(model=MODEL, messages=_chat(None, question), max_tokens=TOKENS,
                                                temperature=0, stream=True)  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_a_shared_system_prompt_stays_on_one_replica_and_hits_its_prefix_cache(server, client):
    sent_before = _by_replica(server, "gqa_replica_requests_total")
    hits_before = _by_replica(server, "gqa_prefix_cache_hits_total")
    for question in QUESTIONS:
        client.chat.completions.create(model=MODEL, messages=_chat(SYSTEM, question), max_tokens=2, temperature=0)
    sent = {k: v - sent_before[k] for k, v in _by_replica(server, "gqa_replica_requests_total").items()}
    hits = {k: v - hits_before.get(k, 0) for k, v in _by_replica(server, "gqa_prefix_cache_hits_total").items()}
    home = max(sent, key=sent.get)
    assert sent[home] == len(QUESTIONS), sent  # every one on the replica that saw the prompt first
    assert hits[home] >= (len(QUESTIONS) - 1) * 4, hits  # the system prompt's blocks read, not prefilled
    assert hits["all"] == sum(v for k, v in hits.items() if k != "all")
    assert _by_replica(server, "gqa_replica_prefix_routed_total")[home] >= len(QUESTIONS) - 1


def test_new_prompts_go_to_the_least_loaded_replica_holding_the_least_text(server, client):
    """After the shared system prompt's requests, its replica holds more text: new prompts, one at a time (both
    replicas idle), go to the other one; short prompts (under a chunk) to the one sent fewer."""
    routed = _by_replica(server, "gqa_replica_prefix_routed_total")
    before = _by_replica(server, "gqa_replica_requests_total")
    for question in DISTINCT:
        client.completions.create(model=MODEL, prompt=f"{question} Answer in one short sentence, please.",
                                  max_tokens=2, temperature=0)  # fmt: skip
    sent = {k: v - before[k] for k, v in _by_replica(server, "gqa_replica_requests_total").items() if k != "all"}
    home = max(before, key=before.get)  # the shared prompt's replica
    assert sent[home] == 0 and sum(sent.values()) == len(DISTINCT), (before, sent)
    assert _by_replica(server, "gqa_replica_prefix_routed_total") == routed
    totals = _by_replica(server, "gqa_replica_requests_total")
    for question in DISTINCT * 2:  # short: alternating toward equal totals
        client.completions.create(model=MODEL, prompt=question[:10], max_tokens=1, temperature=0)
    after = _by_replica(server, "gqa_replica_requests_total")
    gap = abs(after["0"] - after["1"])
    assert gap <= max(1, abs(totals["0"] - totals["1"]) - 2 * len(DISTINCT)), (totals, after)


def test_previous_response_id_finds_the_replica_holding_it(client):
    first = client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=6, temperature=0)
    for _ in range(3):  # whichever replica is picked, the stored response is found
        follow = client.responses.create(model=MODEL, input="And a vegetable?", previous_response_id=first.id,
                                         max_output_tokens=6, temperature=0)  # fmt: skip
        assert follow.status in ("completed", "incomplete")
    assert client.responses.retrieve(first.id).id == first.id


def test_a_replica_killed_mid_stream_fails_its_request_and_the_other_serves(server, client):
    health = _health(server)
    assert health["status"] == "ok" and all("pid" in r for r in health["replicas"])
    stream = client.chat.completions.create(model=MODEL, messages=_chat(None, "Tell me a long story about a fox."),
                                            max_tokens=400, temperature=0, stream=True)  # fmt: skip
    next(iter(stream))  # streaming: the request is on a replica now
    busy = [r for r in _health(server)["replicas"] if r["load"] > 0]
    assert len(busy) == 1
    os.kill(busy[0]["pid"], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    assert time.monotonic() - started < 30
    for question in DISTINCT:  # all on the replica left
        answer = client.completions.create(model=MODEL, prompt=question, max_tokens=2, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length")
    health = _health(server)
    assert health["status_code"] == 200 and health["status"] == "degraded"
    down = [r for r in health["replicas"] if r["state"] == "down"]
    assert [r["replica"] for r in down] == [busy[0]["replica"]]
    assert "exited" in down[0]["reason"] or "cannot be reached" in down[0]["reason"]
    assert _by_replica(server, "gqa_replica_up")[str(busy[0]["replica"])] == 0


def test_the_last_replica_killed_ends_the_front_with_exit_1(server):
    pids = [r["pid"] for r in _health(server)["replicas"]]
    for r in _health(server)["replicas"]:
        if r["state"] == "up":
            os.kill(r["pid"], signal.SIGKILL)
    server.proc.wait(60)
    assert server.proc.returncode == 1
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z"  # gone, or a zombie of the exited front


def test_two_torchrun_nodes_serve_one_replica_each(llm, tmp_path):
    """``torchrun --nnodes 2 --node-rank 0/1 -m gqa serve --replicas 2`` on one host (a rendezvous at 127.0.0.1):
    rank 0's front serves both replicas; stopping node 0 stops node 1's replica too."""
    from gqa.serve import SamplingParams

    port, master = free_port(), str(free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", master]
    args = ["-m", "gqa", "serve", "--replicas", "2", "--port", str(port), "--kv-cache-mib", POOL]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *common, "--node-rank", str(rank), *args],
                              stdout=subprocess.DEVNULL, stderr=logs[rank].open("w"), env=env)
             for rank in (0, 1)]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert all(n.poll() is None for n in nodes), [log.read_text()[-2000:] for log in logs]
            try:
                if get(url + "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        health = json.loads(get(url + "/health")[1])
        assert [r["state"] for r in health["replicas"]] == ["up", "up"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
        params = SamplingParams(max_tokens=TOKENS, temperature=0)
        for question in DISTINCT[:2]:
            got = client.chat.completions.create(model=MODEL, messages=_chat(None, question), max_tokens=TOKENS,
                                                 temperature=0)  # fmt: skip
            assert got.choices[0].message.content == llm.generate(question, params, chat=True)[0].text
        metrics = get(url + "/metrics")[1]
        assert 'gqa_replica_requests_total{replica="0"} 1' in metrics
        assert 'gqa_replica_requests_total{replica="1"} 1' in metrics
        nodes[0].send_signal(signal.SIGTERM)
        nodes[1].wait(60)  # its replica stops once the front has
        nodes[0].wait(60)
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.wait(10)


@pytest.mark.parametrize(
    ("flags", "world", "message"),
    [(["--replicas", "0"], None, "--replicas must be >= 1"), (["--replicas", "2"], "3", "world of 2 processes"),
     (["--replicas", "2", "--tp", "2"], "2", "--tp with --replicas under torchrun"),
     (["--replicas", "2", "--port", "70000"], None, "--port"),
     (["--replicas", "2", "--replica-balance", "-1"], None, "--replica-balance must be >= 0")],
)  # fmt: skip
def test_bad_replica_flags_exit_2_naming_the_flag(monkeypatch, capsys, flags, world, message):
    from gqa.cli import main

    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", world)
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err
