"""Several models behind one ``gqa serve``: the embedded SmolLM2 and a tiny random Qwen2, each loaded on its first
request and unloaded for the other (``--max-loaded 1``), talked to with the official ``openai`` client; the router
with stand-in models (no weights) for its waits and drains; the LRU/budget policy alone; the CLI's flags."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
try:  # the HTTP client the openai client is built on (httpx2 for openai 3), for its in-process ASGI transport
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")

from gqa import kernels  # noqa: E402
from gqa.serve.loaded_models import LoadedModels  # noqa: E402
from gqa.serve.model_router import Loaded, ModelRouter, ServedModel, merged_metrics  # noqa: E402
from tests.helpers.checkpoints import WORDS, tiny_dir  # noqa: E402
from tests.helpers.server_process import Server, get, post  # noqa: E402

needs_kernels = pytest.mark.skipif(not kernels.vectorized(), reason="native SIMD kernels not built on this machine")
TINY_VOCAB = 3 + len(WORDS)  # every token the tiny model can choose has its text
PROMPTS = {"smol": "The three primary colours are", "tiny": [3, 4, 5, 6]}


def tiny(folder: Path, arch: str = "qwen2") -> Path:
    return tiny_dir(folder, arch=arch, heads=4, kv=2, head_dim=16, vocab_size=TINY_VOCAB)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    from gqa.loaders import default_model_path

    return {"smol": str(default_model_path()), "tiny": str(tiny(tmp_path_factory.mktemp("models") / "tiny"))}


@pytest.fixture(scope="module")
def server(paths):
    s = Server("--model", paths["smol"], "--model", paths["tiny"], "--served-model-name", "smol",
               "--served-model-name", "tiny", "--max-loaded", "1", kv_cache_mib=None)  # fmt: skip
    yield s
    assert s.stop() == 0


def rss_mib(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024


def offline(path: str, prompt: str | list[int], n: int) -> str:
    """The model's greedy completion by the serving engine without a server (``LLM``), loaded here."""
    from gqa.serve.offline import LLM
    from gqa.serve.sampling import SamplingParams

    return LLM(path).generate(prompt, SamplingParams(max_tokens=n, temperature=0))[0].text


@needs_kernels
def test_two_models_alternate_under_max_loaded_1_and_answer_as_each_alone(server, paths):
    """tiny, smol, tiny, smol with room for one: each request loads its model and unloads the other; every answer is
    the model's own greedy answer (the same engine without a server), the same token logprobs after a reload, and
    the unload gives SmolLM2's memory back (the server's RSS falls back to what the tiny model alone took)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    answers, rss = [], []
    for name in ("tiny", "smol", "tiny", "smol"):
        r = client.completions.create(model=name, prompt=PROMPTS[name], max_tokens=6, temperature=0, logprobs=0)
        assert r.model == name and r.choices[0].finish_reason == "length"
        answers.append((r.choices[0].text, r.choices[0].logprobs.token_logprobs))
        rss.append(rss_mib(server.proc.pid))
    assert answers[0] == answers[2] and answers[1] == answers[3]  # a reload answers exactly as the first load
    assert answers[0][0] == offline(paths["tiny"], PROMPTS["tiny"], 6) and answers[0][0]
    assert answers[1][0] == offline(paths["smol"], PROMPTS["smol"], 6)
    m = server.metrics()
    for name in ("smol", "tiny"):
        assert m[f'gqa_model_loads_total{{model="{name}"}}'] == 2
    assert m['gqa_model_unloads_total{model="tiny"}'] == 2 and m['gqa_model_unloads_total{model="smol"}'] == 1
    assert m['gqa_model_loaded{model="smol"}'] == 1 and m['gqa_model_loaded{model="tiny"}'] == 0
    smol = m['gqa_model_bytes{model="smol"}'] / 2**20  # its weights and KV pool: ~275 MiB
    assert smol > 200 and m['gqa_generation_tokens_total{model="smol"}'] == 6  # the inner metrics, labelled
    # SmolLM2 loaded adds most of its bytes; unloaded, they go back (the tiny model takes next to nothing)
    assert rss[1] - rss[0] > 0.6 * smol and rss[3] - rss[2] > 0.6 * smol, (rss, smol)
    assert rss[2] - rss[0] < 0.25 * smol, (rss, smol)


def test_the_models_are_listed_and_an_unknown_one_is_a_404_naming_them(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"smol", "tiny"} and all(isinstance(c.model_extra["loaded"], bool) for c in cards.values())
    with pytest.raises(openai.NotFoundError, match=r"'llama-70b' does not exist; this server has \['smol', 'tiny'\]"):
        client.chat.completions.create(model="llama-70b", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    status, body, _ = post(server.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and body["error"]["param"] == "model" and "['smol', 'tiny']" in body["error"]["message"]
    status, body, _ = post(server.url + "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, text = get(server.url + "/health")
    assert status == 200 and set(json.loads(text)["models"]) == {"smol", "tiny"}


def test_a_stream_through_the_router_equals_the_whole_answer(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    whole = client.completions.create(model="smol", prompt=PROMPTS["smol"], max_tokens=6, temperature=0)
    chunks = client.completions.create(model="smol", prompt=PROMPTS["smol"], max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


# -- the CLI ---------------------------------------------------------------------------------------------------------


def gqa_serve(capsys, *args: str) -> tuple[int, str]:
    from gqa.cli import main

    try:
        code = main(["serve", *args])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (("--max-loaded", "0"), "--max-loaded must be >= 1, got 0"),
        (("--max-loaded", "two"), "argument --max-loaded: invalid int value: 'two'"),
        (("--max-loaded-gib", "0"), "--max-loaded-gib must be a positive number of GiB, got 0.0"),
        (("--max-loaded-gib", "nan"), "--max-loaded-gib must be a positive number of GiB, got nan"),
        (("--models-dir", "/nonexistent"), "--models-dir /nonexistent: no such folder"),
        (("--model", "{tiny}", "--model", "/nonexistent.gguf"), "--model /nonexistent.gguf: no such file or folder"),
        (("--model", "{tiny}", "--model", "{tiny}"), "two models are named 'tiny'"),
        (("--model", "{tiny}", "--model", "{tiny2}", "--served-model-name", "a"),
         "--served-model-name: given 1 time(s) for 2 --model"),
        (("--models-dir", "{root}", "--model", "{tiny}"), "two models are named 'tiny'"),
        (("--models-dir", "{empty}"), "holds no .gguf file and no HF folder"),
        # refused at start, not at every request once the server is up (several models load on demand)
        (("--model", "{tiny}", "--model", "{tiny2}", "--kv-cache-dtype-k", "fp8"),
         "--kv-cache-dtype-k fp8_e4m3 is read by the CUDA kernels only"),
        (("--model", "{tiny}", "--model", "{tiny2}", "--kv-cache-dtype", "fp16"),
         "--kv-cache-dtype fp16 differs from the model's dtype"),
        (("--model", "{tiny}", "--model", "{tiny2}", "--max-body-mib", "inf"),
         "--max-body-mib must be a positive number of MiB, got inf"),
        (("--model", "{tiny}", "--model", "{tiny2}", "--kv-cache-mib", "inf"),
         "--kv-cache-mib must be a positive number of MiB, got inf"),
        (("--model", "{tiny}", "--chat-template", "{blank}"), "the file is empty"),
        (("--model", "{tiny}", "--port", "{busy}"), "cannot listen on 127.0.0.1:{busy}"),
    ],
)  # fmt: skip
def test_bad_model_flags_exit_2_naming_the_flag(capsys, tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    for name in ("tiny", "tiny2"):  # config.json alone: the flags are checked before anything loads
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "blank.jinja").write_text(" \n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        folders = {"tiny": tmp_path / "tiny", "tiny2": tmp_path / "tiny2", "root": tmp_path,
                   "empty": tmp_path / "empty", "blank": tmp_path / "blank.jinja",
                   "busy": taken.getsockname()[1]}  # fmt: skip
        code, err = gqa_serve(capsys, *(a.format(**folders) for a in args))
    message = message.format(**folders)
    assert code == 2 and message in err and "Traceback" not in err, err


@needs_kernels
@pytest.mark.parametrize("bound,loads", [(("--max-loaded", "2"), 1), (("--max-loaded-gib", "1e-6"), 3)])
def test_two_loaded_models_switch_without_a_reload(tmp_path, bound, loads):
    """``--models-dir`` with two tiny models (the CLI's own app, in this process), alternating: with room for both
    (``--max-loaded 2``) each loads once and switching loads nothing; with a budget neither fits in, each request
    unloads the other (a model over the budget is served alone); the answers stay the same either way."""
    from gqa.cli import build_parser
    from gqa.cli.serve import serving_app

    tiny(tmp_path / "qwen")
    tiny(tmp_path / "llama", arch="llama")
    ns = build_parser().parse_args(["serve", "--models-dir", str(tmp_path), *bound])
    router = serving_app(ns)

    async def go() -> tuple[list[str], str]:
        transport = httpx.ASGITransport(app=router)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            client = openai.AsyncOpenAI(base_url="http://router/v1", api_key="unused", http_client=http, max_retries=0)
            try:
                texts = []
                for name in ("qwen", "llama") * 3:
                    r = await client.completions.create(model=name, prompt=[3, 4], max_tokens=4, temperature=0)
                    texts.append(r.choices[0].text)
                metrics = (await http.get("/metrics")).text
            finally:
                await router.close()
        return texts, metrics

    texts, metrics = asyncio.run(go())
    assert texts[0::2] == [texts[0]] * 3 and texts[1::2] == [texts[1]] * 3
    for name in ("qwen", "llama"):
        assert f'gqa_model_loads_total{{model="{name}"}} {loads}' in metrics, metrics
    assert f'gqa_model_unloads_total{{model="llama"}} {loads - 1}' in metrics  # the last one stays


# -- the router with stand-in models ---------------------------------------------------------------------------------


class Engine:
    alive = True


def standin(name: str, log: list[str], load_seconds: float = 0.0, hold: asyncio.Event | None = None) -> ServedModel:
    """A model that takes ``load_seconds`` to load (on the loading thread) and answers ``{"model": name}`` to any
    POST (after ``hold`` is set, when given); ``log`` records its loads and its app's startups and shutdowns."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def answer(request):
        if hold is not None:
            await hold.wait()
        return JSONResponse({"model": name, "body": await request.json()})

    async def stored(request):  # a response this model stored: "r-<name>"
        rid = request.path_params["rid"]
        return JSONResponse({"id": rid, "model": name}, status_code=200 if rid == f"r-{name}" else 404)

    def load() -> Loaded:
        time.sleep(load_seconds)
        log.append(f"load {name}")

        @asynccontextmanager
        async def lifespan(app):
            log.append(f"start {name}")
            yield
            log.append(f"stop {name}")

        routes = [Route("/v1/chat/completions", answer, methods=["POST"]), Route("/v1/responses/{rid}", stored)]
        app = Starlette(routes=routes, lifespan=lifespan)
        return Loaded(app, Engine(), 100)

    return ServedModel(load, 100)


def run_router(router: ModelRouter, requests) -> list[httpx.Response]:
    """``requests`` (coroutine functions of an httpx client) at once against ``router``; their responses."""

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://router") as http:
            try:
                return await asyncio.gather(*(r(http) for r in requests))
            finally:
                await router.close()

    return asyncio.run(go())


def chat(model: str, delay: float = 0.0):
    async def send(http: httpx.AsyncClient) -> httpx.Response:
        await asyncio.sleep(delay)
        return await http.post("/v1/chat/completions", json={"model": model, "messages": []})

    return send


def test_requests_for_a_model_being_loaded_wait_for_that_one_load():
    log: list[str] = []
    router = ModelRouter({"a": standin("a", log, 0.3), "b": standin("b", log)}, LoadedModels(max_loaded=1))
    responses = run_router(router, [chat("a"), chat("a", 0.05), chat("a", 0.1)])
    assert [r.json()["model"] for r in responses] == ["a"] * 3
    assert log == ["load a", "start a", "stop a"]  # one load; its app stopped when the router closed


def test_requests_for_two_models_at_once_with_room_for_one_are_all_served_without_ping_pong():
    """A load's waiting requests are served before a load of the other model may unload it (else each load would
    unload the other before its requests ran, and none would be served)."""
    log: list[str] = []
    router = ModelRouter({"a": standin("a", log, 0.05), "b": standin("b", log, 0.05)}, LoadedModels(max_loaded=1),
                         load_wait=5)  # fmt: skip
    responses = run_router(router, [chat(name) for name in "abababab"])
    assert [r.json()["model"] for r in responses] == list("abababab")
    assert log.count("load a") == 1 and log.count("load b") == 1, log


def test_a_running_request_finishes_before_its_model_is_unloaded():
    """``--max-loaded 1``: b's request waits until a's running request has finished, then a stops and b loads."""
    log: list[str] = []
    hold = asyncio.Event()
    router = ModelRouter({"a": standin("a", log, hold=hold), "b": standin("b", log)}, LoadedModels(max_loaded=1))

    async def release(http: httpx.AsyncClient) -> None:
        await asyncio.sleep(0.3)
        log.append("a's request may finish")
        hold.set()

    a, b, _ = run_router(router, [chat("a"), chat("b", 0.1), release])
    assert a.json()["model"] == "a" and b.json()["model"] == "b"
    assert log == ["load a", "start a", "a's request may finish", "stop a", "load b", "start b", "stop b"]


def test_a_load_that_takes_too_long_is_a_503_and_a_failed_one_a_500():
    def broken() -> Loaded:
        raise ValueError("--chat-template: this model has no tokenizer")

    log: list[str] = []
    models = {"slow": standin("slow", log, 0.5), "broken": ServedModel(broken, 1)}
    router = ModelRouter(models, LoadedModels(), load_wait=0.1)
    slow, later, failed = run_router(router, [chat("slow"), chat("slow", 0.6), chat("broken", 0.7)])
    assert slow.status_code == 503 and slow.headers["retry-after"] == "1"
    assert "the model 'slow' is still loading" in slow.json()["error"]["message"]
    assert failed.status_code == 500 and "no tokenizer" in failed.json()["error"]["message"]
    assert later.json()["model"] == "slow" and log.count("load slow") == 1  # the load went on for the next request


def test_a_request_without_a_body_goes_to_the_loaded_models_until_one_knows_it():
    router = ModelRouter({"a": standin("a", []), "b": standin("b", []), "c": standin("c", [])}, LoadedModels())

    def fetch(rid: str, delay: float):
        async def send(http: httpx.AsyncClient) -> httpx.Response:
            await asyncio.sleep(delay)
            return await http.get(f"/v1/responses/{rid}")

        return send

    none, *_, a, b, unknown = run_router(router, [fetch("r-a", 0), chat("a", 0.05), chat("b", 0.1), fetch("r-a", 0.2),
                                                  fetch("r-b", 0.2), fetch("r-x", 0.2)])  # fmt: skip
    assert none.status_code == 404 and "no model is loaded; this server has ['a', 'b', 'c']" in none.text
    assert (a.status_code, a.json()["model"]) == (200, "a") and (b.status_code, b.json()["model"]) == (200, "b")
    assert unknown.status_code == 404 and router.counts["c"].loads == 0  # c was never loaded for it


def test_the_api_key_is_asked_before_the_models_are_named():
    router = ModelRouter({"a": standin("a", []), "b": standin("b", [])}, LoadedModels(), api_key="k")

    async def unknown(http: httpx.AsyncClient) -> httpx.Response:
        return await http.post("/v1/chat/completions", json={"model": "x"})

    async def listed(http: httpx.AsyncClient) -> httpx.Response:
        return await http.get("/v1/models", headers={"Authorization": "Bearer k"})

    async def one(http: httpx.AsyncClient) -> httpx.Response:
        return await http.get("/v1/models/b", headers={"Authorization": "Bearer k"})

    async def missing(http: httpx.AsyncClient) -> httpx.Response:
        return await http.get("/v1/models/x", headers={"Authorization": "Bearer k"})

    async def unasked(http: httpx.AsyncClient) -> httpx.Response:
        return await http.get("/v1/models/b")

    async def stored(http: httpx.AsyncClient) -> httpx.Response:  # no model loaded: would 404, naming the models
        return await http.get("/v1/responses/resp_1")

    anonymous, cards, card, absent, nameless, unnamed = run_router(router, [unknown, listed, one, missing, unasked,
                                                                            stored])  # fmt: skip
    assert unnamed.status_code == 401 and "'a'" not in unnamed.text
    assert anonymous.status_code == 401 and "x" not in anonymous.text
    assert [c["id"] for c in cards.json()["data"]] == ["a", "b"]
    assert card.status_code == 200 and card.json()["id"] == "b" and card.json()["loaded"] is False
    assert absent.status_code == 404 and absent.json()["error"]["code"] == "model_not_found"
    assert nameless.status_code == 401


# -- the policy alone ------------------------------------------------------------------------------------------------


def test_the_least_recently_used_go_first_until_the_new_model_fits():
    loaded = LoadedModels(max_loaded=2)
    loaded.add("a", 10)
    loaded.add("b", 10)
    assert loaded.to_unload("c", 10) == ["a"]
    loaded.touch("a")  # a request for a: b is the least recently used now
    assert loaded.to_unload("c", 10) == ["b"] and loaded.to_unload("a", 10) == []  # a loaded model fits as it is
    budget = LoadedModels(max_bytes=100)
    for name, size in (("a", 30), ("b", 30), ("c", 30)):
        budget.add(name, size)
    assert budget.to_unload("d", 10) == [] and budget.to_unload("d", 20) == ["a"]
    assert budget.to_unload("d", 71) == ["a", "b", "c"] and budget.to_unload("d", 500) == ["a", "b", "c"]
    budget.remove("b")
    assert budget.names == ["a", "c"] and budget.nbytes == 60 and budget.nbytes_of("b") == 0
    both = LoadedModels(max_loaded=3, max_bytes=100)
    both.add("a", 80)
    both.add("b", 5)
    both.add("c", 5)
    assert both.to_unload("d", 1) == ["a"] and both.to_unload("d", 15) == ["a"] and both.to_unload("b", 90) == ["a"]


@pytest.mark.parametrize("kw", [{"max_loaded": 0}, {"max_loaded": True}, {"max_bytes": -1}, {"max_bytes": 1.5}])
def test_bad_bounds_are_refused_by_name(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        LoadedModels(**kw)


def test_merged_metrics_label_each_model_and_keep_one_header_per_metric():
    text = "# HELP gqa_x things\n# TYPE gqa_x gauge\ngqa_x 1\n"
    text += '# HELP gqa_y y\n# TYPE gqa_y counter\ngqa_y{kind="k"} 2\n'
    out = merged_metrics({"a": text, 'b"2': text.replace(" 1\n", " 3\n")})
    assert out.splitlines() == [
        "# HELP gqa_x things", "# TYPE gqa_x gauge", 'gqa_x{model="a"} 1', 'gqa_x{model="b\\"2"} 3',
        "# HELP gqa_y y", "# TYPE gqa_y counter", 'gqa_y{model="a",kind="k"} 2', 'gqa_y{model="b\\"2",kind="k"} 2',
    ]  # fmt: skip
