"""Which Hugging Face tensor each jaxdist parameter is: names, shapes and the transposes between them.

A model family's parameters are listed from its config alone (`tensors`), each with its jaxdist
path (`blocks/3/attn/q/kernel`), its Hugging Face name (`model.layers.3.self_attn.q_proj.weight`),
its shape in jaxdist and whether Hugging Face stores it transposed (torch's Linear keeps weights
as (out, in), jaxdist's kernels are (in, out)). RoPE is in Hugging Face's rotate_half layout in
both, so q/k weights need no permutation; Gemma's norm scales are stored as they are (its RMSNorm
multiplies by 1 + scale in both).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Tensor:
    path: str  # the jaxdist parameter, '/'-joined pure-dict keys
    name: str  # the Hugging Face tensor
    shape: tuple[int, ...]  # in jaxdist's layout
    transpose: bool = False  # Hugging Face stores the 2-D kernel as (out, in)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape)) if self.transpose else self.shape


# buffers some older checkpoints saved beside the weights; they are recomputed, never read
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _linear(path: str, name: str, n_in: int, n_out: int) -> Tensor:
    return Tensor(f"{path}/kernel", f"{name}.weight", (n_in, n_out), transpose=True)


def _norm(path: str, name: str, n: int) -> Tensor:
    return Tensor(f"{path}/scale", f"{name}.weight", (n,))


def tensors(family: str, cfg) -> list[Tensor]:
    """Every parameter of a `family` ("llama" or "gemma") model of config `cfg`, in checkpoint order."""
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.d_ff
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    gemma = family == "gemma"
    qk_norm = getattr(cfg, "qk_norm", True) if gemma else cfg.qk_norm
    out = [Tensor("embed/embedding", "model.embed_tokens.weight", (cfg.vocab_size, d))]
    for i in range(cfg.n_layers):
        p, h = f"blocks/{i}", f"model.layers.{i}"
        out.append(_norm(f"{p}/attn_norm", f"{h}.input_layernorm", d))
        for part, width in (("q", q), ("k", kv), ("v", kv)):
            out.append(_linear(f"{p}/attn/{part}", f"{h}.self_attn.{part}_proj", d, width))
            if not gemma and cfg.qkv_bias:
                out.append(Tensor(f"{p}/attn/{part}/bias", f"{h}.self_attn.{part}_proj.bias", (width,)))
        out.append(_linear(f"{p}/attn/o", f"{h}.self_attn.o_proj", q, d))
        if qk_norm:
            out.append(_norm(f"{p}/attn/q_norm", f"{h}.self_attn.q_norm", hd))
            out.append(_norm(f"{p}/attn/k_norm", f"{h}.self_attn.k_norm", hd))
        if gemma:
            out.append(_norm(f"{p}/post_attn_norm", f"{h}.post_attention_layernorm", d))
            out.append(_norm(f"{p}/mlp_norm", f"{h}.pre_feedforward_layernorm", d))
            out.append(_norm(f"{p}/post_mlp_norm", f"{h}.post_feedforward_layernorm", d))
        else:
            out.append(_norm(f"{p}/mlp_norm", f"{h}.post_attention_layernorm", d))
        out.append(_linear(f"{p}/mlp/gate", f"{h}.mlp.gate_proj", d, f))
        out.append(_linear(f"{p}/mlp/up", f"{h}.mlp.up_proj", d, f))
        out.append(_linear(f"{p}/mlp/down", f"{h}.mlp.down_proj", f, d))
    out.append(_norm("final_norm", "model.norm", d))
    if not gemma and not cfg.tie_embeddings:
        out.append(_linear("head", "lm_head", d, cfg.vocab_size))
    return out


def tied(family: str, cfg) -> bool:
    """Whether the head is the embedding (then a stored lm_head.weight, which some savers keep, is a copy)."""
    return family == "gemma" or bool(cfg.tie_embeddings)
