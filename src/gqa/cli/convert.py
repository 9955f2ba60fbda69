"""``gqa convert [SRC] DST --kv-heads N``: change a model's KV head count and write an HF checkpoint folder (the
conversion itself: ``gqa.convert``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ..options.common import loading, model_label
from ..options.defaults import (
    AFTER_LOCAL_LR,
    BUILTIN_METHODS,
    CALIBRATION_CONVERSATIONS,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_METHOD,
    END_TO_END_LR,
    HEAL_LOG_NAME,
    HEAL_PLOT_NAME,
    HEALING_CONVERSATIONS,
    PRECISIONS,
    SHARDINGS,
    SIZE_UNITS,
    TRAINABLE,
    HealConfig,
)
from ..options.dtypes import add_dtype_argument

if TYPE_CHECKING:
    from ..convert import ConversionPlan

HELP = "change a model's number of KV heads; writes an HF folder"
DESCRIPTION = HELP
BUILTIN_HEAL_TEXT = "stdlib"


def method_names() -> list[str]:
    """The merge methods ``--method`` offers, sorted: the built-in ones, and any ``gqa.convert.register_method`` added
    where the registry is loaded already (it imports torch; the built-in names need not)."""
    methods = sys.modules.get("gqa.convert.methods")
    return sorted({*BUILTIN_METHODS, *(methods.METHODS if methods is not None else ())})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gqa convert`` on ``parser``."""
    src_help = "GGUF file or HF folder (default: embedded SmolLM2-135M-Instruct); never modified"
    parser.add_argument("src", nargs="?", default=None, metavar="SRC", help=src_help)
    parser.add_argument("dst", metavar="DST", help="the HF checkpoint folder to write")
    parser.add_argument("--kv-heads", type=int, required=True, metavar="N", help="new number of KV heads")
    method_help = "how to merge KV heads when N is smaller; expanding is always exact"
    parser.add_argument("--method", choices=method_names(), default=DEFAULT_METHOD, help=method_help)
    parser.add_argument(
        "--calibration-text", type=Path, default=None, metavar="FILE",
        help="text for calibrated methods (default: standard-library docstrings)",
    )  # fmt: skip
    parser.add_argument(
        "--refit", action=argparse.BooleanOptionalAction, default=None,
        help="after each layer's merge, re-solve v_proj and o_proj by least squares against the source layer's output "
        "on the calibration text (default: on for pca, off for mean/first)",
    )  # fmt: skip
    parser.add_argument(
        "--conversations", action=argparse.BooleanOptionalAction, default=None,
        help="calibrate and heal (where no text is given) on conversations the source writes itself, mixed with "
        "docstrings; generated once per model and cached (default: on when the source has a chat template)",
    )  # fmt: skip
    parser.add_argument(
        "--calibration-conversations", type=int, default=None, metavar="N",
        help=f"user turns to sample for the calibration conversations; the calibration reads every one of their "
        f"training split (default: {CALIBRATION_CONVERSATIONS}; healing on conversations generates "
        f"{HEALING_CONVERSATIONS}); a cached larger set serves a smaller N",
    )  # fmt: skip
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    add_dtype_argument(
        parser, "--dtype", keywords=["source"], default="source",
        help="dtype of the written weights (default: the source's; a GGUF's quantized blocks give fp32); the "
        "arithmetic is fp32 either way",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="auto", metavar="DEV",
        help="where calibration, merging, the refit and healing run: auto (the GPU if there is one), cpu, cuda, cuda:N",
    )  # fmt: skip
    parser.add_argument(
        "--max-shard-size", type=_shard_size, default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE",
        help=f"largest weight file, e.g. 5GB or 500MiB (default: {DEFAULT_MAX_SHARD_SIZE}); more is sharded with "
        f"model.safetensors.index.json. Units: {SIZE_UNITS}",
    )  # fmt: skip
    parser.add_argument(
        "--dry-run", action="store_true",
        help="print the memory and time the conversion is expected to take, and write nothing",
    )  # fmt: skip
    heal = parser.add_argument_group(
        "healing", "distil the merged model from SRC (KL on the logits) before writing it; "
        f"DST then also holds {HEAL_PLOT_NAME} (loss curve) and {HEAL_LOG_NAME}",
    )  # fmt: skip
    heal.add_argument("--heal-steps", type=int, default=0, metavar="N", help="optimizer steps (default: 0, no healing)")
    heal.add_argument(
        "--heal-minutes", type=float, default=None, metavar="M",
        help="wall-time budget: heal until M minutes are spent (or N steps, if --heal-steps is also given); the "
        "learning-rate schedule follows the time (default: no time limit)",
    )  # fmt: skip
    heal.add_argument(
        "--heal-text", default=None, metavar="FILE",
        help="UTF-8 text to heal on (default: the source's self-generated conversations mixed with docstrings, or "
        f"for a model without a chat template the docstrings alone); '{BUILTIN_HEAL_TEXT}' is the built-in ~1.2 MB "
        "of standard-library docstrings (disjoint from gqa eval's default text)",
    )  # fmt: skip
    d = HealConfig(steps=1)
    heal.add_argument("--heal-lr", type=float, default=None, metavar="LR",
                      help=f"peak learning rate of the end-to-end phase (default: {END_TO_END_LR:g}, or "
                           f"{AFTER_LOCAL_LR:g} after a layer-local phase)")  # fmt: skip
    heal.add_argument("--heal-seq-len", type=int, default=d.seq_len, metavar="L", help="tokens per window")
    heal.add_argument("--heal-batch", type=int, default=d.batch_size, metavar="B", help="windows per step")
    heal.add_argument(
        "--heal-train", choices=TRAINABLE, default=d.train,
        help="which parameters train: the q/k/v/o projections; those and LoRA adapters on the MLP (folded in at the "
        "end); or all",
    )  # fmt: skip
    heal.add_argument(
        "--heal-local-share", type=float, default=d.local_share, metavar="F",
        help="share of the budget (of --heal-minutes, else of --heal-steps) spent first on layer-local healing: each "
        "merged attention block trained alone to reproduce SRC's block on SRC's hidden states (default: %(default)s)",
    )  # fmt: skip
    heal.add_argument("--heal-seed", type=int, default=d.seed, metavar="S", help="seed of the window order")
    heal.add_argument(
        "--heal-sharding", choices=SHARDINGS, default=d.sharding,
        help="under torchrun: ddp replicates the models on every process, fsdp shards them (for a model too big for "
        "one device); auto: fsdp only where replicas and optimizer would not fit",
    )  # fmt: skip
    add_dtype_argument(
        heal, "--heal-precision", choices=[p for p in PRECISIONS if p != "auto"], keywords=["auto"],
        default=d.precision, help="bf16: the passes under bfloat16 autocast, float32 weights and optimizer; auto: "
        "bf16 where the hardware multiplies bf16 natively (AVX512-BF16/AMX CPU, recent GPU), else fp32",
    )  # fmt: skip


def _shard_size(text: str) -> str:
    """``--max-shard-size``'s value, checked (``parse_size``): a bad one is an argparse error naming the flag."""
    from ..convert.shards import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


UNLIMITED_STEPS = 10**9  # the step limit under --heal-minutes alone


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def heal_settings(ns: argparse.Namespace) -> tuple[HealConfig | None, str | None]:
    """``(HealConfig or None, heal text or None)`` from the flags; ``ValueError`` for inconsistent ones. The text
    is ``None`` for the built-in one."""
    from ..convert import HealConfig

    if ns.heal_steps < 0:
        raise ValueError(f"--heal-steps must be >= 0, got {ns.heal_steps}")
    if ns.heal_minutes is not None and not (math.isfinite(ns.heal_minutes) and ns.heal_minutes > 0):
        raise ValueError(f"--heal-minutes must be a positive number, got {ns.heal_minutes}")
    if ns.heal_steps == 0 and ns.heal_minutes is None:  # no healing: a healing flag given would be ignored
        d = HealConfig(steps=1)
        defaults = {"heal_text": None, "heal_lr": None, "heal_seq_len": d.seq_len, "heal_batch": d.batch_size,
                    "heal_train": d.train, "heal_local_share": d.local_share, "heal_seed": d.seed,
                    "heal_sharding": d.sharding, "heal_precision": d.precision}  # fmt: skip
        given = ["--" + name.replace("_", "-") for name, off in defaults.items() if getattr(ns, name, off) != off]
        if given:
            raise ValueError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} only used with --heal-steps N "
                             "(N > 0) or --heal-minutes M")  # fmt: skip
        return None, None
    steps = ns.heal_steps or UNLIMITED_STEPS  # --heal-minutes alone: the time is the limit
    config = HealConfig(
        steps, ns.heal_lr, ns.heal_seq_len, ns.heal_batch, ns.heal_train, None, ns.heal_seed, ns.heal_precision,
        ns.heal_minutes, ns.heal_sharding, ns.heal_local_share,
    )  # fmt: skip
    if ns.heal_text is None:
        return config, None
    if ns.heal_text == BUILTIN_HEAL_TEXT and not Path(ns.heal_text).exists():
        from ..convert import default_heal_text

        return config, default_heal_text()
    return config, Path(ns.heal_text).read_text(encoding="utf-8")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclasses.dataclass
class Checked:
    """``gqa convert``'s flags, checked (``check``)."""

    plan: ConversionPlan
    heal: HealConfig | None
    calibration_text: str | None
    warned: list[warnings.WarningMessage]  # what the check warned of, held back until it passed


def check(ns: argparse.Namespace) -> Checked:
    """Every refusal of ``gqa convert``, the same for the real run and ``--dry-run``, made before anything slow: the
    flags, then the source's config, tensor headers and tokenizer (no weights) and DST (``check_conversion``).
    ``ValueError`` or ``OSError`` (exit 2); nothing is written."""
    from ..convert import check_conversion
    from ..options.dtypes import DTYPES

    src = ns.src
    heal, heal_text = heal_settings(ns)
    if src is not None and not Path(src).expanduser().exists():
        raise FileNotFoundError(f"source model {src} does not exist")
    dtype = None if ns.dtype == "source" else DTYPES[ns.dtype]
    try:
        text = None if ns.calibration_text is None else ns.calibration_text.read_text(encoding="utf-8")
        with warnings.catch_warnings(record=True) as caught:  # a refusal alone, not the warnings before it
            warnings.simplefilter("always")
            plan = check_conversion(
                src, ns.dst, kv_heads=ns.kv_heads, method=ns.method, force=ns.force, calibration_text=text,
                refit=ns.refit, heal=heal, heal_text=heal_text, conversations=ns.conversations,
                calibration_conversations=ns.calibration_conversations, dtype=dtype, device=ns.device,
                max_shard_size=ns.max_shard_size,
            )  # fmt: skip
    except (ValueError, OSError):
        _refuse_by_flag(ns, heal)  # a refusal named by its flag comes first
        raise
    return Checked(plan, heal, text, caught)


def _refuse_by_flag(ns: argparse.Namespace, heal: HealConfig | None) -> None:
    """Two refusals ``check_conversion`` makes too, in the command line's words, before any other: healing without a
    merge and ``--conversations`` without a chat template. Only after a refusal, so a conversion that passes reads
    the source's header once less (a GGUF's takes seconds)."""
    from ..loaders import read_config

    cfg = read_config(ns.src)
    if heal is not None and ns.kv_heads >= cfg.num_kv_heads:
        raise ValueError(f"healing only applies when merging KV heads (--kv-heads < {cfg.num_kv_heads})") from None
    if ns.conversations:
        from ..convert.conversations import has_chat_template
        from ..loaders import load_tokenizer

        if not has_chat_template(load_tokenizer(ns.src)):
            raise ValueError(
                "--conversations needs a source whose tokenizer has a chat template; this one has none"
            ) from None


def dry_run(ns: argparse.Namespace, checked: Checked) -> int:
    """``--dry-run``: what the checked conversion would write and take (``print_plan``), and nothing else."""
    print_plan(ns, checked, sys.stdout)
    return 0


def print_plan(ns: argparse.Namespace, checked: Checked, out: TextIO) -> None:
    """What the checked conversion will write and take, from the source's shapes, a quick speed test and, when it
    generates conversations, a short generation probe (``gqa.convert.generation_cost``); the same lines for
    ``--dry-run`` and before a real run starts."""
    from ..convert.calibration import default_calibration_text
    from ..convert.data import CALIBRATION_PROSE_TOKENS, calibration_ids
    from ..convert.estimate import estimate
    from ..convert.generation_cost import CALIBRATION_TOKENS_PER_TURN, source_generation_cost
    from ..convert.shards import plan_shards
    from ..convert.streaming import converted_shapes
    from ..convert.writer import weight_specs

    plan, heal = checked.plan, checked.heal
    source = plan.source
    cfg = source.config
    merging = ns.kv_heads < cfg.num_kv_heads
    refit = plan.do_refit
    cost = source_generation_cost(plan.resolved, plan.tok, plan.conversation_settings) if plan.chats_wanted else None
    tokens = 0
    if plan.calibrating:
        if checked.calibration_text is not None:
            tokens = len(plan.tok.encode(checked.calibration_text))
        elif cost is not None and cost.done:  # the calibration's own tokens, from the cache
            tokens = len(calibration_ids(plan.tok, cost.read(plan.calibration_conversations).train))
        elif plan.chats_wanted:
            tokens = round(CALIBRATION_TOKENS_PER_TURN * plan.calibration_conversations) + CALIBRATION_PROSE_TOKENS
        else:
            tokens = len(plan.tok.encode(default_calibration_text()))
    device = plan.device
    per_step = 0 if heal is None else heal.seq_len * heal.batch_size
    est = estimate(source, ns.kv_heads, calibration_tokens=tokens, refit=refit, heal=heal is not None,
                   heal_tokens_per_step=per_step, device=device)  # fmt: skip
    dtype = plan.dtype
    specs = weight_specs(dataclasses.replace(cfg, num_kv_heads=ns.kv_heads),
                         converted_shapes(cfg, source.shapes, ns.kv_heads), dtype)  # fmt: skip  # what is written
    size, shards = sum(s.nbytes for s in specs), len(plan_shards(specs, ns.max_shard_size))

    def say(label: str, text: str) -> None:
        print(f"{label:<13}{text}", file=out, flush=True)

    say("source", f"{model_label(ns.src)} ({cfg.arch}, {cfg.num_layers} layers, {len(source.shapes)} tensors, "
        f"stored as {str(source.dtype).removeprefix('torch.')})")  # fmt: skip
    say("plan", f"KV heads {cfg.num_kv_heads} -> {ns.kv_heads}; "
        + (f"method {ns.method}, {'refit, ' if refit else ''}" if merging else "exact, ")
        + (f"~{tokens:,} calibration tokens" if tokens else "no calibration") + f"; on {device}")  # fmt: skip
    if cost is not None:
        say("calibration", cost.describe())
    say("writes", f"~{size / 1e9:.2f} GB in {str(dtype).removeprefix('torch.')}, {shards} shard(s)")
    say("memory", f"peak ~{_gib(est.peak_bytes)} streaming (this process now {_gib(est.baseline_bytes)}); "
        f"the model whole in fp32 would be {_gib(est.whole_model_bytes)}")  # fmt: skip
    if heal is not None:
        say("healing", f"needs ~{_gib(est.heal_bytes)} more (source and converted model in fp32, optimizer)")
    generating = 0.0 if cost is None else cost.seconds
    say("time", f"~{(est.seconds + generating) / 60:.1f} min"
        + (f" (generating ~{generating / 60:.1f}, converting ~{est.seconds / 60:.1f})" if generating else "")
        + f"; {est.layer_seconds:.1f} s per layer at a measured {est.gflops:.0f} GFLOP/s"
        + ("" if heal is None else ", before healing"))  # fmt: skip


def run(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from ..convert import run_conversion
    from ..parallel.distributed import launched_world

    checked = check(ns)  # the real run and --dry-run refuse alike, before anything slow
    for w in checked.warned:  # passed: now the check's warnings, once
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if ns.dry_run:
        return dry_run(ns, checked)
    src, cfg = ns.src, checked.plan.source.config
    merging = ns.kv_heads < cfg.num_kv_heads  # then progress bars follow the line
    what = f"{model_label(src)} layer by layer and converting it to {ns.kv_heads} KV heads"
    with launched_world(checked.plan.device) as (rank, _):  # the group ends with the command, after the report
        with loading(what, timed=not merging):
            if merging and rank == 0:  # minutes ahead: first what they will be spent on (rank 0 converts)
                print_plan(ns, checked, sys.stderr)
            out = run_conversion(checked.plan, force=ns.force)
        if rank == 0:  # rank 0 reports
            report(ns, checked, out)
    return 0


def report(ns: argparse.Namespace, checked: Checked, out: Path) -> None:
    """What a finished conversion wrote, and what healing did."""
    import torch

    from ..cache.kv import kv_cache_bytes
    from ..convert import HEAL_LOG_NAME, HEAL_PLOT_NAME, NEEDS_CALIBRATION

    src, heal = ns.src, checked.heal
    cfg = checked.plan.source.config
    n, h_kv = ns.kv_heads, cfg.num_kv_heads
    refit = ns.method in NEEDS_CALIBRATION if ns.refit is None else ns.refit
    how = "copied" if n == h_kv else "expanded exactly" if n > h_kv else f"merged with method {ns.method!r}"
    how += ", v_proj and o_proj refit" if n < h_kv and refit else ""
    before, after = (kv_cache_bytes(cfg.num_layers, h, cfg.head_dim, 1, dtype=torch.float32) for h in (h_kv, n))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"source       {model_label(src)} ({cfg.arch}, {cfg.num_layers} layers)")
    print(f"heads        {cfg.num_heads} query heads; KV heads {h_kv} -> {n} ({how})")
    print(f"group size   {cfg.num_heads // h_kv} -> {cfg.num_heads // n} query heads per KV head")
    print(f"KV cache     {_kib(before)} -> {_kib(after)} per token in fp32 ({after / before:.2f}x)")
    print(f"wrote        {out}  ({', '.join(sorted(f.name for f in out.iterdir()))}; {size / 1e6:.1f} MB)")
    if heal is not None:
        log = json.loads((out / HEAL_LOG_NAME).read_text(encoding="utf-8"))
        losses = log["losses"]
        k = max(1, min(10, len(losses) // 10))
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        print(
            f"healed       {len(losses)} steps x {log['tokens_per_step']} tokens ({heal.train}, lr {heal.lr:g}, "
            f"{log['precision']}) in {log['seconds']:.0f} s ({log['seconds_per_step']:.2f} s per end-to-end step); "
            f"KL(source || model) on the healing text {first:.3f} -> {last:.3f} nats/token "
            f"(mean of first / last {k} steps)"
        )
        if log.get("local"):
            local = log["local"]
            before, after = (sum(local[k]) / len(local[k]) for k in ("errors_before", "errors_after"))
            print(
                f"layer-local  {len(local['losses'])} steps in {local['seconds'] + local['capture_seconds']:.0f} s "
                f"first ({local.get('windows', 0)} windows captured); attention-block error on held-out windows "
                f"{before:.3f} -> {after:.3f} (mean per layer)"
            )
        print(f"loss curve   {out / HEAL_PLOT_NAME}")
    elif n < h_kv:
        print("note         merged K/V heads change the model's outputs; heal with --heal-steps N or --heal-minutes M")
    return 0
