"""Functions the tensor-parallel tests run on every rank (``gqa.parallel.distributed.launch_local`` spawns the ranks,
so they live in an importable module). Each returns plain data for the test process to check."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gqa.parallel.tensor_parallel import ReducingLinear, shard_model


def run_cases(cases: list[dict], compiled: bool = False) -> list[dict]:
    """Per case (``cfg``, ``state`` of the whole model, ``ids (B, L)``, ``mask (B, L)``, ``prompts``): this rank's
    logits, padded logits, greedy tokens of the batched prompts, cache shapes and all-reduces per decoded token."""
    out = []
    for case in cases:
        cfg = case["cfg"]
        model = shard_model(cfg, case["state"])
        with torch.no_grad():
            logits = model(case["ids"])
            padded = model(case["ids"], attention_mask=case["mask"])
            caches = model.new_caches(len(case["prompts"]), 16)
            model(case["ids"][:, :3], caches=caches)
            ReducingLinear.calls = 0
            model(case["ids"][:, 3:4], caches=caches)
            per_token = ReducingLinear.calls
        step = None
        if compiled:
            step = torch.compile(lambda tok, c, m=model: m(tok, caches=c), fullgraph=True)
        tokens = model.generate(case["prompts"], max_new_tokens=8, step_fn=step)
        sampled = model.generate(case["prompts"], max_new_tokens=6, temperature=1.0)  # unseeded: ranks agree
        out.append({
            "rank": dist.get_rank(), "logits": logits, "padded": padded, "tokens": tokens, "sampled": sampled,
            "cache": [tuple(c.key.shape) for c in caches],
            "cache_bytes": sum(c.key.nbytes + c.value.nbytes for c in caches),
            "allreduces_per_token": per_token, "heads": (model.config.num_heads, model.config.num_kv_heads),
        })  # fmt: skip
    return out


def smollm2_greedy(prompt: str, tokens: int) -> str:
    """SmolLM2's greedy answer to a chat prompt, sharded over the world."""
    from gqa import load_model

    model = load_model(tensor_parallel=True, dtype=torch.float32)
    ids = model.tokenizer.apply_chat([{"role": "user", "content": prompt}])
    return model.tokenizer.decode(model.generate(ids, max_new_tokens=tokens))


def fail_on_rank_one(message: str) -> None:
    """Rank 1 raises; the others wait in a collective for it (until the launcher stops them)."""
    if dist.get_rank() == 1:
        raise ValueError(message)
    dist.all_reduce(torch.zeros(1))


def hf_tp_plan_logits(path: str, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """HF transformers' own tensor parallelism (``tp_plan="auto"``) running ``attn_implementation="gqa"``: this
    rank's logits and the (query, KV) head counts gqa's attention saw."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import gqa.integrations.hf

    name = gqa.integrations.hf.register()
    seen = set()
    real = gqa.integrations.hf.grouped_attention

    def counting(q, k, v, **kw):
        seen.add((q.shape[-3], k.shape[-3]))
        return real(q, k, v, **kw)

    gqa.integrations.hf.grouped_attention = counting
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto"), attn_implementation=name, dtype=torch.float32
    )
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return {"logits": logits, "heads": sorted(seen)}


def quantized_cache_runs(cases: list[tuple[str, object]]) -> list[dict]:
    """Per ``(model folder, kv_dtype)``: the model as ``load_model(tensor_parallel=True, kv_dtype=...)`` loads it on
    this rank (float32; outside a process group, the whole model): the greedy tokens of left-padded batched prompts
    and the decode step that made them, its caches' shapes and kinds, and the logits of a prompt and 3 decoded
    tokens."""
    from gqa import load_model

    out = []
    for path, kv in cases:
        model = load_model(
            path, tokenizer=False, tensor_parallel=dist.is_initialized(), kv_dtype=kv, dtype=torch.float32
        )
        steps: list = []
        tokens = model.generate([[5, 6, 7, 8, 9, 4], [9, 4]], max_new_tokens=12, eos_token_ids=[], on_step=steps.append)
        caches = model.new_caches(2, 24)
        ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3]])
        with torch.no_grad():
            logits = [model(ids, caches=caches)[:, -1]]
            for _ in range(3):
                logits.append(model(logits[-1].argmax(-1, keepdim=True), caches=caches)[:, -1])
        out.append({
            "tokens": tokens, "step": steps[0].name, "logits": torch.stack(logits, 1),
            "key": tuple(caches[0].key.shape), "value": tuple(caches[0].value.shape),
            "kinds": tuple(k.name for k in caches[0].kinds),
        })  # fmt: skip
    return out


def generate_checking_kv(ns: object, expected: tuple[str, str]) -> int:
    """``gqa generate``'s own rank function (``cli.generate.generate_text``) on this rank, its model's KV cache kinds
    recorded as it loads: 0 when they are ``expected`` (K, V), else 3."""
    from gqa.cli import generate
    from gqa.loaders import model as loader

    load, kinds = loader.load_model, []

    def recording(*args: object, **kwargs: object) -> torch.nn.Module:
        model = load(*args, **kwargs)
        kinds.append(tuple(k.name for k in model.new_caches(1, 1)[0].kinds))
        return model

    loader.load_model = recording
    try:
        code = generate.generate_text(ns)
    finally:
        loader.load_model = load
    return code if kinds == [expected] else 3


def start_serving_shards(layers: list[int], kv: list[str]) -> int:
    """Rank ``r`` builds a small random float32 model of ``layers[r]`` layers, shards it and starts a serving shard
    storing K/V as ``kv[r]`` (``serve.tp_runner.ShardStep``: the ranks compare their fingerprints): its pool's
    blocks."""
    from gqa.models import ModelConfig
    from gqa.models.llama import CausalLM
    from gqa.serve.config import EngineConfig
    from gqa.serve.tp_runner import ShardStep

    rank = dist.get_rank()
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=layers[rank], num_heads=4,
                      num_kv_heads=2, head_dim=32, max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    model = shard_model(cfg, CausalLM(cfg).state_dict())
    return ShardStep(model, EngineConfig(kv_cache_mib=1, kv_cache_dtype=kv[rank])).cache.num_blocks


def smollm2_quantized(ids: list[int], tokens: int) -> dict:
    """The embedded SmolLM2 as ``load_model(dtype="auto")`` keeps it (Q4_1 blocks; sharded over the world when there
    is one), its activations in float32: logits of ``ids``, greedy tokens, the weights' bytes by format and the module
    types of layer 0's projections."""
    from gqa import load_model
    from gqa.models.quantized import weight_bytes

    model = load_model(tensor_parallel=dist.is_initialized(), tokenizer=False).float()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    layer_bytes = sum(m.blocks.nbytes for layer in model.model.layers for m in layer.modules() if hasattr(m, "blocks"))
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]
    return {
        "logits": logits, "tokens": model.generate(ids, max_new_tokens=tokens), "bytes": weight_bytes(model),
        "layer_bytes": layer_bytes, "types": [type(m).__name__ for m in (attn.q_proj, attn.o_proj, mlp.down_proj)],
    }  # fmt: skip


def sharded_step_both_ways(weights: str, kv: str) -> dict:
    """A random bfloat16 model of SmolLM2's widths (2 layers, vocabulary 97: uneven slices), ``weights`` float or
    blocks, sharded over the world and served by ``ShardStep`` over a ``kv`` pool: the logits of a prompt chunk of two
    sequences, then a decode row each, by the one native call (the all-reduces inside it) and by the op-by-op layers
    on a second pool; whether the one call was taken."""
    from gqa.models import ModelConfig
    from gqa.models.llama import CausalLM
    from gqa.models.quantized import quantize
    from gqa.serve.config import EngineConfig
    from gqa.serve.tp_runner import ShardStep, encode_plan

    cfg = ModelConfig(vocab_size=97, hidden_size=576, intermediate_size=1536, num_layers=2, num_heads=9,
                      num_kv_heads=3, head_dim=64, max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    state = {k: v.bfloat16() for k, v in CausalLM(cfg).state_dict().items()}
    if weights != "bf16":
        state |= {k: quantize(v, weights) for k, v in state.items() if k.startswith("model.layers.") and v.ndim == 2}
    model = shard_model(cfg, state, dtype=torch.bfloat16).bfloat16()
    config = EngineConfig(kv_cache_mib=1, block_size=8, kv_cache_dtype=kv)
    fused, by_ops = ShardStep(model, config), ShardStep(model, config)
    took_one_call = fused.weights is not None
    by_ops.weights = None
    prompts = [*range(5, 19), 7, 3, 9, 11, 2, 40]  # 14 + 6 prompt rows
    plans = [(prompts, [*range(14), *range(6)], [[3, 4]] * 14 + [[6]] * 6, [13, 19]),
             ([1, 2], [14, 6], [[3, 4], [6]], [0, 1])]  # fmt: skip
    out = {"one_call": took_one_call, "fused": [], "by_ops": []}
    for plan in plans:
        for name, step in (("fused", fused), ("by_ops", by_ops)):
            got = step.run(encode_plan(*plan), logits=dist.get_rank() == 0)
            out[name].append(None if got is None else got[0])
    return out
