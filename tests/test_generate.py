"""``loom generate``: the KV-cache path equals the cache-free reference (greedy and seeded sampling,
every model family, batches equal one-by-one, contexts past max_seq_len); greedy tokens from an
HF directory equal ``transformers``' ``generate``; top-k / top-p equal ``transformers``' warpers;
the CLI's sources, chat template, prompt files, stop strings and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from loom import config as C
from loom.generate.decode import generate_cached, generate_uncached, generators, next_token
from loom.generate.options import SamplingOptions
from loom.model.kv_cache import forward_cached, new_cache
from loom.model.llama import build_model

FAMILIES = {
    "llama": {},
    "qk_norm": {"qk_norm": True, "qkv_bias": True},
    "gpt2": {"norm": "layernorm", "mlp": "gelu_tanh", "positions": "learned", "bias": True, "n_kv_heads": 4},
    "moe": {"n_experts": 4, "top_k": 2},
    "llama3.1": {"rope_scaling": 8.0, "rope_original_len": 8},
}
GREEDY = SamplingOptions(max_new_tokens=30, temperature=0)
SAMPLED = SamplingOptions(max_new_tokens=30, temperature=1.0, top_k=40, top_p=0.9, seed=3)
PENALIZED = SamplingOptions(max_new_tokens=30, temperature=0, repetition_penalty=1.3)


def _model(family: str, seq: int = 32):
    fields = (
        dict(
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            vocab_size=128,
            max_seq_len=seq,
            multiple_of=16,
            init_std=0.2,
        )
        | FAMILIES[family]
    )
    return build_model(C.ModelConfig(**fields), seed=1).eval()  # type: ignore[arg-type]


def _prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cached_logits_equal_the_training_forward(family):
    """Prefill is the training forward bit for bit; each one-token step's logits equal the full
    forward's at that position; the model's forward is the same before and after."""
    model = _model(family)
    ids = torch.tensor(_prompts(20))
    with torch.no_grad():
        full = model(ids)
        cache = new_cache(model, 1, 20)
        pre = forward_cached(model, ids[:, :12], cache)
        assert torch.equal(pre, model(ids[:, :12]))
        for t in range(12, 20):
            assert_close(forward_cached(model, ids[:, t : t + 1], cache), full[:, t : t + 1])
        assert torch.equal(model(ids), full)
    assert (
        cache.length == 20 and cache.nbytes == 2 * 2 * 1 * model.cfg.n_kv_heads * 20 * model.cfg.head_dim * 4
    )


@pytest.mark.parametrize("padded", [False, True])
def test_decode_steps_append_in_place_without_host_syncs(padded):
    """The cache's buffers are allocated once: each one-token step writes its keys and values into
    them (data pointers unchanged), makes no tensor as large as one layer's key buffer (the cache is
    never copied or repeated to the query heads), and waits on the host for nothing."""
    from loom.device_sync import SyncCounter
    from tests.test_device_speed import LiveBytes

    model = _model("llama")
    pad = torch.tensor([0, 3]) if padded else None
    ids = torch.tensor(_prompts(30, 30))  # 24 prefilled: k, v repeated to 4 heads would exceed a buffer
    cache = new_cache(model, 2, 32, pad)
    ptrs = [t.data_ptr() for t in (*cache.keys, *cache.values)]
    with torch.no_grad():
        forward_cached(model, ids[:, :24], cache)
        for t in range(24, 30):
            with SyncCounter() as syncs, LiveBytes() as mem:
                forward_cached(model, ids[:, t : t + 1], cache)
            assert syncs.count == 0, syncs.by_site()
            assert mem.largest < cache.keys[0].nbytes
            assert [t.data_ptr() for t in (*cache.keys, *cache.values)] == ptrs
    assert cache.length == 30 and cache.padded == padded


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("opts", [GREEDY, SAMPLED, PENALIZED], ids=["greedy", "sampled", "penalized"])
def test_cached_batch_equals_the_cache_free_path_one_by_one(family, opts):
    """Left-padded batches with a KV cache give each prompt the tokens the cache-free reference
    gives it alone, also past max_seq_len (5 + 30 > 32: the window slides); the repetition penalty
    sees each prompt's own tokens, never its padding."""
    model = _model(family)
    prompts = _prompts(5, 9, 1, 9)
    ref = generate_uncached(model, prompts, opts)
    batched = generate_cached(model, prompts, opts)
    assert batched.tokens == ref.tokens
    assert [generate_cached(model, [p], opts).tokens[0] for p in prompts] == ref.tokens
    assert all(len(t) == 30 for t in ref.tokens) and len({t for row in ref.tokens for t in row}) > 10
    assert ref.tokens[1] != ref.tokens[3] or prompts[1] == prompts[3]


def test_eos_and_stop_end_each_prompt_alone():
    model = _model("llama")
    prompts = _prompts(4, 7, 3)
    free = generate_uncached(model, prompts, GREEDY).tokens
    eos = frozenset([free[1][5]])
    want = [row[: row.index(next(iter(eos))) + 1] if next(iter(eos)) in row else row for row in free]
    assert generate_cached(model, prompts, GREEDY, eos).tokens == want
    assert generate_uncached(model, prompts, GREEDY, eos).tokens == want
    stop = lambda row, toks: len(toks) >= 4 + row  # noqa: E731 - row-dependent: rows end at different steps
    assert [len(t) for t in generate_cached(model, prompts, GREEDY, stop=stop).tokens] == [4, 5, 6]


@pytest.mark.parametrize("top_k,top_p", [(0, 0.7), (5, 1.0), (8, 0.5), (1, 0.3), (0, 1.0)])
def test_top_k_top_p_keep_what_transformers_keeps(top_k, top_p):
    """The tokens left for the draw are those ``transformers``' TopK/TopP warpers leave, and every
    draw is one of them."""
    import transformers

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(top_k))
    opts = SamplingOptions(temperature=0.7, top_k=top_k, top_p=top_p)
    warped = logits / 0.7
    if top_k:
        warped = transformers.TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1:
        warped = transformers.TopPLogitsWarper(top_p)(None, warped)
    allowed = torch.isfinite(warped)
    gens = generators(4, 0)
    seen = torch.zeros_like(allowed)
    for _ in range(300):
        tok = next_token(logits, opts, gens)
        seen[torch.arange(4), tok] = True
    assert not (seen & ~allowed).any()
    if allowed.sum(-1).max() <= 6:  # few enough to see each of them in 300 draws
        assert torch.equal(seen, allowed)
    greedy = SamplingOptions(temperature=0)
    assert torch.equal(next_token(logits, greedy, gens), logits.argmax(-1))
    # a temperature near 0 samples the argmax (it sent the max to inf: NaN probabilities, a traceback)
    assert torch.equal(next_token(logits, SamplingOptions(temperature=1e-300), gens), logits.argmax(-1))


# ----------------------------------------------------------------------------- Hugging Face parity

HF = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 2}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 32}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_inner": 96}),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen3moe": (  # routing weights not renormalized over the top k: moe.norm_topk = false
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
        | {"norm_topk_prob": False, "head_dim": 16},
    ),
    "mistral": (  # Mistral-7B v0.1's shape: a window (48) shorter than the positions (64)
        "MistralConfig",
        "MistralForCausalLM",
        {"num_key_value_heads": 2, "sliding_window": 48},
    ),
}


def _save_hf(tmp: Path, family: str, vocab: int = 128) -> tuple[Path, torch.nn.Module]:
    import transformers

    cfg_cls, model_cls, extra = HF[family]
    torch.manual_seed(0)
    fields = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rope_theta=1e4,
    )
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**(fields | extra))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 and p.abs().sum() == p.numel() else 0.0))
    out = tmp / family
    model.save_pretrained(out)
    return out, model


@pytest.mark.parametrize("family", list(HF))
def test_greedy_tokens_from_an_hf_directory_equal_transformers_generate(tmp_path, family):
    """Greedy tokens equal ``transformers``' ``generate(do_sample=False)``: without a repetition
    penalty (1.0 given, as a flag wins), and with the one the directory's ``generation_config.json``
    sets (1.3, with ``do_sample: false``), taken as ``loom generate`` takes the model's defaults."""
    from loom.generate.source import generation_defaults, hf_model

    path, ref = _save_hf(tmp_path, family)
    gen = path / "generation_config.json"
    saved = json.loads(gen.read_text()) if gen.is_file() else {}
    gen.write_text(json.dumps(saved | {"repetition_penalty": 1.3, "do_sample": False}))
    _, model = hf_model(path)  # what `loom generate --model.from_hf` runs
    model.eval()
    prompts = _prompts(6, 11)
    defaults, warned = generation_defaults(path)
    assert defaults == {"repetition_penalty": 1.3, "temperature": 0.0} and not warned
    plain = SamplingOptions(max_new_tokens=24, repetition_penalty=1.0).with_defaults(defaults)
    penalized = SamplingOptions(max_new_tokens=24).with_defaults(defaults)
    got = {}
    for opts, penalty in ((plain, 1.0), (penalized, 1.3)):
        got[penalty] = ours = generate_cached(model, prompts, opts).tokens
        assert generate_uncached(model, prompts, opts).tokens == ours
        for prompt, mine in zip(prompts, ours, strict=True):
            x = torch.tensor([prompt])
            theirs = ref.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                repetition_penalty=penalty,
                max_new_tokens=24,
                min_new_tokens=24,
                eos_token_id=None,
                pad_token_id=0,
            )
            assert mine == theirs[0, len(prompt) :].tolist(), penalty
        assert len({t for row in ours for t in row}) > 8
    assert got[1.0] != got[1.3]  # the penalty changes the tokens: the comparison sees it


# ----------------------------------------------------------------------------- the command


def _tokenizer(path: Path):
    from loom.data.tokenizer import train_tokenizer

    text = "the cat sat on a mat and the dog ran to it while birds sang over green hills"
    docs = [text[i:] + " " + text[:i] for i in range(0, len(text), 5)] * 4
    tok = train_tokenizer(docs, 300)
    tok.save(str(path / "tokenizer.json"))
    return tok


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path, _ = _save_hf(tmp_path_factory.mktemp("hf"), "llama", vocab=300)
    _tokenizer(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return path


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    from loom.cli import main

    rc = main(["generate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_prompt_of_invalid_utf8_is_one_line(hf_dir, tmp_path, capsys):
    """Bytes that are not UTF-8 on the command line reach Python as lone surrogates (and a .jsonl's
    ``\\ud800`` escape too): refused naming the prompt, not a tokenizer traceback."""
    rc, _, err = _run(
        capsys, "--model.from_hf", str(hf_dir), "--prompt", b"a\xff\xfeb".decode(errors="surrogateescape")
    )
    assert (
        rc == 2 and err.startswith("loom: error: --prompt: not valid UTF-8 text") and err.count("\n") == 1
    ), err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"prompt": "bad \\ud800"}\n')
    rc, _, err = _run(
        capsys, "--model.from_hf", str(hf_dir), "--prompts", str(prompts), "--max-new-tokens", "2"
    )
    assert rc == 2 and "--prompts (prompt 2): not valid UTF-8 text" in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "edit,says",
    [
        ({"hidden_size": "big"}, "a field has a value of the wrong type"),
        ({"rms_norm_eps": -1.0}, "model.norm_eps: must be > 0"),
        ({"rms_norm_eps": float("nan")}, "model.norm_eps: must be a finite number"),
        ({"rope_theta": float("inf")}, "model.rope_theta: must be a finite number"),
    ],
)
def test_an_hf_config_of_bad_values_is_one_line_as_loom_train_says(hf_dir, tmp_path, capsys, edit, says):
    """What loom train refuses in a directory's config.json, generate refuses too (a wrong type gave a
    traceback, a NaN eps a sampling error, an infinite RoPE base ran)."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw.pop("rope_parameters", None) if "rope_theta" in edit else None
    (bad / "config.json").write_text(json.dumps(raw | edit))
    rc, _, err = _run(capsys, "--model.from_hf", str(bad), "--prompt", "the cat", "--max-new-tokens", "2")
    assert (
        rc == 2 and err.startswith("loom: error: model.from_hf: ") and says in err and err.count("\n") == 1
    ), err


def test_the_default_length_stays_in_the_window_and_a_cropped_prompt_is_noted(hf_dir, capsys):
    """The default --max-new-tokens (200) is capped to model.max_seq_len (an explicit larger one is
    refused); a prompt longer than the window is cropped to its last max_seq_len tokens, with a note."""
    from loom.generate.source import load_hf

    window = load_hf(str(hf_dir)).model.cfg.max_seq_len
    rc, out, err = _run(capsys, "--model.from_hf", str(hf_dir), "--prompt", "the cat", "--temperature", "0")
    assert rc == 0 and f"generated {window} tokens" in err and "note" not in err, err
    long = " ".join(["the cat sat on a mat"] * window)
    rc, out, err = _run(
        capsys,
        "--model.from_hf",
        str(hf_dir),
        "--prompt",
        long,
        "--max-new-tokens",
        "2",
        "--temperature",
        "0",
    )
    assert rc == 0 and f"longer than model.max_seq_len = {window}; the model sees its last {window}" in err, (
        err
    )


def test_cli_on_an_hf_directory_prints_the_completion_and_its_speed(hf_dir, capsys):
    from loom.generate.source import load_hf

    rc, out, err = _run(
        capsys,
        "--model.from_hf",
        str(hf_dir),
        "--prompt",
        "the cat",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
    )
    assert rc == 0 and out.startswith("the cat")
    assert "generated 12 tokens for 1 prompt(s)" in err and "tokens/s (KV cache" in err
    src = load_hf(str(hf_dir))
    ids = src.tokenizer.encode("the cat").ids
    want = generate_uncached(src.model, [ids], SamplingOptions(max_new_tokens=12, temperature=0)).tokens[0]
    assert out == "the cat" + src.tokenizer.decode(want) + "\n"
    rc, out2, err = _run(
        capsys,
        "--model.from_hf",
        str(hf_dir),
        "--prompt",
        "the cat",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
        "--no-cache",
    )
    assert rc == 0 and out2 == out and "no cache" in err


def test_chat_applies_the_tokenizers_template_with_its_generation_prompt(hf_dir, capsys):
    from loom.generate.source import load_hf

    src = load_hf(str(hf_dir))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the dog"}]
    assert src.render(messages) == "[system] be brief\n[user] the dog\n[assistant] "
    ids = src.encode(messages, chat=True)
    assert (
        ids
        == src.tokenizer.encode(
            "[system] be brief\n[user] the dog\n[assistant] ", add_special_tokens=False
        ).ids
    )
    rc, out, _ = _run(
        capsys,
        "--model.from_hf",
        str(hf_dir),
        "--prompt",
        "the dog",
        "--chat",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    )
    want = generate_cached(
        src.model, [src.encode("the dog", chat=True)], SamplingOptions(max_new_tokens=8, temperature=0)
    )
    assert rc == 0 and out == src.tokenizer.decode(want.tokens[0]) + "\n"


def test_prompt_files_in_batches_equal_one_by_one_and_stop_strings_cut(hf_dir, tmp_path, capsys):
    lines = ["the cat", "a dog ran over green hills and", "birds", "on a mat"]
    (tmp_path / "p.txt").write_text("\n".join(lines) + "\n\n")
    (tmp_path / "p.jsonl").write_text(
        "\n".join(json.dumps({"prompt": p}) for p in lines[:2])
        + "\n"
        + "\n".join(json.dumps(p) for p in lines[2:])
    )
    common = [
        "--model.from_hf",
        str(hf_dir),
        "--max-new-tokens",
        "10",
        "--temperature",
        "0.9",
        "--top-p",
        "0.9",
        "--seed",
        "5",
    ]
    singles = []
    for p in lines:
        rc, out, _ = _run(capsys, *common, "--prompt", p)
        assert rc == 0
        singles.append(out[len(p) : -1])
    for name in ("p.txt", "p.jsonl"):
        rc, out, err = _run(capsys, *common, "--prompts", str(tmp_path / name), "--batch-size", "3")
        rows = [json.loads(line) for line in out.splitlines()]
        assert rc == 0 and [r["prompt"] for r in rows] == lines and [r["completion"] for r in rows] == singles
        assert "for 4 prompt(s)" in err
    stop = next(c for c in singles[0] if c.strip())  # a character the first completion contains
    rc, out, _ = _run(capsys, *common, "--prompts", str(tmp_path / "p.txt"), "--stop", stop, "--stop", "zzz")
    got = [json.loads(line)["completion"] for line in out.splitlines()]
    assert (
        rc == 0 and got == [s[: s.find(stop)] if stop in s else s for s in singles] and got[0] != singles[0]
    )


def _run_dir(tmp: Path) -> Path:
    """A run directory as ``loom train`` leaves it: config.toml, tokenizer.json, final weights + SHA-256."""
    from loom.checkpoint.integrity import sha256_file
    from loom.train.export import save_model

    run = tmp / "run"
    (run / "checkpoints" / "final").mkdir(parents=True)
    tok = _tokenizer(run)
    cfg = C.LoomConfig()
    cfg.model = C.ModelConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=tok.get_vocab_size(),
        max_seq_len=32,
        multiple_of=16,
        init_std=0.2,
    )
    (run / "config.toml").write_text(C.dump_toml(cfg))
    weights = run / "checkpoints" / "final" / "model.safetensors"
    save_model(build_model(cfg.model, seed=2), weights)
    (weights.parent / "meta.json").write_text(json.dumps({"sha256": sha256_file(weights)}))
    return run


def test_run_directory_with_the_builtin_chat_template(tmp_path, capsys):
    from loom.generate.source import load_run

    run = _run_dir(tmp_path)
    src = load_run(str(run))
    assert src.render([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n<|assistant|>\n"
    rc, out, err = _run(
        capsys,
        "--run.dir",
        str(run),
        "--prompt",
        "the",
        "--chat",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0",
    )
    want = generate_uncached(
        src.model, [src.encode("the", chat=True)], SamplingOptions(max_new_tokens=6, temperature=0)
    )
    assert rc == 0 and out == src.tokenizer.decode(want.tokens[0]) + "\n" and "tokens/s" in err


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--top-p", "0"], r"--top-p: must be in \(0, 1\]"),
        (["--top-p", "1.5"], r"--top-p: must be in \(0, 1\]"),
        (["--repetition-penalty", "0"], r"--repetition-penalty: must be a finite number > 0"),
        (["--temperature", "-1"], r"--temperature: must be a finite number >= 0"),
        (["--temperature", "nan"], r"--temperature: must be a finite number >= 0"),
        (["--top-k", "-2"], r"--top-k: must be >= 0, got -2"),
        (["--max-new-tokens", "x"], r"--max-new-tokens: expected an integer"),
        (["--batch-size", "0"], r"--batch-size: must be >= 1"),
        (["--prompts", "/nonexistent/p.txt"], r"--prompts: /nonexistent/p.txt is not a file"),
        (["--prompts", "EMPTY"], r"--prompts: .* holds no prompt"),
        (["--prompts", "MSGS"], r"--prompts: .*:1 holds chat messages; add --chat"),
        (["--prompts", "BADJSON"], r"--prompts: .*:1 is not valid JSON"),
        (
            ["--prompts", "BOTH", "--chat"],
            r"--prompts: .*both.jsonl:2 holds both 'prompt' and 'messages'; give one of them",
        ),
        (
            ["--prompt", "a", "--prompts", "MSGS"],
            r"--prompts: give --prompt TEXT or --prompts FILE, not both",
        ),
        (
            ["--prompts", "ROLE", "--chat"],
            r"--prompts: .*r.jsonl:1 has a message of unknown role 'usr' \(allowed: ",
        ),
        (
            ["--temperature", "0", "--top-k", "5", "--seed", "3"],
            r"--top-k, --seed: no effect under greedy decoding \(--temperature = 0: the likeliest token",
        ),
        (
            ["--temperature=0.0", "--top-p", "0.9"],
            r"--top-p: no effect under greedy decoding \(--temperature = 0",
        ),
        (["--stop", ""], r"--stop: an empty stop string"),
        (["--stop"], r"--stop: missing value"),
        (["--tmperature", "1"], r"--tmperature: unknown option; allowed: --run.dir, --model.from_hf, "),
        (["--train.steps", "1"], r"train.steps: generate reads only --run.dir"),
        (["--run.dir", "R"], r"generate: give one model"),
        (["NOSOURCE"], r"generate: give one model"),
        (["NOHF"], r"model.from_hf: '/nonexistent/hf' is not a directory"),
    ],
)
def test_bad_options_are_one_line_before_any_model_loads(tmp_path, capsys, argv, match, hf_dir):
    import re

    files = {
        "EMPTY": "e.txt",
        "MSGS": "m.jsonl",
        "BADJSON": "b.jsonl",
        "BOTH": "both.jsonl",
        "ROLE": "r.jsonl",
    }
    (tmp_path / "r.jsonl").write_text(json.dumps({"messages": [{"role": "usr", "content": "x"}]}) + "\n")
    (tmp_path / "e.txt").write_text("\n \n")
    msgs = {"messages": [{"role": "user", "content": "x"}]}
    (tmp_path / "m.jsonl").write_text(json.dumps(msgs) + "\n")
    (tmp_path / "both.jsonl").write_text(json.dumps(msgs) + "\n" + json.dumps({"prompt": "y"} | msgs) + "\n")
    (tmp_path / "b.jsonl").write_text("{nope\n")
    argv = [str(tmp_path / files[a]) if a in files else a for a in argv]
    source = ["--model.from_hf", str(hf_dir)]
    if argv == ["NOSOURCE"]:
        argv, source = [], []
    elif argv == ["NOHF"]:
        argv, source = [], ["--model.from_hf", "/nonexistent/hf"]
    rc, _, err = _run(capsys, *source, *argv)
    assert rc == 2 and err.count("\n") == 1 and re.search(match, err), err


def _lora_run(tmp: Path, method: str, source: str = "") -> tuple[Path, dict[str, torch.Tensor]]:
    """A LoRA run directory: config.toml (finetune.method, the seeded base), tokenizer.json, and a
    final file holding the adapters (B nonzero), as ``loom checkpoint convert`` writes a LoRA
    checkpoint (the trainer itself writes the merged model: the real run below)."""
    from safetensors.torch import save_file

    from loom.checkpoint.integrity import sha256_file
    from loom.finetune.lora import apply_lora, is_adapter

    run = _run_dir(tmp)
    cfg = C.load_toml(run / "config.toml")
    cfg.finetune.method = method  # type: ignore[assignment]
    cfg.finetune.lora_rank = 4
    (run / "config.toml").write_text(C.dump_toml(cfg))
    model = build_model(cfg.model, seed=cfg.train.seed, meta=True)
    apply_lora(model, targets=C.lora_targets(cfg), finetune=cfg.finetune)
    g = torch.Generator().manual_seed(5)
    adapters = {
        n: torch.randn(tuple(p.shape), generator=g) * 0.3
        for n, p in model.named_parameters()
        if is_adapter(n)
    }
    weights = run / "checkpoints" / "final" / "model.safetensors"
    save_file(adapters, str(weights), metadata={"source": source} if source else None)
    (weights.parent / "meta.json").write_text(json.dumps({"sha256": sha256_file(weights)}))
    return run, adapters


def test_an_adapters_file_generates_with_its_adapters_on_the_base(tmp_path):
    """The LoRA source equals the merged model W + (α/r)·B A (loom.finetune.lora.merged_weight) on
    the seeded base: greedy tokens equal, logits close; QLoRA's base is NF4 again and its cached
    path equals its cache-free one."""
    from loom.finetune.lora import LoRALinear, merged_weight
    from loom.generate.source import load_run
    from loom.model.llama import Transformer, init_weights

    run, adapters = _lora_run(tmp_path, "lora")
    src = load_run(str(run))
    cfg = C.load_toml(run / "config.toml")
    merged = Transformer(cfg.model)
    init_weights(merged, cfg.train.seed)
    scale = cfg.finetune.lora_alpha / cfg.finetune.lora_rank
    with torch.no_grad():
        for name, p in merged.named_parameters():
            a = adapters.get(name.removesuffix(".weight") + ".lora_A.weight")
            if a is not None:
                p.copy_(merged_weight(p, a, adapters[name.removesuffix(".weight") + ".lora_B.weight"], scale))
    ids = torch.tensor(_prompts(12))
    with torch.no_grad():
        assert_close(src.model(ids), merged(ids), rtol=1e-4, atol=1e-4)
    prompts = [src.encode("the cat", False), src.encode("a dog", False)]
    opts = SamplingOptions(max_new_tokens=12, temperature=0)
    assert (
        generate_cached(src.model, prompts, opts).tokens
        == generate_uncached(merged.eval(), prompts, opts).tokens
    )
    q = load_run(str(_lora_run(tmp_path / "q", "qlora")[0])).model
    assert all(m.nf4 is not None for m in q.modules() if isinstance(m, LoRALinear))
    assert generate_cached(q, prompts, SAMPLED).tokens == generate_uncached(q, prompts, SAMPLED).tokens


def test_a_lora_run_on_another_base_is_refused_naming_both_hashes(tmp_path, capsys):
    run, _ = _lora_run(tmp_path, "lora", source="step-00000004")
    ckpt = run / "checkpoints" / "step-00000004"
    ckpt.mkdir()
    (ckpt / "train_state.json").write_text(
        json.dumps({"finetune_base": {"path": "/old/base", "sha256": "ab" * 32}})
    )
    rc, _, err = _run(capsys, "--run.dir", str(run), "--max-new-tokens", "2")
    assert (
        rc == 2 and err.count("\n") == 1 and "ab" * 32 in err and "/old/base" in err and "seeded init" in err
    )


def test_the_model_that_generates_is_the_one_the_checkpoint_recorded(tmp_path):
    """The final file's checkpoint (its header's ``source``) recorded 320 vocabulary rows, config.toml
    says none: the checkpoint's model generates (config.toml's had failed on the shapes). A checkpoint
    that recorded no config (an older Loom) keeps config.toml's model."""
    from loom.checkpoint.integrity import sha256_file
    from loom.generate.source import load_run
    from loom.train.export import save_model

    run = _run_dir(tmp_path)
    cfg = C.load_toml(run / "config.toml")
    trained = C.load_toml(run / "config.toml")
    trained.model.pad_vocab_to = 320
    model = build_model(trained.model, seed=2).eval()
    weights = run / "checkpoints" / "final" / "model.safetensors"
    save_model(model, weights, metadata={"source": "step-00000003"})
    (weights.parent / "meta.json").write_text(json.dumps({"sha256": sha256_file(weights)}))
    ckpt = run / "checkpoints" / "step-00000003"
    ckpt.mkdir()
    (ckpt / "train_state.json").write_text(json.dumps({"config": C.to_dict(trained)}))
    src = load_run(str(run))
    ids = torch.tensor(_prompts(9))
    with torch.no_grad():
        assert src.model.cfg.padded_vocab == 320 and torch.equal(src.model(ids), model(ids))
    (ckpt / "train_state.json").write_text(json.dumps({"finetune_base": None}))
    cfg.model.pad_vocab_to = 320
    cfg.model.n_heads, cfg.model.n_kv_heads = 2, 1  # the same shapes: nothing to tell them apart
    (run / "config.toml").write_text(C.dump_toml(cfg))
    assert load_run(str(run)).model.cfg.n_heads == 2


# ----------------------------------------------------------------------------- a real LoRA run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[Path, Path]:
    """(base, run): a tiny HF Llama with its tokenizer, and 4 LoRA steps of ``loom train`` on it."""
    import os
    import subprocess
    import sys

    import transformers

    tmp = tmp_path_factory.mktemp("lora")
    base = tmp / "base"
    base.mkdir()
    tok = _tokenizer(base)
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(hf_cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(base)
    (tmp / "data.txt").write_text("the cat sat on a mat and the dog ran to it while birds sang\n" * 300)
    run = tmp / "run"
    env = dict(os.environ, LOOM_CACHE_DIR=str(tmp / "cache"), PYTHONPATH=str(Path(__file__).parent.parent))
    flags = {
        "model.from_hf": base,
        "finetune.method": "lora",
        "finetune.lora_rank": 4,
        "finetune.lora_alpha": 8,
        "data.source": tmp / "data.txt",
        "data.seq_len": 32,
        "train.steps": 4,
        "train.global_batch": 4,
        "train.micro_batch": 4,
        "train.lr": 0.05,
        "train.warmup_steps": 1,
        "train.eval_every": 0,
        "train.checkpoint_async": "false",
        "run.progress": "false",
        "run.tensorboard": "false",
        "run.dir": run,
        "nproc": 1,
    }
    argv = [a for k, v in flags.items() for a in (f"--{k}", str(v))]
    p = subprocess.run(
        [sys.executable, "-m", "loom", "train", *argv], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return base, run


def test_generate_on_a_lora_run_gives_the_greedy_tokens_of_transformers_plus_peft(lora_run, tmp_path, capsys):
    """``loom train`` of a LoRA run writes the merged model with the checkpoint it came from; ``loom
    generate --run.dir`` verifies it and gives the greedy tokens of ``transformers`` + PEFT on the
    run's exported adapters (stopping, as they do, at the base's ``eos_token_id``)."""
    import peft
    import transformers

    from loom.finetune.export import export_peft
    from loom.generate.source import load_run

    base, run = lora_run
    export_peft(run, tmp_path / "adapter")
    ref = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), str(tmp_path / "adapter")
    ).eval()
    src = load_run(str(run))
    for prompt in ("the cat", "birds sang over"):
        rc, out, _ = _run(
            capsys, "--run.dir", str(run), "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0"
        )
        ids = src.tokenizer.encode(prompt).ids
        x = torch.tensor([ids])
        with torch.no_grad():
            theirs = ref.generate(
                input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12
            )[0, len(ids) :].tolist()
        assert rc == 0 and out == prompt + src.tokenizer.decode(theirs) + "\n", (out, theirs)
    with torch.no_grad():  # the adapters changed the model
        plain = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
        x = torch.tensor([src.tokenizer.encode("the cat sat").ids])
        assert (plain(x).logits - ref(x).logits).abs().max() > 1e-3


def test_an_altered_merged_model_or_a_changed_base_is_refused(lora_run, tmp_path, capsys):
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    base, run = lora_run
    other_base, other = tmp_path / "base", tmp_path / "run"
    shutil.copytree(base, other_base)
    shutil.copytree(run, other)
    toml = (other / "config.toml").read_text()
    (other / "config.toml").write_text(toml.replace(str(base), str(other_base)))
    weights = other / "checkpoints" / "final" / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        header = f.metadata()
    assert header["lora"] == "merged" and header["source"] == "step-00000004"
    rc, _, err = _run(capsys, "--run.dir", str(other), "--max-new-tokens", "2", "--prompt", "a")
    assert rc == 0, err  # the copy is the run
    state = load_file(str(weights))
    state["norm.weight"] = state["norm.weight"] + 1e-3
    save_file(state, str(weights), metadata=header)
    rc, _, err = _run(capsys, "--run.dir", str(other), "--max-new-tokens", "2", "--prompt", "a")
    assert rc == 2 and "norm.weight differs" in err and "the merge of its adapters" in err, err
    hf = load_file(str(other_base / "model.safetensors"))
    hf["model.norm.weight"] = hf["model.norm.weight"] * 2
    save_file(hf, str(other_base / "model.safetensors"), metadata={"format": "pt"})
    rc, _, err = _run(capsys, "--run.dir", str(other), "--max-new-tokens", "2", "--prompt", "a")
    assert rc == 2 and err.count("\n") == 1 and "trained on the base" in err and str(other_base) in err, err


# ----------------------------------------------------------------------------- HF files


def test_chat_template_jinja_is_read_and_preferred_as_transformers_does(tmp_path):
    """A tokenizer directory holding only ``tokenizer.json`` + ``chat_template.jinja``: chat data and
    generation render what ``apply_chat_template`` renders; beside a ``tokenizer_config.json``
    template, the ``.jinja`` file wins (transformers' precedence)."""
    import transformers

    from loom.data.chat import segments, template_render

    d = tmp_path / "tok"
    d.mkdir()
    _tokenizer(d)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the dog"},
        {"role": "assistant", "content": "ran"},
    ]
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(d))
    data = template_render(str(d / "tokenizer.json"))
    assert data is not None
    text, spans = segments({"messages": messages}, "x", "chat", data)
    assert text == ref.apply_chat_template(messages, tokenize=False)
    assert [text[a:b] for a, b in spans] == ["ran\n"]
    prompt = template_render(str(d), generation_prompt=True)
    assert prompt is not None
    want = ref.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt(messages[:2]) == want == "[system] be brief\n[user] the dog\n[assistant] "
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'inline' }}"}))
    again = template_render(str(d))
    assert again is not None and again(messages) == text
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(d))
    assert ref.apply_chat_template(messages, tokenize=False) == text


def test_generation_config_eos_ids_end_a_prompt_at_any_of_them(hf_dir, tmp_path):
    """``generation_config.json``'s ``eos_token_id`` (a list here) ends generation at the first of
    its ids, as ``transformers.generate`` does."""
    import shutil

    from loom.generate.run import complete
    from loom.generate.source import load_hf

    d = tmp_path / "hf"
    shutil.copytree(hf_dir, d)
    src = load_hf(str(d))
    ids = src.tokenizer.encode("the cat").ids
    free = generate_cached(src.model, [ids], GREEDY, frozenset()).tokens[0]
    stop = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    unused = next(t for t in range(src.model.cfg.vocab_size) if t not in free)
    gen = (
        json.loads((d / "generation_config.json").read_text())
        if (d / "generation_config.json").is_file()
        else {}
    )
    (d / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [unused, stop]}))
    src = load_hf(str(d))
    assert src.eos == {unused, stop}
    done = complete(src, ["the cat"], GREEDY)
    assert done.tokens[0] == free[: free.index(stop) + 1]
    (d / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": stop}))
    assert load_hf(str(d)).eos == {stop}


def test_the_models_sampling_defaults_apply_where_no_flag_is_given(hf_dir, tmp_path, capsys):
    """``generation_config.json``'s temperature / top_k / repetition_penalty (do_sample: true, its
    top_p left to transformers' 1.0) are the defaults of ``loom generate``; a flag given wins; fields
    Loom does not implement are named in one warning line; a value out of range is one line naming
    the file."""
    import shutil

    from loom.generate.run import complete
    from loom.generate.source import load_hf

    d = tmp_path / "hf"
    shutil.copytree(hf_dir, d)
    gen = d / "generation_config.json"
    saved = json.loads(gen.read_text()) if gen.is_file() else {}
    model_defaults = {"do_sample": True, "temperature": 0.7, "top_k": 20, "repetition_penalty": 1.3}
    gen.write_text(json.dumps(saved | model_defaults | {"num_beams": 2, "no_repeat_ngram_size": 3}))
    src = load_hf(str(d))
    assert src.sampling == {"temperature": 0.7, "top_k": 20, "top_p": 1.0, "repetition_penalty": 1.3}
    common = ["--model.from_hf", str(d), "--prompt", "the cat", "--max-new-tokens", "10"]
    rc, out, err = _run(capsys, *common, "--temperature", "0")
    greedy = SamplingOptions(max_new_tokens=10, temperature=0)
    want = complete(src, ["the cat"], greedy).texts[0]  # complete takes the model's penalty too
    explicit = SamplingOptions(max_new_tokens=10, temperature=0, repetition_penalty=1.3)
    assert rc == 0 and out == "the cat" + want + "\n"
    assert complete(load_hf(str(hf_dir)), ["the cat"], explicit).texts[0] == want
    assert complete(load_hf(str(hf_dir)), ["the cat"], greedy).texts[0] != want  # the penalty shows
    warned = [line for line in err.splitlines() if "warning" in line]
    said = "loom generate does not implement num_beams, no_repeat_ngram_size; it generates without them"
    assert warned == [f"loom: warning: {gen}: {said}"]
    rc, out, _ = _run(capsys, *common, "--seed", "4")
    sampled = SamplingOptions(max_new_tokens=10, temperature=0.7, top_k=20, repetition_penalty=1.3, seed=4)
    assert rc == 0 and out == "the cat" + complete(load_hf(str(hf_dir)), ["the cat"], sampled).texts[0] + "\n"
    gen.write_text(
        json.dumps(saved | {"do_sample": False})
    )  # the model's default is greedy: --top-k is kept,
    rc, out, err = _run(capsys, *common, "--top-k", "3")  # does nothing, and is named in a warning
    said = "loom: warning: --top-k: no effect under greedy decoding (the default temperature of Hugging Face"
    assert (
        rc == 0
        and [line for line in err.splitlines() if "warning" in line]
        == [line for line in err.splitlines() if line.startswith(said)]
        != []
    )
    gen.write_text(json.dumps(saved | {"top_p": 1.5}))
    rc, _, err = _run(capsys, *common)
    assert rc == 2 and err == f"loom: error: {gen}: top_p: must be in (0, 1] (1 = no nucleus cut), got 1.5\n"


def test_a_config_toml_whose_model_differs_from_the_checkpoint_is_refused_naming_each_field(
    lora_run, tmp_path, capsys
):
    """config.toml edited without changing any tensor's shape (heads regrouped, another window): the
    model would differ from the trained one; refused in one line naming each field. Fields that do
    not change the trained model (dropout, init_std, the base's path) may differ."""
    import shutil

    _, run = lora_run
    other = tmp_path / "run"
    shutil.copytree(run, other)
    toml, ckpt = other / "config.toml", other / "checkpoints" / "step-00000004"
    for edit, said in (
        (
            {"n_heads": 2, "n_kv_heads": 1},
            f"model.n_heads: {toml} says 2, the checkpoint {ckpt} was trained with 4; "
            "model.n_kv_heads: says 1, trained with 2; put the trained values back",
        ),
        (
            {"max_seq_len": 4096},
            f"model.max_seq_len: {toml} says 4096, the checkpoint {ckpt} was trained with 32;",
        ),
        ({"dropout": 0.1, "init_std": 0.5}, None),
    ):
        cfg = C.load_toml(run / "config.toml")
        for key, value in edit.items():
            setattr(cfg.model, key, value)
        toml.write_text(C.dump_toml(cfg))
        rc, _, err = _run(capsys, "--run.dir", str(other), "--max-new-tokens", "2", "--prompt", "a")
        if said is None:
            assert rc == 0, err
        else:
            assert rc == 2 and err.count("\n") == 1 and said in err, err


def test_every_generate_option_is_in_the_usage_and_every_plan_subcommand_in_its_help(capsys):
    """``loom --help`` names each option ``loom generate`` takes (``--repetition-penalty`` was
    accepted but not listed), and ``loom plan --help`` its subcommands."""
    from loom.cli import GENERATE_FLAGS, GENERATE_OPTIONS, GENERATE_SOURCES, USAGE
    from loom.plan.cli import main as plan

    text = " ".join(USAGE.split())
    for flag in [f"--{k.replace('_', '-')}" for k in GENERATE_OPTIONS] + [*GENERATE_FLAGS, *GENERATE_SOURCES]:
        assert flag in text, flag
    with pytest.raises(SystemExit):
        plan(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for sub in ("calibrate", "validate", "verify"):
        assert f"loom plan {sub}" in out, sub


def test_a_chat_prompt_starts_with_the_tokenizers_start_token_as_chat_data_does(hf_dir):
    """A tokenizer whose post-processor starts sequences with a start token (Gemma's <bos>, Llama 3's
    <|begin_of_text|>; here the vocabulary's last token): a chat prompt gets it before the rendered
    conversation, as ``data.bos`` prepares chat examples (once: a template that writes it keeps its
    one); a text prompt has it from the tokenizer itself."""
    import dataclasses

    from tokenizers import Tokenizer, processors

    from loom.generate.source import load_hf

    src = load_hf(str(hf_dir))
    tok = Tokenizer.from_str(src.tokenizer.to_str())
    bos = src.model.cfg.vocab_size - 1
    name = tok.id_to_token(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{name} $A", pair=f"{name} $A {name} $B", special_tokens=[(name, bos)]
    )
    src = dataclasses.replace(src, tokenizer=tok)
    rendered = src.render([{"role": "user", "content": "the dog"}])
    body = tok.encode(rendered, add_special_tokens=False).ids
    assert bos not in body
    assert src.encode("the dog", chat=True) == [bos, *body]
    assert src.encode("the dog", chat=False)[0] == bos
    src.render = lambda m: tok.decode([bos], skip_special_tokens=False) + rendered  # type: ignore[method-assign]
    assert src.encode("the dog", chat=True) == [bos, *body]  # the template's own, not a second
