"""Small random checkpoints and what tests read back from them: tiny HF Llama/Qwen2 folders with a word-level
tokenizer, chat models, teacher/student pairs for healing, and helpers to compare their tensors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import transformers
from safetensors import safe_open

from gqa.convert import convert_state
from gqa.models import CausalLM, ModelConfig


def tiny_refit_model(bias: bool, kv: int) -> tuple[ModelConfig, dict]:
    torch.manual_seed(0)
    cfg = ModelConfig(arch="qwen2" if bias else "llama", vocab_size=64, hidden_size=48, intermediate_size=64,
                      num_layers=2, num_heads=6, num_kv_heads=kv, head_dim=8, max_position_embeddings=64,
                      attention_bias=bias, tie_word_embeddings=not bias)  # fmt: skip
    model = CausalLM(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return cfg, {k: v for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}


CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def chat_dir(folder: Path) -> Path:
    """``tiny_dir``'s random Llama (8 query, 2 KV heads) with a chat template and room for 1024 positions."""
    tiny_dir(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 1024}))
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config | {"chat_template": CHAT_TEMPLATE}))
    return folder


def tiny_pair(seed: int = 0) -> tuple[CausalLM, CausalLM]:
    """(teacher, student): a random 2-layer model with 6 query / 2 KV heads, and its 1-KV-head mean merge."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=6, num_kv_heads=2,
                      head_dim=8, max_position_embeddings=64)  # fmt: skip
    teacher = CausalLM(cfg).eval()
    for p in teacher.parameters():
        torch.nn.init.normal_(p, std=0.3)  # peaked, context-dependent predictions
    state = {k: v for k, v in teacher.state_dict().items() if k != "lm_head.weight"}
    cfg1, state1 = convert_state(cfg, state, 1, "mean")
    return teacher, CausalLM.from_state(cfg1, {k: v.clone() for k, v in state1.items()})


TRAIN_IDS = torch.randint(0, 64, (600,), generator=torch.Generator().manual_seed(1))


WORDS = ["the", "cat", "sat", "on", "a", "mat", "and"]


def tiny_dir(
    folder: Path, arch: str = "llama", heads: int = 8, kv: int = 2, head_dim: int = 4, vocab_size: int = 32
) -> Path:
    """A random HF checkpoint (Llama: tied embeddings, no bias; Qwen2: untied, q/k/v biases) with a word-level
    tokenizer, saved to ``folder``. Every parameter is random (HF would start biases at zero). ``vocab_size``: the
    model's; the tokenizer's 10 tokens come first (10: every token the model can choose has its text)."""
    torch.manual_seed(0)
    kw = dict(vocab_size=vocab_size, hidden_size=24, intermediate_size=40, num_hidden_layers=2)
    kw |= dict(num_attention_heads=heads)
    kw |= dict(num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=64, rms_norm_eps=1e-6)
    kw |= dict(bos_token_id=1, eos_token_id=2, tie_word_embeddings=arch == "llama")
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.eval().save_pretrained(folder)
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2} | {w: i + 3 for i, w in enumerate(WORDS)}
    raw = RawTokenizer(WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    tok.save_pretrained(folder)
    return folder


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor stored in ``folder/model.safetensors``, as stored."""
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def digest(path: Path) -> dict[str, str]:
    """Relative name -> sha256 of every file under ``path`` (or of the file ``path``)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def logits_hf(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(ids).logits


def by_hand(w: torch.Tensor, h_kv: int, n: int, method: str) -> torch.Tensor:
    """Rows ``(H_kv * D, ...)`` -> ``(n * D, ...)``, one head and one group member at a time."""
    d, m = w.shape[0] // h_kv, h_kv // n
    rows = []
    for j in range(n):
        members = [w[(j * m + t) * d : (j * m + t + 1) * d].double() for t in range(m)]
        if method == "first":
            rows.append(members[0])
        else:
            total = members[0].clone()
            for x in members[1:]:
                total += x
            rows.append(total / m)
    return torch.cat(rows).float()
