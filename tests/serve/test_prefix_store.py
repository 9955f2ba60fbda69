"""The prefix cache on disk: block files round-trip the pool's exact bytes (float and q8_0 pools), their key follows
what the bytes depend on, a damaged or foreign file is never used, the directory stays under its bound (least
recently used out first), a failed write leaves nothing; and with the real SmolLM2, a second engine on the same
directory prefills only what follows the stored blocks and answers the same text, as does a restarted gqa serve."""

from __future__ import annotations

import logging
import os
import re
import shutil
import struct

import numpy as np
import pytest
import torch

import gqa
from gqa import kernels
from gqa.serve import prefix_store
from gqa.serve.blocks import BlockManager, block_hash
from gqa.serve.config import EngineConfig
from gqa.serve.engine import Engine
from gqa.serve.paged_cache import PagedKVCache
from gqa.serve.prefix_disk import DiskPrefixCache, pool_fields, weights_fingerprint
from gqa.serve.prefix_store import PrefixStore
from gqa.serve.sampling import SamplingParams
from tests.helpers.serving import serve_all

LAYERS, H_KV, D, BLOCK = 2, 2, 32, 4


class Stub(torch.nn.Module):
    """What ``pool_fields`` reads of a model: weights, ``config``, ``dtype``, ``device``."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = torch.nn.Linear(256, 256).to(dtype)
        self.config = "stub"

    @property
    def dtype(self) -> torch.dtype:
        return self.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj.weight.device


def pool(kv_dtype: str | None = None, block_size: int = BLOCK, num_blocks: int = 16) -> PagedKVCache:
    return PagedKVCache(LAYERS, H_KV, D, num_blocks, block_size, kv_dtype=kv_dtype)


def disk_cache(directory, cache: PagedKVCache, gib: float = 1.0) -> DiskPrefixCache:
    return DiskPrefixCache.open(directory, gib, Stub(), cache, BlockManager(cache.num_blocks, cache.block_size))


def filled(disk: DiskPrefixCache, tokens: list[int]):
    """A table for ``tokens`` on ``disk``'s pool with random K/V written for all of them, marked computed."""
    table = disk.blocks.allocate(tokens)
    torch.manual_seed(len(tokens))
    for layer in range(LAYERS):
        k, v = torch.randn(2, H_KV, len(tokens), D)
        disk.cache.write(layer, table.blocks, 0, k, v)
    disk.blocks.computed(table, len(tokens))
    return table


def block_bytes(cache: PagedKVCache, block: int) -> list[bytes]:
    return [pool[block].view(torch.uint8).numpy().tobytes() for pool in cache.key + cache.value]


@pytest.mark.parametrize(("kv_dtype", "host"), [(None, True), ("q8_0", True), (None, False), ("q8_0", False)])
def test_blocks_round_trip_the_pools_bytes(tmp_path, kv_dtype, host):
    """Three full blocks saved from one pool and restored into a fresh one (another block manager: a restart) hold
    the same bytes, float or quantized, through the host pool's numpy views or torch's ops (a device pool's way);
    the prompt's last block is left to compute; held blocks go back."""
    tokens = list(range(100, 113))  # 13 tokens: 3 full blocks before the last token
    a = disk_cache(tmp_path, pool(kv_dtype))
    if not host:
        a._host = None
    table = filled(a, tokens)
    free = a.blocks.num_free
    assert a.save(table, len(tokens)) == 3
    assert a.save(table, len(tokens)) == 0  # queued already: not twice
    a.flush()
    assert a.writes == 3 and len(os.listdir(tmp_path)) == 3 and a.blocks.num_free == free  # given back
    b = disk_cache(tmp_path, pool(kv_dtype))
    if not host:
        b._host = None
    restored = b.blocks.allocate(tokens)
    assert b.restore(restored) == 3 and restored.cached_tokens == 12 and b.hits == 3
    for i in range(3):
        assert block_bytes(b.cache, restored.blocks[i]) == block_bytes(a.cache, table.blocks[i])
    assert b.blocks.allocate(tokens).cached_tokens == 12  # they joined the in-memory prefix cache
    assert b.save(restored, len(tokens)) == 0  # on disk already


def test_at_most_a_quarter_of_the_pool_is_held_for_writing(tmp_path):
    """A slow disk costs neither the pool's capacity nor stored blocks: two of eight blocks held at once, the third
    when they are written; a block reclaimed before its turn is not written."""
    a = disk_cache(tmp_path, pool(num_blocks=8))
    tokens = list(range(13))
    table = filled(a, tokens)
    assert a.save(table, 13) == 3 and a.blocks.refs[table.blocks[2]] == 1  # the third waits, not held
    a.flush()
    assert a.writes == 3 and all(a.blocks.refs[b] == 1 for b in table.blocks)
    b = disk_cache(tmp_path / "b", pool(num_blocks=8))
    table = filled(b, tokens)
    b.save(table, 13)
    b.blocks.free(table)
    b.blocks.allocate(list(range(100, 124)))  # all 6 free blocks: the third cached one is reclaimed, the held not
    b.flush()
    assert b.writes == 2 and len(b.store) == 2


def test_a_prompt_extending_a_stored_one_reads_its_blocks_and_stops_at_the_first_missing(tmp_path):
    a = disk_cache(tmp_path, pool())
    a.save(filled(a, list(range(9))), 9)  # blocks [0, 4), [4, 8)
    a.flush()
    b = disk_cache(tmp_path, pool())
    longer = b.blocks.allocate(list(range(9)) + [50] * 8)
    assert b.restore(longer) == 2 and longer.cached_tokens == 8
    other = b.blocks.allocate([7, *range(1, 9)])  # first block differs: nothing after it matches
    assert b.restore(other) == 0 and other.cached_tokens == 0


def test_the_key_follows_weights_dtype_kv_dtype_and_block_size(tmp_path):
    cache = pool()
    base = pool_fields(Stub(), cache)
    assert pool_fields(Stub(), cache) == base  # the same weights loaded again
    assert weights_fingerprint(Stub(seed=1)) != weights_fingerprint(Stub())
    others = [pool_fields(Stub(seed=1), cache), pool_fields(Stub(dtype=torch.bfloat16), cache),
              pool_fields(Stub(), pool("q8_0")), pool_fields(Stub(), pool(block_size=8))]  # fmt: skip
    h = block_hash(b"", [1, 2, 3, 4])
    names = {PrefixStore(tmp_path, 2**20, fields, 8).name(h) for fields in [base, *others]}
    assert len(names) == 5


def store(directory, tag: str = "a", max_bytes: int = 2**20) -> PrefixStore:
    return PrefixStore(directory, max_bytes, {"model": tag}, 64)


def payload(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 32, dtype=np.uint8), rng.integers(0, 256, 32, dtype=np.uint8)]


H1, H2, H3 = (block_hash(b"", [i] * 4) for i in range(3))


def test_write_read_round_trip_and_a_missing_block_is_a_quiet_miss(tmp_path, caplog):
    s = store(tmp_path)
    assert s.write(H1, payload(1))
    assert bytes(s.read(H1)) == b"".join(p.tobytes() for p in payload(1))
    assert s.read(H2) is None and not caplog.records
    with pytest.raises(ValueError, match="64 bytes"):
        s.write(H2, payload(1)[:1])


def damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "tampered":
        data[-40] ^= 1  # a payload byte
    elif how == "header":
        data = data.replace(b'"payload":64', b'"payload":65')
    elif how == "nested":  # a header json cannot parse without RecursionError (was: every running request failed)
        nested = b"[" * 20_000
        data = data[:8] + struct.pack("<I", len(nested)) + nested + bytes(68)
    elif how == "long":  # longer than any block file: never read into memory
        data += bytes(1 << 17)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("how", "reason"),
    [("truncated", "truncated"), ("tampered", "checksum mismatch"), ("header", "a header for another block"),
     ("nested", "an unreadable header (RecursionError)"), ("long", "the file changed while read or is too long")],
)  # fmt: skip
def test_a_damaged_file_is_ignored_with_one_warning_and_deleted(tmp_path, caplog, how, reason):
    s = store(tmp_path)
    s.write(H1, payload(1))
    path = tmp_path / s.name(H1)
    damage(path, how)
    with caplog.at_level(logging.WARNING, logger=prefix_store.__name__):
        assert s.read(H1) is None
        assert s.read(H1) is None
    assert [r.getMessage() for r in caplog.records] == [f"prefix cache: ignoring {path} ({reason}); deleted"]
    assert not path.exists() and len(s) == 0 and s.total_bytes == 0


def test_a_foreign_file_is_never_used(tmp_path, caplog):
    """Another model's file is not found under this model's key; copied there, its header gives it away."""
    mine, theirs = store(tmp_path / "mine", "a"), store(tmp_path / "theirs", "b")
    theirs.write(H1, payload(1))
    assert mine.read(H1) is None and not caplog.records
    shutil.copy(tmp_path / "theirs" / theirs.name(H1), tmp_path / "mine" / mine.name(H1))
    assert mine.read(H1) is None
    assert "written for another model or layout: model differ" in caplog.text
    garbage = tmp_path / "mine" / mine.name(H2)
    garbage.write_bytes(b"not a block" * 10)
    assert mine.read(H2) is None and "not a gqa KV block file" in caplog.text and not garbage.exists()


def test_the_size_bound_evicts_the_least_recently_used_and_survives_a_restart(tmp_path):
    s = store(tmp_path)
    s.write(H1, payload(1))
    size = s.total_bytes
    s = store(tmp_path, max_bytes=2 * size)
    s.write(H2, payload(2))
    assert s.read(H1) is not None  # H1 used more recently than H2 now
    s.write(H3, payload(3))
    assert s.total_bytes == 2 * size and H2 not in s and s.read(H2) is None
    assert sorted(os.listdir(tmp_path)) == sorted([s.name(H1), s.name(H3)])
    os.utime(tmp_path / s.name(H1), (1, 1))  # an older use, as a restart finds it
    again = store(tmp_path, max_bytes=size)
    assert os.listdir(tmp_path) == [s.name(H3)] and H3 in again
    assert not store(tmp_path, max_bytes=size - 1).write(H1, payload(1))  # one file over the bound: not written


def test_a_write_that_fails_midway_leaves_no_file(tmp_path, monkeypatch, caplog):
    """A disk that fills up mid-write: a warning, no block file and no temporary file left."""

    class Full:
        def __init__(self, f) -> None:
            self.f, self.written = f, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

        def write(self, data) -> int:
            self.written += memoryview(data).nbytes
            if self.written > 40:
                raise OSError(28, "No space left on device")
            return self.f.write(data)

    monkeypatch.setattr(prefix_store, "open", lambda path, mode: Full(open(path, mode)), raising=False)  # noqa: SIM115
    s = store(tmp_path)
    assert not s.write(H1, payload(1))
    assert "No space left on device" in caplog.text
    assert os.listdir(tmp_path) == [] and len(s) == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [({"prefix_cache_gib": 0}, "prefix_cache_gib must be a positive number, got 0"),
     ({"prefix_cache_gib": float("inf")}, "prefix_cache_gib must be a positive number"),
     ({"prefix_cache_dir": 5}, "prefix_cache_dir must be a path, got 5")],
)  # fmt: skip
def test_engine_config_names_a_bad_prefix_cache_setting(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**options)


@pytest.mark.skipif(not kernels.available(), reason="native kernels not built on this machine")
def test_a_tensor_parallel_shard_takes_no_prefix_cache(tmp_path):
    """Rank 0 holds its KV heads alone: its blocks on disk would restore those and leave the other ranks' stale, so
    the engine refuses the directory for a shard (the CLI refused it; the Python API did not)."""
    from gqa.models import CausalLM
    from gqa.models.config import ModelConfig
    from gqa.serve.engine import Engine

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=8, eos_token_id=[1])  # fmt: skip
    model = CausalLM(cfg).eval()
    Engine(model, kv_cache_mib=1, prefix_cache_dir=tmp_path / "one")  # a whole model: taken
    model.shard = object()  # what parallel.tensor_parallel puts on a rank's model
    with pytest.raises(ValueError, match="prefix_cache_dir does not take a tensor-parallel shard"):
        Engine(model, kv_cache_mib=1, prefix_cache_dir=tmp_path / "two")


def test_a_directory_that_cannot_be_one_is_refused_by_name(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"prefix_cache_dir .*file: not a directory"):
        store(tmp_path / "file")
    with pytest.raises(ValueError, match=r"prefix_cache_dir .*file/sub: Not a directory"):
        store(tmp_path / "file" / "sub")


# -- the engine, with the real model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    if not kernels.vectorized():
        pytest.skip("native SIMD kernels not built on this machine")
    return gqa.load_model(dtype="auto")


@pytest.mark.parametrize("kv_dtype", [None, "q8_0"])
def test_a_restarted_engine_prefills_only_what_follows_the_stored_blocks(smollm2, tmp_path, kv_dtype, caplog):
    """Engine A serves a 9-block prompt with a prefix directory and is dropped; engine B (fresh, same directory) reads
    the prompt's full blocks from disk, computes only the tokens after them, and answers the same greedy text. A
    tampered block makes engine C stop reading there (one warning) and compute the rest: still the same text."""
    prompt = smollm2.tokenizer.apply_chat("Tell me about the history of Rome, in detail and in order. " * 8)
    size, params = 16, SamplingParams(max_tokens=6)
    stored = (len(prompt) - 1) // size
    assert stored >= 6

    def serve() -> tuple[Engine, list[int], int]:
        engine = Engine(smollm2, smollm2.tokenizer, kv_cache_mib=16, block_size=size, prefix_cache_dir=tmp_path,
                        kv_cache_dtype=kv_dtype)  # fmt: skip
        rows, forward = [], engine.runner.forward
        engine.runner.forward = lambda work: rows.append(sum(e - s for _, s, e in work)) or forward(work)
        tokens = serve_all(engine, [prompt], params)[0]
        engine.close()
        return engine, tokens, sum(rows) - (len(tokens) - 1)  # prompt rows fed: every row less the decode steps'

    a, text_a, prefilled = serve()
    assert prefilled == len(prompt) and a.stats().prefix_cache_disk_writes == stored
    b, text_b, prefilled = serve()
    assert b.stats().prefix_cache_disk_hits == stored and prefilled == len(prompt) - stored * size
    assert text_b == text_a and b.stats().prefix_cache_disk_writes == 0
    hashes = [b""]
    for i in range(stored):
        hashes.append(block_hash(hashes[-1], prompt[i * size : (i + 1) * size]))
    damage(tmp_path / b.disk.store.name(hashes[5]), "tampered")  # the 5th block: 4 are read before it
    with caplog.at_level(logging.WARNING, logger=prefix_store.__name__):
        c, text_c, prefilled = serve()
    assert c.stats().prefix_cache_disk_hits == 4 and prefilled == len(prompt) - 4 * size
    assert text_c == text_a and caplog.text.count("checksum mismatch") == 1
    assert c.stats().prefix_cache_disk_writes == 1  # the damaged block, computed again


def test_a_restarted_server_reads_the_prompt_from_disk_and_answers_the_same(tmp_path):
    """``gqa serve --prefix-cache-dir``, stopped and started again: the second server's first request reads the
    prompt's full blocks from disk (``/metrics``) and its greedy answer (the openai client) is the first one's."""
    openai = pytest.importorskip("openai")
    from tests.helpers.server_process import MODEL, Server

    prompt = "".join(f"Note {i}: the archive keeps record {i} about the river and the mill. " for i in range(24))
    answers, hits = [], []
    for _ in range(2):
        s = Server("--prefix-cache-dir", str(tmp_path), "--max-running", "2")
        try:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=60, max_retries=0)
            answers.append(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0))
            hits.append(s.metrics()["gqa_prefix_cache_disk_hits_total"])
        finally:
            assert s.stop() == 0  # a clean stop: the blocks still queued are written first
    full = (answers[0].usage.prompt_tokens - 1) // 16
    assert hits == [0, full] and len(os.listdir(tmp_path)) == full > 10
    assert answers[1].choices[0].text == answers[0].choices[0].text
