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

    model = load_model(tensor_parallel=True)
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
