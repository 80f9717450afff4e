"""Sampling: the KV-cache decode path against the model's own full forward, and the `jaxdist sample` command."""

import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.models.gpt import GPT, GPTConfig
from jaxdist.train import cli
from jaxdist.train import config as config_lib
from jaxdist.train.sample import Generator, load_run
from jaxdist.train.trainer import train

REPO = Path(__file__).resolve().parents[2]
CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)


def greedy_without_cache(model: GPT, prompt, n: int) -> list[int]:
    """Argmax step by step with the full forward on the context; when the context would exceed
    seq_len it restarts from the newest seq_len // 2 tokens (the policy the generator documents)."""
    forward = nnx.jit(lambda m, t: m(t))
    ids, start = list(prompt), 0
    for _ in range(n):
        if len(ids) - start > CFG.seq_len:
            start = len(ids) - CFG.seq_len // 2
        context = np.zeros((1, CFG.seq_len), np.int32)  # padded at the end: causal, so it changes nothing
        context[0, : len(ids) - start] = ids[start:]
        logits = np.asarray(forward(model, jnp.asarray(context)))[0, len(ids) - start - 1]
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt) :]


def test_decode_chunks_give_the_logits_of_the_full_forward():
    model = GPT(CFG, nnx.Rngs(1))
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, CFG.seq_len))
    full = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
    decode = nnx.jit(lambda m, t, c, p: m.decode(t, c, p))
    cache = model.empty_cache(2)
    first, cache = decode(model, jnp.asarray(tokens[:, :5]), cache, jnp.int32(0))  # prefill 5, then one at a time
    pieces = [np.asarray(first)]
    for pos in range(5, CFG.seq_len):
        logits, cache = decode(model, jnp.asarray(tokens[:, pos : pos + 1]), cache, jnp.int32(pos))
        pieces.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [10, 40])  # within seq_len, and past it (the context restarts twice)
def test_temperature_zero_equals_argmax_without_cache(n):
    model = GPT(CFG, nnx.Rngs(2))
    prompt = [3, 14, 15, 9, 26]
    expected = greedy_without_cache(model, prompt, n)
    got = Generator(model).generate(np.asarray(prompt), n, temperature=0.0)
    assert got.tolist() == expected
    assert len(set(expected)) > 3  # not a constant stream


def test_top_k_one_is_greedy_and_sampling_is_seeded():
    model = GPT(CFG, nnx.Rngs(3))
    gen = Generator(model)
    prompt = np.asarray([1, 2, 3])
    greedy = gen.generate(prompt, 12, temperature=0.0)
    np.testing.assert_array_equal(gen.generate(prompt, 12, temperature=1.5, top_k=1, seed=7), greedy)
    a, b = (gen.generate(prompt, 12, temperature=1.5, seed=s) for s in (7, 7))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, greedy)
    assert not np.array_equal(a, gen.generate(prompt, 12, temperature=1.5, seed=8))


def test_sample_command_continues_the_prompt_with_the_runs_tokenizer(tmp_path, capsys):
    out = tmp_path / "run"
    over = ["model.flavor=tiny", "data.batch_size=16", "run.steps=2", "run.progress=false", "data.tokenizer=bpe:300"]
    train(config_lib.load(None, [*over, "model.vocab_size=320", f"run.out_dir={out}"]))
    model, tokenizer, step = load_run(out)
    assert step == 2 and tokenizer.vocab_size == 300
    prompt = "The river"
    ids = Generator(model, tokenizer.vocab_size).generate(tokenizer.encode(prompt), 20, temperature=0.0)
    cmd = [sys.executable, "-m", "jaxdist.train.cli", "sample", str(out), "--prompt", prompt, "--tokens", "20"]
    done = subprocess.run([*cmd, "--temperature", "0"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == prompt + tokenizer.decode(ids) + "\n"
    # a directory without a run: status 2 and one line (in this process; the command itself ran above)
    capsys.readouterr()
    assert cli.main(["sample", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no checkpoints" in err
