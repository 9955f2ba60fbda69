"""``gqa convert``'s checks: ``--max-shard-size`` spellings (``parse_size``: every unit its pattern takes, bad ones a
``ValueError`` naming the units, a bad flag exit 2), and ``--dry-run`` refusing exactly what the real run refuses, with
the same message and exit code 2, writing nothing (a 6-query / 2-KV-head source, with and without a tokenizer).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gqa.cli import main as cli
from gqa.convert.shards import parse_size

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from helpers.checkpoints import tiny_dir  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------------
# parse_size

K, M, G, T = 10**3, 10**6, 10**9, 10**12
KI, MI, GI, TI = 2**10, 2**20, 2**30, 2**40
SIZES = {
    "500M": 500 * M, "500MB": 500 * M, "500MiB": 500 * MI, "500Mi": 500 * MI, "2G": 2 * G, "2GB": 2 * G,
    "2Gi": 2 * GI, "2GiB": 2 * GI, "10K": 10 * K, "10KB": 10 * K, "10Ki": 10 * KI, "10KiB": 10 * KI, "1T": T,
    "1TB": T, "1Ti": TI, "1TiB": TI, "7": 7, "7B": 7, " 3 GB ": 3 * G, "1.5GB": 1_500_000_000, "1.5G": 1_500_000_000,
    "0.5GiB": GI // 2, "4.35MB": 4_350_000, "1.5 kb": 1500,
}  # fmt: skip


@pytest.mark.parametrize(("text", "want"), list(SIZES.items()))
def test_parse_size_takes_the_common_spellings_in_any_case(text, want):
    assert parse_size(text) == want
    assert parse_size(text.lower()) == want and parse_size(text.upper()) == want


def test_parse_size_takes_ints():
    assert parse_size(1) == 1 and parse_size(1234) == 1234 and parse_size(5 * 10**9) == 5 * G


@pytest.mark.parametrize("bad", ["5XB", "-1", "0", "", "5 G B", True, "5IB", "5I", "5PB", "GB", "1e9", -1, 0, 1.5,
                                 None, "0.0001KB"], ids=repr)  # fmt: skip
def test_parse_size_refuses_others_naming_the_units(bad):
    with pytest.raises(ValueError, match="max shard size") as e:
        parse_size(bad)
    for unit in ("KB", "MB", "GB", "KiB", "MiB", "GiB", "powers of 1000", "powers of 1024"):
        assert unit in str(e.value), (unit, str(e.value))


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``gqa ARGS`` in this process: ``(exit code, stdout, stderr)``; argparse errors exit."""
    try:
        code = cli(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A random HF Llama with 6 query heads and 2 KV heads (D=4) and a word-level tokenizer (no chat template)."""
    return tiny_dir(tmp_path_factory.mktemp("six") / "src", "llama", heads=6, kv=2, head_dim=4)


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    """The same model without a tokenizer."""
    folder = tiny_dir(tmp_path_factory.mktemp("bare") / "src", "llama", heads=6, kv=2, head_dim=4)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    return folder


def test_cli_max_shard_size_spellings(src, tmp_path, capsys):
    dst = tmp_path / "out"
    code, out, err = run_cli(capsys, "convert", str(src), str(dst), "--kv-heads", "2", "--max-shard-size", "500M")
    assert code == 0, err
    assert "wrote" in out and (dst / "model.safetensors").exists()
    code, out, err = run_cli(capsys, "convert", str(src), str(tmp_path / "small"), "--kv-heads", "2",
                             "--max-shard-size", "2ki")  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "small" / "model.safetensors.index.json").exists()  # 2 KiB shards: the weights are sharded
    code, out, err = run_cli(capsys, "convert", str(src), str(tmp_path / "dry"), "--kv-heads", "2", "--max-shard-size",
                             "1KiB", "--dry-run")  # fmt: skip
    assert code == 0 and "shard(s)" in out and not (tmp_path / "dry").exists()


@pytest.mark.parametrize("dry", [False, True])
@pytest.mark.parametrize("size", ["5XB", "0", "-1", "5 G B", "5IB"])
def test_cli_bad_max_shard_size_exits_2_naming_the_flag(src, tmp_path, capsys, size, dry):
    dst = tmp_path / "out"
    code, out, err = run_cli(capsys, "convert", str(src), str(dst), "--kv-heads", "2", f"--max-shard-size={size}",
                             *(["--dry-run"] if dry else []))  # fmt: skip
    assert code == 2 and out == ""
    assert "--max-shard-size" in err and "MiB" in err and "Traceback" not in err, err
    assert not dst.exists()


# ---------------------------------------------------------------------------------------------------------------------
# --dry-run refuses what the real run refuses


REFUSED = [
    ("src", ["--kv-heads", "0"], "kv_heads must be a positive int, got 0"),
    ("src", ["--kv-heads", "-1"], "kv_heads must be a positive int, got -1"),
    ("src", ["--kv-heads", "3"], "kv_heads (3) must be a multiple of the model's num_kv_heads (2) to expand exactly"),
    ("src", ["--kv-heads", "4", "--method", "mean"], "kv_heads (4) must divide the number of query heads"),
    ("bare", ["--kv-heads", "1"], "method 'pca' calibrates on text, which needs the source's tokenizer"),
    ("bare", ["--kv-heads", "1", "--method", "mean", "--refit"], "calibrates on text, which needs the source's"),
    ("src", ["--kv-heads", "2", "--heal-steps", "3"], "healing only applies when merging KV heads (--kv-heads < 2)"),
    ("src", ["--kv-heads", "6", "--heal-minutes", "1"], "healing only applies when merging KV heads (--kv-heads < 2)"),
    ("src", ["--kv-heads", "2", "--heal-text", "stdlib"], "--heal-text is only used with --heal-steps N"),
    ("bare", ["--kv-heads", "1", "--method", "mean", "--heal-steps", "2"], "healing reads a text, which needs the"),
    ("src", ["--kv-heads", "1", "--conversations"], "needs a source whose tokenizer has a chat template"),
    (
        "src",
        ["--kv-heads", "1", "--calibration-conversations", "64"],
        "this conversion calibrates on the built-in prose",
    ),
    ("src", ["--kv-heads", "1", "--method", "mean", "--calibration-conversations", "64"], "does not calibrate"),
    ("src", ["--kv-heads", "1", "--calibration-conversations", "0"], "calibration_conversations must be >= 1, got 0"),
]


@pytest.mark.parametrize(("which", "flags", "message"), REFUSED, ids=[f"{w}: {' '.join(f)}" for w, f, _ in REFUSED])
def test_dry_run_refuses_what_the_real_run_refuses(src, bare, tmp_path, capsys, recwarn, which, flags, message):
    source = {"src": src, "bare": bare}[which]
    errors = []
    for dry in (False, True):
        dst = tmp_path / f"out{int(dry)}"
        code, out, err = run_cli(capsys, "convert", str(source), str(dst), *flags, *(["--dry-run"] if dry else []))
        assert code == 2, (dry, out, err)
        assert out == "" and "Traceback" not in err and message in err, (dry, err)
        assert not dst.exists()  # nothing written
        errors.append(err)
    assert errors[0] == errors[1] == f"gqa convert: error: {errors[0].split('error: ', 1)[1]}"  # one line, the same
    assert list(tmp_path.iterdir()) == []
    assert not [w for w in recwarn if "no usable tokenizer" in str(w.message)]  # the refusal alone, in both modes


@pytest.mark.parametrize(
    ("which", "flags", "plan"),
    [
        ("src", ["--kv-heads", "1"], "KV heads 2 -> 1; method pca, refit, "),
        ("src", ["--kv-heads", "6"], "KV heads 2 -> 6; exact, no calibration"),
        ("src", ["--kv-heads", "2"], "KV heads 2 -> 2; exact, no calibration"),
        ("src", ["--kv-heads", "1", "--method", "mean", "--heal-steps", "3"], "KV heads 2 -> 1; method mean, no calib"),
        ("bare", ["--kv-heads", "1", "--method", "mean"], "KV heads 2 -> 1; method mean, no calibration"),
    ],
)
def test_dry_run_of_valid_flags_prints_a_plan(src, bare, tmp_path, capsys, recwarn, which, flags, plan):
    source = {"src": src, "bare": bare}[which]
    code, out, err = run_cli(capsys, "convert", str(source), str(tmp_path / "out"), *flags, "--dry-run")
    assert code == 0, err
    warned = [w for w in recwarn if "no usable tokenizer, the converted model will have none" in str(w.message)]
    assert len(warned) == (which == "bare")  # the check's warning, once, as the real run gives it
    assert plan in out and "memory       peak ~" in out and "time         ~" in out, out
    assert list(tmp_path.iterdir()) == []


def test_dry_run_refuses_an_existing_destination_as_the_real_run_does(src, tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    errors = [run_cli(capsys, "convert", str(src), str(dst), "--kv-heads", "1", *dry) for dry in ([], ["--dry-run"])]
    assert errors[0] == errors[1] and errors[0][0] == 2 and "already exists" in errors[0][2]
    assert list(dst.iterdir()) == []
