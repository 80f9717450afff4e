"""The layouts checkpoints convert between, over the 8 simulated CPU devices, on a tiny GPT."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdist.ddp.run import DDP
from jaxdist.engine.run import Parallel
from jaxdist.models.gpt import GPT, UNITS, GPTConfig, next_token_loss, tp_plan_for
from jaxdist.train.checkpoint import Checkpoints
from support.meshes import cpu_mesh

GPT_CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
PLAN = tp_plan_for(GPT_CFG)

# name -> a function (model, optimizer, example batch) -> a prepared run
LAYOUTS = {
    "ddp8": lambda m, o, b: DDP(cpu_mesh((8,), ("dp",))).prepare(m, o, next_token_loss, b),
    "zero1-8": lambda m, o, b: DDP(cpu_mesh((8,), ("dp",)), zero1=True).prepare(m, o, next_token_loss, b),
    "engine-dp8": lambda m, o, b: Parallel(cpu_mesh((8,), ("dp",)), zero1=False).prepare(m, o, UNITS, b),
    "engine-zero1-8": lambda m, o, b: Parallel(cpu_mesh((8,), ("dp",))).prepare(m, o, UNITS, b),
    "fsdp8": lambda m, o, b: Parallel(cpu_mesh((8,), ("fsdp",))).prepare(m, o, UNITS, b),
    "hsdp2x4": lambda m, o, b: Parallel(cpu_mesh((2, 4), ("dp", "fsdp"))).prepare(m, o, UNITS, b),
    "dp4xtp2": lambda m, o, b: Parallel(cpu_mesh((4, 2), ("dp", "tp")), plan=PLAN).prepare(m, o, UNITS, b),
    "fsdp-tp2x2x2": lambda m, o, b: Parallel(cpu_mesh((2, 2, 2), ("dp", "fsdp", "tp")), plan=PLAN).prepare(
        m, o, UNITS, b
    ),
    "one": lambda m, o, b: DDP(cpu_mesh((1,), ("dp",))).prepare(m, o, next_token_loss, b),
}


def make_model(seed: int = 0) -> GPT:
    from flax import nnx

    return GPT(GPT_CFG, nnx.Rngs(seed))


def batches(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"tokens": rng.integers(0, 64, (16, 17)).astype(np.int32)} for _ in range(n)]


SPLIT, STEPS = 3, 6
# a schedule, so a step count that did not survive a restore shows in the learning rate
OPTIMIZER = optax.adamw(optax.linear_schedule(1e-2, 1e-3, STEPS), weight_decay=0.1)
DATA = batches(STEPS)


class Trained:
    """One layout's prepared run and its uninterrupted 6-step run: the losses, the final canonical
    parameters, a checkpoint of step 3, and the state and canonical state of step 3."""

    def __init__(self, name: str, directory):
        self.run = LAYOUTS[name](make_model(), OPTIMIZER, DATA[0])
        self.ckpt = Checkpoints(directory, keep=1)
        state, self.losses = self.run.state, []
        for i, batch in enumerate(DATA):
            state, metrics = self.run.step(state, batch)
            self.losses.append(float(metrics["loss"]))
            if i + 1 == SPLIT:
                self.canonical_at_split = self.run.canonical(state)
                self.state_at_split = jax.tree.map(jnp.copy, state)  # the next step donates `state`
                self.ckpt.save(SPLIT, self.canonical_at_split, {"layout": name})
        self.ckpt.wait()
        self.final = self.run.canonical(state).params


def trained_layouts_once(tmp_path_factory):
    """`get(name) -> Trained`, each layout trained once per test run (compiling is the cost);
    tests/conftest.py makes it the run-wide fixture `trained_layouts`."""
    made = {}

    def get(name: str) -> Trained:
        if name not in made:
            made[name] = Trained(name, tmp_path_factory.mktemp(name))
        return made[name]

    yield get
    for layout in made.values():
        layout.ckpt.close()


def trained(layout, optimizer, data):
    run = LAYOUTS[layout](make_model(), optimizer, data[0])
    state = run.state
    for batch in data:
        state, _ = run.step(state, batch)
    return run, state
