"""The shared-prefix workload of ``gqa bench serve --routing``: what routing by prefix buys a server of replicas.

Four long system prompts (``SYSTEMS``, about 300 words, ~410 tokens each, a help desk's instructions for four
products), and ``--prompts`` requests, each one of them (drawn at random, seeded) with a question of its own, sent by
the largest ``--clients`` count at once: the traffic of an API whose few applications each send their own
instructions first. Served by one engine with ``--kv-cache-mib``, then by ``--replicas`` engines of ``--kv-cache-mib /
N`` each (the same memory) under each ``--routing`` policy. Per run: the prefix cache's hit rate (prompt blocks read
rather than computed, over the full prompt blocks of the requests admitted, from the server's ``/metrics``), output
tok/s, time to first token, and every response compared with the one engine's.
"""

from __future__ import annotations

import argparse
import random
import sys

from .serve_clients import TOPICS, ServerProcess, free_port, load, server_argv

__all__ = ["SYSTEMS", "routing_rows", "system_prompts"]

PRODUCTS = ("a cargo bicycle", "a home espresso machine", "a robot lawn mower", "an electric kettle")
RULES = (
    "Greet the customer once and answer the question they asked, not another one.",
    "Say which part of the {} the answer is about before giving it.",
    "Never promise a delivery date, a refund or a repair price; offer to open a ticket instead.",
    "If the customer mentions smoke, sparks or a burning smell, tell them to unplug the {} and stop using it.",
    "Keep answers under sixty words, in plain language, without lists.",
    "When the question is about the warranty, say it lasts two years from the date on the receipt.",
    "Spare parts for the {} are ordered through the shop that sold it, never directly from the factory.",
    "Cleaning instructions: a damp cloth only, no solvents, no dishwasher, for every part of the {}.",
)


def system_prompts(words: int) -> list[str]:
    """Four system prompts of about ``words`` words each (a help desk's rules for each of ``PRODUCTS``)."""
    out = []
    for product in PRODUCTS:
        lines = [f"You are the help desk of the company that makes {product}."]
        i = 0
        while sum(len(line.split()) for line in lines) < words:
            lines.append(f"Rule {i + 1}: " + RULES[i % len(RULES)].format(product))
            i += 1
        out.append("\n".join(lines))
    return out


SYSTEMS = system_prompts(300)  # ~410 tokens each


def routing_rows(ns: argparse.Namespace, replicas: int, policies: list[str]) -> list[dict]:
    """One engine, then ``replicas`` replicas under each of ``policies``, on the shared-prefix workload."""
    clients = max(ns.clients)
    order = random.Random(0)  # the applications' requests interleave at random: no routing gets them sorted by chance
    systems = [SYSTEMS[order.randrange(len(SYSTEMS))] for _ in range(ns.prompts)]
    questions = [f"Question {i}: what should I know about {TOPICS[i % len(TOPICS)]} with it?" for i in
                 range(ns.prompts)]  # fmt: skip
    rows, reference = [], None
    for tag, count, policy in [("one engine", 1, None)] + [(f"{replicas} replicas, {p} routing", replicas, p)
                                                           for p in policies]:  # fmt: skip
        settings = argparse.Namespace(**{**vars(ns), "gqa_replicas": count, "gqa_routing": policy or "prefix",
                                         "kv_cache_dtype": ns.kv_cache_dtype})  # fmt: skip
        port = free_port()
        server = ServerProcess(server_argv("gqa", ns.model, settings, port, ns.kv_cache_mib / count), port,
                               ns.out / f"routing, {tag}.log")  # fmt: skip
        try:
            before = server.metrics()
            result = load(port, server.model, questions, clients, ns.max_tokens, systems=systems)
            after = server.metrics()
            row = {"engine": "gqa", "tag": f"shared prefixes: {tag}", "kv_cache": ns.kv_cache_dtype,
                   "peak_rss_mib": server.peak_rss_mib(), "loads": [result]}  # fmt: skip
        finally:
            server.stop()
        hits = after["gqa_prefix_cache_hits_total"] - before.get("gqa_prefix_cache_hits_total", 0)
        queries = after["gqa_prefix_cache_queries_total"] - before.get("gqa_prefix_cache_queries_total", 0)
        row["prefix_hit_rate"] = hits / queries if queries else float("nan")
        row["preemptions"] = after.get("gqa_preemptions_total", 0)
        texts = result.pop("texts")
        reference = reference or texts
        result["differ_from_alone"] = None
        row["differ_from_one_engine"] = sum(a != b for a, b in zip(reference, texts, strict=True))
        print(f"[bench serve] shared prefixes, {tag}: prefix-cache hit rate {row['prefix_hit_rate']:.3f} "
              f"({int(hits)}/{int(queries)} blocks), {result['tok_s']:.1f} tok/s, TTFT p50 "
              f"{result['ttft_p50_ms']:.0f} ms, {row['differ_from_one_engine']} responses differ from one engine's",
              file=sys.stderr, flush=True)  # fmt: skip
        rows.append(row)
    return rows
