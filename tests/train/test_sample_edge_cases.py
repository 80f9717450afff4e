"""Sampling edge cases: top-k by index (top_k=1 is greedy even when logits tie), only ids the tokenizer has,
and bad prompts or temperatures refused on one line instead of generating from garbage."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.models.gpt import GPT, GPTConfig
from jaxdist.train import sample
from jaxdist.train.sample import Generator, sample_text

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)


@pytest.fixture(scope="module")
def model():
    return GPT(CFG, nnx.Rngs(4))


def _picks(logits, temperature, top_k, vocab, seeds=range(40)):
    logits = jnp.asarray([logits], jnp.float32)
    return {int(sample._pick(logits, jax.random.key(s), jnp.float32(temperature), top_k, vocab)[0]) for s in seeds}


def test_top_k_keeps_exactly_k_ids_when_logits_tie():
    tied = [1.0, 3.0, 3.0, 3.0, 0.0]
    assert _picks(tied, 1.0, 1, 5) == {1}  # the greedy pick (argmax takes the first of the tied)
    assert _picks(tied, 1.0, 2, 5) == {1, 2}
    assert _picks(tied, 0.0, 0, 5) == {1}


def test_only_ids_below_the_tokenizers_vocabulary_are_drawn_and_greedy_is_their_argmax(model):
    prompt = np.asarray([3, 1, 4, 1, 5])
    drawn = Generator(model, vocab_size=10).generate(prompt, 30, temperature=20.0, seed=1)
    assert drawn.max() < 10 and len(set(drawn.tolist())) > 3
    # reference: the full forward's logits, argmax over the first 10 ids, one token at a time
    forward, ids = nnx.jit(lambda m, t: m(t)), list(prompt)
    for _ in range(8):
        context = np.zeros((1, CFG.seq_len), np.int32)  # padded at the end: causal, so it changes nothing
        context[0, : len(ids)] = ids
        logits = np.asarray(forward(model, jnp.asarray(context)))[0, len(ids) - 1]
        ids.append(int(np.argmax(logits[:10])))
    greedy = Generator(model, vocab_size=10).generate(prompt, 8, temperature=0.0)
    assert greedy.tolist() == ids[len(prompt) :]


class _TenTokens:
    """A tokenizer of 10 tokens for a model of 64: decoding an id it does not have is an error."""

    vocab_size, end_of_text = 10, None

    def encode(self, text):
        return np.asarray([ord(c) % 10 for c in text], np.int32)

    def decode(self, ids):
        assert all(0 <= int(t) < 10 for t in ids), f"drew ids the tokenizer does not have: {list(ids)}"
        return "".join(str(int(t)) for t in ids)


def test_sample_text_draws_within_the_tokenizers_vocabulary(model):
    text = sample_text(model, _TenTokens(), "ab", 25, temperature=20.0, seed=0)
    assert text.startswith("ab") and len(text) == 27


@pytest.mark.parametrize(
    "prompt, match",
    [
        (np.asarray([1, 64]), "prompt token 64 is not an id of the model's vocabulary \\(0 to 63\\)"),
        (np.asarray([-1, 2]), "prompt token -1 is not an id"),
    ],
)
def test_a_prompt_outside_the_vocabulary_is_refused(model, prompt, match):
    with pytest.raises(ValueError, match=match) as e:
        Generator(model).generate(prompt, 2)
    assert "\n" not in str(e.value)


def test_a_negative_count_and_a_seed_past_64_bits_are_refused(model):
    with pytest.raises(ValueError, match="--tokens must be >= 0 and --seed a 64-bit integer, got -1 and 0"):
        Generator(model).generate(np.asarray([1]), -1)
    with pytest.raises(ValueError, match="--seed a 64-bit integer, got 2 and 18446744073709551616"):
        Generator(model).generate(np.asarray([1]), 2, seed=2**64)


def test_a_prompt_of_words_for_a_run_without_tokenizer_and_a_nan_temperature_are_refused(model):
    with pytest.raises(ValueError, match="no tokenizer .*give --prompt as token ids, e.g. '3 14 15', not 'hello'"):
        sample_text(model, None, "hello", 2)
    with pytest.raises(ValueError, match="--temperature must be finite and >= 0, got 0 and nan"):
        sample_text(model, None, "1 2", 2, temperature=float("nan"))


def _saved_run(run_dir, steps=(1, 2), data: dict | None = None):
    """A run directory with a checkpoint per step of CFG's parameters (each step's model seeded by the step),
    as the trainer records them."""
    import dataclasses

    from jaxdist.train.checkpoint import Checkpoints

    ckpt = Checkpoints(run_dir, keep=5)
    meta = {"model": {k: str(v) if "dtype" in k else v for k, v in dataclasses.asdict(CFG).items()}}
    if data is not None:
        meta["data"] = data
    for step in steps:
        params = nnx.to_pure_dict(nnx.state(GPT(CFG, nnx.Rngs(step)), nnx.Param))
        ckpt.save(step, {"params": params}, meta)
    ckpt.close()
    return ckpt.directory


def test_sampling_never_reads_a_corrupt_newest_checkpoint(tmp_path, capfd):
    from jaxdist.train.sample import load_run

    directory = _saved_run(tmp_path)
    data = max((p for p in (directory / "2").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40  # one flipped bit in a parameter: orbax alone reads it back as a wrong value
    data.write_bytes(bytes(raw))
    model, tokenizer, step = load_run(tmp_path)
    assert step == 1 and tokenizer is None
    expected = nnx.state(GPT(CFG, nnx.Rngs(1)), nnx.Param)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(model, nnx.Param), expected)
    assert "checkpoints/2 is unreadable" in capfd.readouterr().err


def test_a_sample_prompt_the_run_cannot_use_is_refused_before_training(tmp_path):
    from jaxdist.train import config as config_lib
    from jaxdist.train.config import ConfigError
    from jaxdist.train.trainer import train

    over = ["data.source=synthetic", "run.sample_tokens=5", "run.sample_prompt=hello", f"run.out_dir={tmp_path}"]
    cfg = config_lib.load(None, ["model.flavor=tiny", "data.batch_size=8", "run.steps=1", *over])
    with pytest.raises(ConfigError, match="no tokenizer .*give run.sample_prompt as token ids") as e:
        train(cfg)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing trained


def test_a_text_run_moved_whole_samples_with_the_tokenizer_prepared_inside_it(tmp_path):
    from jaxdist.train.data.prepare import prepare
    from jaxdist.train.data.shards import content_id
    from jaxdist.train.data.sources import CORPUS
    from jaxdist.train.sample import load_run

    run = tmp_path / "moved-run"  # data.source=text prepared the text into <run.out_dir>/data, then it moved
    prepare([CORPUS], run / "data", train_bpe=300, progress=False)
    _saved_run(run, steps=(1,), data={"dir": str(tmp_path / "old-run" / "data"), "content": content_id(run / "data")})
    assert load_run(run)[1].vocab_size == 300
    (run / "data" / "index.json").write_text((run / "data" / "index.json").read_text().replace('"val_fraction"', '"x"'))
    with pytest.raises(ValueError, match="old-run/data the run trained on .* is gone; give where it is now"):
        load_run(run)  # other data inside the run: not taken for the run's own
