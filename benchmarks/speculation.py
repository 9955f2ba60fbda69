"""Prompt-lookup speculation (``gqa serve --speculate K``) on one stream: tokens per second with and without drafts,
side by side in one run, on requests that copy their context and on requests that do not.

    python benchmarks/speculation.py [--speculate 15] [--rounds 3] [--max-tokens 160] [--model PATH]

Each request is served alone through the serving engine (``gqa.serve.LLM``, greedy, the embedded SmolLM2 unless
``--model``), alternating the two engines each round; per request the median tok/s of the rounds, the ratio, the draft
tokens accepted, whether the tokens are identical (they must be: greedy verification is exact), and the share of the
response copied from its prompt (``copied``): the geometric mean over copy-heavy responses counts the requests whose
response did copy, whatever it was asked.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from gqa.serve import LLM, SamplingParams

TEXT = (
    "The water cycle describes how water evaporates from oceans and lakes, rises into the atmosphere, cools and "
    "condenses into clouds, and falls back to the surface as rain or snow. Rivers carry the water back to the sea, "
    "where the cycle begins again. Plants also release water vapour through their leaves, a process called "
    "transpiration, and some water soaks into the ground, where it can stay for thousands of years."
)
CODE = """def mean(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total = total + (v - m) * (v - m)
    return total / len(values)
"""
COPYING = {
    "repeat": f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    "spelling": "Fix the spelling mistakes in this text and return the whole corrected text:\n\n"
    + TEXT.replace("water", "watter").replace("the", "teh"),
    "code": f"Add a docstring to each function below and return the whole code:\n\n{CODE}",
    "rename": f"Rewrite this code with the variable 'total' renamed to 'acc'. Return the whole code.\n\n{CODE}",
    "replace": f"Replace every 'water' with 'H2O' in this text and return the whole text:\n\n{TEXT}",
    "email": "Fix the grammar in this email and return it:\n\nHi Tom, I wanted to let you knows that the meeting have "
    "been moved to thursday at 3pm. Please bring the report that we was discussing last week, and tell the others team "
    "members. Thanks, Anna",
}
COPY_HEAVY = 0.5  # a response is copy-heavy when at least this share of its tokens is copied from its prompt
FREE = {
    # about the given text, in the model's own words (SmolLM2's answers open like the text, then part from it)
    "summary": f"Summarise this text in one sentence:\n\n{TEXT}",
    "title": f"Suggest a title for this text:\n\n{TEXT}",
    "poem": "Write a short poem about the sea.",
    "explain": "Explain how a bicycle stays upright.",
    "story": "Tell me a story about a dragon who loves books.",
}


def copied(prompt: list[int], tokens: list[int], n: int = 4) -> float:
    """The share of ``tokens`` that lie in a run of ``n`` tokens also found in ``prompt``: what the response copied
    (a request that asks for a copy may still get none: SmolLM2-135M answers "repeat this text" in its own words)."""
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    inside = [False] * len(tokens)
    for i in range(len(tokens) - n + 1):
        if tuple(tokens[i : i + n]) in grams:
            inside[i : i + n] = [True] * n
    return sum(inside) / max(1, len(tokens))


def serve(llm: LLM, prompt: str, max_tokens: int) -> tuple[list[int], float, int, int, float]:
    """One request alone: its tokens, tok/s, the draft tokens verified and accepted for it, and the share of its
    tokens copied from the prompt."""
    before = llm.engine.stats()
    start = time.perf_counter()
    c = llm.generate(prompt, SamplingParams(max_tokens=max_tokens), chat=True)[0]
    seconds = time.perf_counter() - start
    after = llm.engine.stats()
    drafted = after.draft_tokens - before.draft_tokens
    taken = after.draft_tokens_accepted - before.draft_tokens_accepted
    return c.token_ids, len(c.token_ids) / seconds, drafted, taken, copied(c.prompt_ids, c.token_ids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--speculate", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    ns = parser.parse_args()
    plain, drafting = LLM(ns.model, kv_cache_mib=64), LLM(ns.model, kv_cache_mib=64, speculate=ns.speculate)
    for llm in (plain, drafting):
        llm.generate("Hello", SamplingParams(max_tokens=8), chat=True)  # warm-up
    rows = []
    for kind, prompts in (("copies", COPYING), ("free", FREE)):
        for name, prompt in prompts.items():
            speeds: dict[str, list[float]] = {"plain": [], "draft": []}
            for _ in range(ns.rounds):
                base, tps, _, _, share = serve(plain, prompt, ns.max_tokens)
                speeds["plain"].append(tps)
                tokens, tps, drafted, taken, _ = serve(drafting, prompt, ns.max_tokens)
                speeds["draft"].append(tps)
            a, b = statistics.median(speeds["plain"]), statistics.median(speeds["draft"])
            rows.append((kind, name, len(base), share, a, b, b / a, drafted, taken, tokens == base))
            print(f"[speculation] {kind} {name}: {a:.1f} -> {b:.1f} tok/s ({b / a:.2f}x), {share:.0%} copied, "
                  f"{taken}/{drafted} drafts accepted, identical: {tokens == base}",
                  file=sys.stderr, flush=True)  # fmt: skip
    print(
        f"`python benchmarks/speculation.py --speculate {ns.speculate} --rounds {ns.rounds} --max-tokens "
        f"{ns.max_tokens}` (medians of {ns.rounds} alternating rounds)\n"
    )
    print("| request | asked to | tokens | copied | plain tok/s | --speculate tok/s | ratio | draft tokens accepted "
          "| identical |\n|---|---|---:|---:|---:|---:|---:|---:|---|")  # fmt: skip
    for kind, name, n, share, a, b, ratio, drafted, taken, same in rows:
        print(f"| {name} | {'copy' if kind == 'copies' else 'write'} | {n} | {share:.0%} | {a:.1f} | {b:.1f} | "
              f"{ratio:.2f}x | {taken}/{drafted} | {same} |")  # fmt: skip
    groups = {
        f"copy-heavy responses (>= {COPY_HEAVY:.0%} copied)": [r for r in rows if r[3] >= COPY_HEAVY],
        "asked to copy": [r for r in rows if r[0] == "copies"],
        "the others": [r for r in rows if r[0] == "free"],
        "drafts, none accepted": [r for r in rows if r[7] > 0 and r[8] == 0],
    }
    for group, members in groups.items():
        if members:
            mean = statistics.geometric_mean([r[6] for r in members])
            print(f"\n{group}: geometric mean ratio {mean:.2f}x ({', '.join(r[1] for r in members)})", end="")
    print()
    return 0 if all(r[9] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
