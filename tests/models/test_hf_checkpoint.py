"""Hugging Face safetensors directories read straight onto a target sharding and written back.

The reader is checked against the files themselves (each jaxdist parameter is its named tensor, the
linear weights transposed), per device (every device's shard is the slice it asks for, and only
that slice is read: counted byte by byte for an 8-way sharded target), and for each way a
directory can be wrong (one-line errors). The writer's files are read back with the safetensors
library and compared bit for bit. The model's logits are checked in tests/models/test_hf_logits.py.
"""

import json
import shutil
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from support import hf_configs, hf_reference
from support.meshes import cpu_mesh

from jaxdist.models import hf, hf_config, hf_layout


def hf_model(cfg: dict) -> hf.HFModel:
    """The loader's view of a config.json, without building a model (the reader needs only the layout)."""
    family, kwargs = hf_config.read(cfg)
    return hf.HFModel(family, SimpleNamespace(**kwargs, param_dtype=np.float32), cfg["architectures"][0])


def nested(flat: dict) -> dict:
    out: dict = {}
    for path, leaf in flat.items():
        *parents, last = path.split("/")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaf
    return out


def target(model: hf.HFModel, sharding_of) -> dict:
    return nested(
        {
            t.path: jax.ShapeDtypeStruct(t.shape, np.float32, sharding=sharding_of(t))
            for t in hf_layout.tensors(model.family, model.config)
        }
    )


def one_device(_):
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every architecture's tiny checkpoint, in one file and in three files with an index."""
    out = {}
    for name, cfg in hf_configs.ALL.items():
        weights = hf_reference.random_weights(cfg, seed=1)
        for files in (1, 3):
            path = hf_reference.write_checkpoint(tmp_path_factory.mktemp(f"{name}{files}"), cfg, weights, files)
            out[name, files] = (path, cfg, weights)
    return out


@pytest.mark.parametrize("files", [1, 3])
@pytest.mark.parametrize("name", list(hf_configs.ALL))
def test_each_parameter_is_its_named_tensor_with_linear_weights_transposed(checkpoints, name, files):
    path, cfg, weights = checkpoints[name, files]
    model = hf_model(cfg)
    params = hf.load_params(path, model, target(model, one_device))
    assert hf.flat_paths(params).keys() == {t.path for t in hf_layout.tensors(model.family, model.config)}
    block = params["blocks"]["1"]
    np.testing.assert_array_equal(params["embed"]["embedding"], weights["model.embed_tokens.weight"])
    np.testing.assert_array_equal(block["attn"]["q"]["kernel"], weights["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(block["attn"]["o"]["kernel"], weights["model.layers.1.self_attn.o_proj.weight"].T)
    np.testing.assert_array_equal(block["mlp"]["down"]["kernel"], weights["model.layers.1.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(block["attn_norm"]["scale"], weights["model.layers.1.input_layernorm.weight"])
    np.testing.assert_array_equal(params["final_norm"]["scale"], weights["model.norm.weight"])
    if name.startswith("gemma"):  # the pre-MLP norm is Gemma's pre_feedforward_layernorm, stored as is (1 + w)
        mlp_norm = weights["model.layers.1.pre_feedforward_layernorm.weight"]
        np.testing.assert_array_equal(
            block["post_mlp_norm"]["scale"], weights["model.layers.1.post_feedforward_layernorm.weight"]
        )
    else:
        mlp_norm = weights["model.layers.1.post_attention_layernorm.weight"]
    np.testing.assert_array_equal(block["mlp_norm"]["scale"], mlp_norm)
    if "lm_head.weight" in weights:
        np.testing.assert_array_equal(params["head"]["kernel"], weights["lm_head.weight"].T)
    else:
        assert "head" not in params
    if name == "qwen2":
        np.testing.assert_array_equal(block["attn"]["k"]["bias"], weights["model.layers.1.self_attn.k_proj.bias"])
    if name in ("qwen3", "gemma3"):
        np.testing.assert_array_equal(
            block["attn"]["k_norm"]["scale"], weights["model.layers.1.self_attn.k_norm.weight"]
        )


class CountingReads:
    """Records the bytes of every slice the reader returns, by tensor."""

    def __init__(self, monkeypatch):
        self.reads: dict[str, list[int]] = {}
        original = hf.SafetensorsReader.read

        def read(reader, name, index):
            data = original(reader, name, index)
            self.reads.setdefault(name, []).append(data.nbytes)
            return data

        monkeypatch.setattr(hf.SafetensorsReader, "read", read)


def split_first_dim(mesh):
    def sharding(t):
        return NamedSharding(mesh, P("fsdp") if t.shape[0] % 8 == 0 else P())

    return sharding


def test_an_8_way_sharded_target_reads_each_devices_slice_and_nothing_more(checkpoints, monkeypatch):
    path, cfg, weights = checkpoints["llama", 3]
    model = hf_model(cfg)
    mesh = cpu_mesh((8,), ("fsdp",))
    reads = CountingReads(monkeypatch)
    params = hf.flat_paths(hf.load_params(path, model, target(model, split_first_dim(mesh))))
    layout = {t.path: t for t in hf_layout.tensors(model.family, model.config)}
    model_bytes = sum(w.nbytes for w in weights.values())
    assert sum(sum(r) for r in reads.reads.values()) == model_bytes  # every byte once: no whole copy per device
    for path_, x in params.items():
        t = layout[path_]
        whole = weights[t.name].T if t.transpose else weights[t.name]
        assert x.shape[0] % 8 == 0  # every tiny-llama parameter splits 8 ways along its first dimension
        assert len(reads.reads[t.name]) == 8 and max(reads.reads[t.name]) == whole.nbytes // 8, t.name
        for shard in x.addressable_shards:  # each device holds exactly its slice of the file's tensor
            assert shard.data.nbytes == whole.nbytes // 8
            np.testing.assert_array_equal(np.asarray(shard.data), whole[shard.index])


def test_the_read_count_sees_a_whole_copy(checkpoints, monkeypatch):
    """The control: a replicated target reads each tensor whole (once: the 8 devices share the read)."""
    path, cfg, weights = checkpoints["llama", 1]
    model = hf_model(cfg)
    mesh = cpu_mesh((8,), ("fsdp",))
    reads = CountingReads(monkeypatch)
    hf.load_params(path, model, target(model, lambda t: NamedSharding(mesh, P())))
    assert {n: r for n, r in reads.reads.items()} == {n: [w.nbytes] for n, w in weights.items()}


def test_a_target_of_shardings_takes_the_models_param_dtype(checkpoints):
    path, cfg, weights = checkpoints["qwen3", 1]
    model = hf_model(cfg)
    shardings = nested({t.path: one_device(t) for t in hf_layout.tensors(model.family, model.config)})
    params = hf.load_params(path, model, shardings)
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float32)}


def test_bfloat16_files_load_into_float32_parameters(tmp_path):
    cfg = hf_configs.QWEN3
    weights = hf_reference.random_weights(cfg, seed=2, dtype=jax.numpy.bfloat16)
    hf_reference.write_checkpoint(tmp_path, cfg, weights)
    model = hf_model(cfg)
    params = hf.load_params(tmp_path, model, target(model, one_device))
    got = params["blocks"]["0"]["mlp"]["up"]["kernel"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, weights["model.layers.0.mlp.up_proj.weight"].astype(np.float32).T)


def broken(tmp_path, change, cfg=hf_configs.LLAMA):
    weights = hf_reference.random_weights(cfg)
    change(weights)
    return hf_reference.write_checkpoint(tmp_path, cfg, weights)


def drop_k(w):
    del w["model.layers.1.self_attn.k_proj.weight"]


def add_extra(w):
    w["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)


def wrong_shape(w):
    w["model.layers.0.mlp.up_proj.weight"] = np.zeros((64, 31), np.float32)


def as_int(w):
    w["model.norm.weight"] = np.ones(32, np.int8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (drop_k, "missing tensor model.layers.1.self_attn.k_proj.weight (jaxdist's blocks/1/attn/k/kernel)"),
        (add_extra, "unexpected tensor model.layers.0.self_attn.o_proj.bias"),
        (wrong_shape, "tensor model.layers.0.mlp.up_proj.weight has shape [64, 31] in"),
        (as_int, "tensor model.norm.weight is stored as I8"),
    ],
)
def test_a_checkpoint_unlike_its_config_names_the_first_mismatch_on_one_line(tmp_path, change, message):
    path = broken(tmp_path, change)
    with pytest.raises(hf.HFCheckpointError) as e:
        hf.load_params(path, hf_model(hf_configs.LLAMA), target(hf_model(hf_configs.LLAMA), one_device))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_old_rotary_buffers_and_a_tied_models_stored_head_are_ignored(tmp_path):
    cfg = hf_configs.QWEN3
    weights = hf_reference.random_weights(cfg)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].copy()
    hf_reference.write_checkpoint(tmp_path, cfg, weights)
    model = hf_model(cfg)
    assert "head" not in hf.load_params(tmp_path, model, target(model, one_device))


def test_a_directory_without_weights_or_with_a_missing_shard_is_refused(tmp_path, checkpoints):
    (tmp_path / "config.json").write_text(json.dumps(hf_configs.LLAMA))
    with pytest.raises(hf.HFCheckpointError, match="has no model.safetensors or model.safetensors.index.json"):
        hf.weight_files(tmp_path)
    path, _, _ = checkpoints["llama", 3]
    for file in path.glob("*.safetensors"):
        shutil.copyfile(file, tmp_path / file.name)
    index = json.loads((path / hf.INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (tmp_path / hf.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(hf.HFCheckpointError, match="model-00009-of-00009.safetensors, named by"):
        hf.weight_files(tmp_path)


def test_a_target_unlike_the_layout_is_refused(checkpoints):
    path, cfg, _ = checkpoints["llama", 1]
    model = hf_model(cfg)
    tree = target(model, one_device)
    tree["blocks"]["0"]["attn"]["q"]["bias"] = jax.ShapeDtypeStruct((32,), np.float32, sharding=one_device(None))
    with pytest.raises(hf.HFCheckpointError, match="the model's parameter blocks/0/attn/q/bias has no Hugging Face"):
        hf.load_params(path, model, tree)


@pytest.mark.parametrize("name", list(hf_configs.ALL))
def test_saved_files_hold_the_same_tensors_bit_for_bit_in_several_shards(checkpoints, tmp_path, name):
    path, cfg, weights = checkpoints[name, 1]
    model = hf_model(cfg)
    mesh = cpu_mesh((8,), ("fsdp",))
    params = hf.load_params(path, model, target(model, split_first_dim(mesh)))
    out = hf.save(tmp_path / "out", params, model.family, model.config, shard_bytes=4096)
    index = json.loads((out / hf.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(w.nbytes for w in weights.values())
    read = {}
    for file in files:
        with safe_open(out / file, "numpy") as f:
            assert f.metadata() == {"format": "pt"}
            size = sum(
                f.get_slice(k).get_shape()[0] * 4 * int(np.prod(f.get_slice(k).get_shape()[1:])) for k in f.keys()
            )
            assert size <= 4096 or len(f.keys()) == 1
            read.update({k: f.get_tensor(k) for k in f.keys()})
    assert read.keys() == weights.keys()
    for k, w in weights.items():
        np.testing.assert_array_equal(read[k], w)
    assert index["weight_map"] == {k: file for file in files for k in safe_open(out / file, "numpy").keys()}


@pytest.mark.parametrize("name", list(hf_configs.ALL))
def test_written_config_reads_back_as_the_same_model(checkpoints, tmp_path, name):
    path, cfg, _ = checkpoints[name, 1]
    model = hf_model(cfg)
    params = hf.load_params(path, model, target(model, one_device))
    out = hf.save(tmp_path / "out", params, model.family, model.config, dtype=jax.numpy.bfloat16)
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == cfg["architectures"] and written["torch_dtype"] == "bfloat16"
    assert hf_config.read(written) == hf_config.read(cfg)
    assert (out / hf.SINGLE_FILE).is_file() and not (out / hf.INDEX_FILE).exists()
    with safe_open(out / hf.SINGLE_FILE, "numpy") as f:
        assert f.get_slice("model.norm.weight").get_dtype() == "BF16"


def test_saving_onto_an_existing_directory_is_refused(tmp_path, checkpoints):
    path, cfg, _ = checkpoints["llama", 1]
    model = hf_model(cfg)
    params = hf.load_params(path, model, target(model, one_device))
    with pytest.raises(hf.HFCheckpointError, match="already exists; pick a new output path"):
        hf.save(path, params, model.family, model.config)


@pytest.mark.parametrize(("dtype", "stored"), [("bf16", "BF16"), ("fp16", "F16"), ("float32", "F32")])
def test_a_storage_dtype_may_be_given_by_its_short_name(tmp_path, checkpoints, dtype, stored):
    path, cfg, _ = checkpoints["llama", 1]
    model = hf_model(cfg)
    out = hf.save(
        tmp_path / "out", hf.load_params(path, model, target(model, one_device)), "llama", model.config, dtype=dtype
    )
    with safe_open(out / hf.SINGLE_FILE, "numpy") as f:
        assert f.get_slice("model.norm.weight").get_dtype() == stored


@pytest.mark.parametrize(("dtype", "message"), [("bf17", "'bf17': not a dtype"), ("int8", "as int8")])
def test_a_storage_dtype_that_is_no_float_is_refused_on_one_line(tmp_path, checkpoints, dtype, message):
    path, cfg, _ = checkpoints["llama", 1]
    model = hf_model(cfg)
    params = hf.load_params(path, model, target(model, one_device))
    with pytest.raises(hf.HFCheckpointError, match=f"{message}; choose float32, bfloat16 or float16$"):
        hf.save(tmp_path / "out", params, "llama", model.config, dtype=dtype)
    assert not (tmp_path / "out").exists()


def test_keys_jaxdist_does_not_model_come_from_the_source_config_of_the_same_architecture():
    from jaxdist.models import LlamaConfig, hf_config

    written = hf_config.write("llama", LlamaConfig(**hf_config.read(hf_configs.LLAMA)[1]), "float32")
    source = {**hf_configs.LLAMA, "eos_token_id": 7, "pad_token_id": 0, "max_position_embeddings": 131072}
    carried = hf.carry_keys(written, source)
    assert (carried["eos_token_id"], carried["pad_token_id"], carried["max_position_embeddings"]) == (7, 0, 131072)
    shorter = hf.carry_keys(written, {**source, "max_position_embeddings": 8})  # never below the trained length
    assert shorter["max_position_embeddings"] == written["max_position_embeddings"]
    # the same family: a Mistral without a window is written back as a Llama, and keeps its token ids
    assert hf.carry_keys(written, {**source, "architectures": ["MistralForCausalLM"]})["eos_token_id"] == 7
    assert hf.carry_keys(written, {**source, "architectures": ["Gemma3ForCausalLM"]}) == written
    assert hf.carry_keys(written, {**source, "architectures": ["GPT2LMHeadModel"]}) == written
    assert hf.carry_keys(written, None) == written
