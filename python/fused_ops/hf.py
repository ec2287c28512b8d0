"""Patching Hugging Face Llama-family models in place so that they compute with the fused ops.

    model = transformers.AutoModelForCausalLM.from_pretrained("meta-llama/Meta-Llama-3-8B", ...)
    report = fused_ops.hf.apply_fused_ops(model)        # or apply_fused_ops_to_llama(model)

Per decoder layer, with the same parameter tensors (state_dict keys, checkpoints, optimizer state and
`save_pretrained` are unchanged):
- MLP: `down_proj(silu(gate_proj(x)) * up_proj(x))` becomes one `torch.ops.fused.ffn(x, gate, up, down)`.
- RoPE: q and k are rotated by one `torch.ops.fused.rope_fwd_qk` from the angles `position_ids * inv_freq`, computed
  exactly as HF computes them (after any rope scaling such as llama3's), instead of HF's cos/sin elementwise chain.

How, and why this way. The MLP module keeps its class and children; only its `forward` is rebound on the instance.
RoPE cannot be reached per instance: HF's attention forward calls its module's global `apply_rotary_pos_emb(q, k,
cos, sin)`, and copying that forward would silently drop whatever a later transformers version adds to it. So the
model's rotary embedding (rebound per instance) tags the `cos` tensor it returns with the angles, and the modeling
module's `apply_rotary_pos_emb` is replaced, once, by a dispatcher that takes the fused path only for a tagged `cos`
and calls HF's original for everything else: unpatched models of the same class run HF's code unchanged.

HF's path is kept (never a wrong answer) where the fused op would not give HF's result:
- `attention_scaling != 1` (yarn, longrope): HF multiplies cos/sin by it; the op has no such factor. Checked when
  patching (RoPE is then left alone, and the report says so) and again at every call.
- a projection of the MLP that is no longer a plain bias-free, hook-free nn.Linear at call time (e.g. PEFT wrapped
  it after patching): that layer's MLP runs HF's forward.
- a `cos` without the tag (a copy of it, or one a caller built), unusual call arguments, q/k the op does not take.
Per-sequence position_ids (left padding in `generate`) are handled exactly: each token gets its own angle.
Activation checkpointing (reentrant or not) and `torch.compile(fullgraph=True)` keep the fused path (tested).

Cost left: the rotary embedding still builds HF's cos/sin once per forward (shared by all layers, tiny) beside the
float32 angle table `[B, s, head_dim]`; per layer the MLP is one op instead of five and RoPE one instead of about ten.

Nothing here imports transformers: models are recognised by `config.model_type` and their classes' names.
"""
import copy
import dataclasses
import inspect
import warnings
from typing import Dict, Iterable, List, Tuple

import torch
from torch import nn

from .ffn import _swiglu_weights

__all__ = ["apply_fused_ops", "apply_fused_ops_to_llama", "remove_fused_ops", "FusedPatchReport", "SUPPORTED"]

#: config.model_type -> the prefix of its transformers classes (LlamaMLP, LlamaAttention, LlamaRotaryEmbedding):
#: the models whose MLP is bias-free gate/up/down + SiLU and whose RoPE is rotate_half over the whole head.
SUPPORTED: Dict[str, str] = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}

_ANGLES = "_fused_ops_rope_angles"  # attribute the patched rotary embedding sets on the cos it returns
_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class FusedPatchReport:
    """What computes with the fused ops after a call of `apply_fused_ops` (including earlier patches)."""

    model_type: str
    mlp_layers: Tuple[int, ...]  # decoder layers whose MLP runs torch.ops.fused.ffn
    rope: bool  # q/k RoPE of every layer runs torch.ops.fused.rope_fwd_qk
    notes: Tuple[str, ...] = ()  # what was left on HF's path, and why

    def __str__(self) -> str:
        lines = [f"fused_ops.hf: {self.model_type}: fused MLP in {len(self.mlp_layers)} layer(s), "
                 f"fused RoPE {'on' if self.rope else 'off'}"]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


# ------------------------------------------------------------------------------------------------------------------
# the replacement forwards


def _plain_linear(lin) -> bool:
    # The fused MLP reads .weight directly: anything a hook, a bias or a wrapper class (PEFT's LoRA, a quantized or
    # parametrized linear) would add to nn.Linear's computation would be lost.
    # accelerate's hooks (device_map, offloading) replace the instance's forward instead of registering hooks.
    return (type(lin) is nn.Linear and lin.bias is None and not lin._forward_hooks and not lin._forward_pre_hooks
            and not lin._backward_hooks and not lin._backward_pre_hooks and "forward" not in lin.__dict__)


# The instance attribute of a patched MLP that holds apply_fused_ops' `recompute` (not a parameter or buffer: the state
# dict does not see it).
_RECOMPUTE = "_fused_ops_recompute"


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """x: `[b, s, H]` -> `[b, s, H]`, HF's `down_proj(act_fn(gate_proj(x)) * up_proj(x))` as one fused op."""
    if _plain_linear(self.gate_proj) and _plain_linear(self.up_proj) and _plain_linear(self.down_proj):
        return torch.ops.fused.ffn(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                                   recompute=self.__dict__.get(_RECOMPUTE, False))
    return type(self).forward(self, x)  # changed after patching (e.g. PEFT wrapped a projection): HF's path


def _rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
    """HF's forward (cos, sin `[B, s, d]`), with cos tagged by the angles `[B, s, d]` it was computed from."""
    cos, sin = type(self).forward(self, x, position_ids, *args, **kwargs)  # runs HF's dynamic rope update first
    scaling = self.attention_scaling
    if (isinstance(scaling, (int, float)) and scaling == 1.0 and isinstance(position_ids, torch.Tensor)
            and position_ids.dim() == 2 and cos.dim() == 3 and cos.shape[-1] == 2 * self.inv_freq.numel()):
        with torch.no_grad():
            # HF's own product (position as float32 times float32 inv_freq, exact for positions < 2^24), so the
            # fused op sees bit-identical angles; it takes cos/sin of them in fp32 as HF does before its cast.
            freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq.to(cos.device, torch.float32)
            setattr(cos, _ANGLES, torch.cat((freqs, freqs), dim=-1))  # [B, s, d]: rotate_half's layout
    return cos, sin


def _fused_rope_qk(q: torch.Tensor, k: torch.Tensor, angles: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """HF's apply_rotary_pos_emb on q `[b, hq, s, d]`, k `[b, hk, s, d]` with angles `[B, s, d]`, B in (1, b)."""
    b, hq, s, d = q.shape
    hk = k.shape[1]
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # [b, s, h, d]: HF's q/k are transposed views of this layout
    if angles.shape[0] == 1:  # positions shared by the batch: a [s, 1, 1, d] table indexed by the row
        qo, ko = torch.ops.fused.rope_fwd_qk(qt, kt, angles.reshape(s, 1, 1, d), tensor_format="bshd")
    else:
        # Positions differ per sequence: the b*s tokens as one sequence (sbhd, batch 1), token r at position r of a
        # table holding each token's own angle. Exact for any position_ids; a view when b and s merge (they do for
        # HF's projections), so nothing is copied.
        qo, ko = torch.ops.fused.rope_fwd_qk(qt.reshape(b * s, 1, hq, d), kt.reshape(b * s, 1, hk, d),
                                             angles.reshape(b * s, 1, 1, d), tensor_format="sbhd")
        qo, ko = qo.view(b, s, hq, d), ko.view(b, s, hk, d)
    return qo.transpose(1, 2), ko.transpose(1, 2)


def _fusable(q, k, angles) -> bool:
    ok_dtype = q.dtype in (torch.float32, torch.float16, torch.bfloat16) or (
        q.dtype == torch.float64 and q.device.type == "cpu")
    return (ok_dtype and q.dim() == 4 and k.dim() == 4 and angles.dim() == 3 and k.dtype == q.dtype
            and q.device == k.device == angles.device and k.shape[0] == q.shape[0] and k.shape[2:] == q.shape[2:]
            and angles.shape[0] in (1, q.shape[0]) and angles.shape[1:] == q.shape[2:])


def _make_rope_dispatch(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        angles = getattr(cos, _ANGLES, None)
        if (angles is None or args or set(kwargs) - {"unsqueeze_dim"} or kwargs.get("unsqueeze_dim", 1) != 1
                or not _fusable(q, k, angles)):
            return original(q, k, cos, sin, *args, **kwargs)
        return _fused_rope_qk(q, k, angles)

    apply_rotary_pos_emb.__doc__ = ("fused_ops.hf: torch.ops.fused.rope_fwd_qk for the cos of a patched model's "
                                    "rotary embedding, HF's original (`_fused_ops_original`) otherwise.")
    apply_rotary_pos_emb._fused_ops_original = original
    return apply_rotary_pos_emb


def _is_bound(module: nn.Module, fn) -> bool:
    bound = module.__dict__.get("forward")
    return getattr(bound, "__func__", None) is fn


def _bind(module: nn.Module, fn) -> None:
    module.forward = fn.__get__(module, type(module))  # an instance attribute: shadows the class's forward


# ------------------------------------------------------------------------------------------------------------------
# checks (all before any change)


def _attn_globals(attn) -> dict:
    """The namespace HF's attention forward resolves `apply_rotary_pos_emb` in (its modeling module)."""
    fn = inspect.unwrap(type(attn).forward)  # through decorators such as deprecate_kwarg
    if "apply_rotary_pos_emb" not in fn.__code__.co_names:
        raise ValueError(f"fused_ops.hf: {type(attn).__name__}.forward of this transformers version does not call "
                         "apply_rotary_pos_emb; pass rope=False to patch the MLPs only")
    return fn.__globals__


def _check_rope(rotary, attn, owner: str) -> None:
    """Checks on CPU copies that HF's rotary embedding and apply_rotary_pos_emb compute what the fused path does."""
    head_dim = getattr(attn, "head_dim", None)
    inv = getattr(rotary, "inv_freq", None)
    if not isinstance(inv, torch.Tensor) or inv.dim() != 1 or head_dim != 2 * inv.numel():
        raise ValueError(f"{owner}: rotary inv_freq {None if inv is None else tuple(inv.shape)} does not cover "
                         f"head_dim {head_dim} (partial rotary is not Llama's RoPE)")
    if inv.is_meta:
        raise ValueError(f"{owner}: the rotary embedding is on the meta device; load the weights first")
    probe = copy.deepcopy(rotary).to("cpu")  # a copy: a dynamic rope type updates its state in forward
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 300]])
    cos, sin = type(probe).forward(probe, torch.ones(1), pos)
    freqs = pos.float()[..., None] * probe.inv_freq.float()
    angles = torch.cat((freqs, freqs), dim=-1)
    scaling = float(probe.attention_scaling)
    if not (torch.allclose(cos.float(), angles.cos() * scaling, atol=1e-5)
            and torch.allclose(sin.float(), angles.sin() * scaling, atol=1e-5)):
        raise ValueError(f"{owner}: {type(rotary).__name__} does not compute cos/sin of position_ids * inv_freq; "
                         "pass rope=False")
    original = _attn_globals(attn)["apply_rotary_pos_emb"]
    original = getattr(original, "_fused_ops_original", original)
    gen = torch.Generator().manual_seed(0)  # not the global RNG: checking must change nothing
    q = torch.randn(2, 4, 6, head_dim, generator=gen)
    k = torch.randn(2, 2, 6, head_dim, generator=gen)
    want = original(q, k, angles.cos(), angles.sin())
    got = _fused_rope_qk(q, k, angles)
    if not all(torch.allclose(g, w, rtol=1e-4, atol=1e-5) for g, w in zip(got, want)):
        raise ValueError(f"{owner}: this transformers version's apply_rotary_pos_emb is not rotate_half RoPE; "
                         "pass rope=False")


def _layers_of(model: nn.Module, owner: str, allowed: Iterable[str]) -> Tuple[str, str, nn.Module]:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise ValueError(f"{owner}: expected a transformers model (with .config.model_type), "
                         f"got {type(model).__name__}")
    if model_type not in allowed:
        raise ValueError(f"{owner}: {type(model).__name__} (model_type {model_type!r}) is not supported; "
                         f"supported: {', '.join(sorted(allowed))}")
    base = getattr(model, "base_model", model)
    if not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise ValueError(f"{owner}: {type(base).__name__} has no decoder `layers` (nn.ModuleList)")
    return model_type, SUPPORTED[model_type], base


def _check_own_forward(module: nn.Module, where: str, ours) -> None:
    if "forward" in module.__dict__ and not _is_bound(module, ours):
        raise ValueError(f"{where} has an instance-level forward set by other code (e.g. accelerate's device_map "
                         "hooks); replacing it would drop that code")


def _check_layer(i: int, layer: nn.Module, prefix: str, mlp: bool, rope: bool, owner: str) -> None:
    where = f"{owner}: layers[{i}]"
    if mlp:
        m = getattr(layer, "mlp", None)
        if type(m).__name__ != prefix + "MLP":
            raise ValueError(f"{where}.mlp is {type(m).__name__}, expected {prefix}MLP")
        _check_own_forward(m, where + ".mlp", _mlp_forward)
        for name in _PROJ:
            lin = getattr(m, name, None)
            if type(lin) is not nn.Linear:
                raise ValueError(f"{where}.mlp.{name} is {type(lin).__name__}, not a plain nn.Linear (a PEFT or "
                                 "quantized layer would be bypassed)")
        _swiglu_weights(m, where + ".mlp")  # bias-free gate/up/down of consistent shapes, SiLU act_fn
        hooked = [name for name in _PROJ if not _plain_linear(getattr(m, name))]
        if hooked:
            raise ValueError(f"{where}.mlp.{hooked[0]} has hooks (e.g. accelerate's device_map or offloading); "
                             "the fused MLP would bypass them")
    if rope and type(getattr(layer, "self_attn", None)).__name__ != prefix + "Attention":
        raise ValueError(f"{where}.self_attn is {type(getattr(layer, 'self_attn', None)).__name__}, expected "
                         f"{prefix}Attention")


# ------------------------------------------------------------------------------------------------------------------
# public entry points


def apply_fused_ops(model: nn.Module, *, mlp: bool = True, rope: bool = True,
                    recompute: bool = False) -> FusedPatchReport:
    """Patches a transformers Llama-family model (Llama, Mistral, Qwen2; `*Model` or `*ForCausalLM` etc.) in place.

    Args:
        model: the model; its parameters are used as they are (no copy, any device and dtype the ops support).
        mlp: every decoder layer's MLP computes with `torch.ops.fused.ffn` (single expert).
        rope: the attention's RoPE on q and k computes with `torch.ops.fused.rope_fwd_qk`.
        recompute: the fused MLPs keep no activations for the backward and compute gate and up again there
            (`fused_ops.ffn`'s `recompute`: less memory in training, two more GEMMs per layer). Default False: they
            keep the gate and up pre-activations (2 * intermediate_size elements per token and layer).
    Returns a FusedPatchReport of what now runs fused (earlier patches included). Calling it again is harmless.
    Raises ValueError, naming the module and the reason, before changing anything, for a model that is not
    Llama-family (another model_type, an MLP that is not bias-free SwiGLU, e.g. hidden_act 'gelu' or mlp_bias=True,
    a projection wrapped by PEFT or hooked) or whose transformers code computes RoPE otherwise than checked here.
    `remove_fused_ops(model)` undoes it.
    """
    return _apply(model, SUPPORTED, mlp, rope, "fused_ops.hf.apply_fused_ops", recompute)


def apply_fused_ops_to_llama(model: nn.Module, *, mlp: bool = True, rope: bool = True,
                             recompute: bool = False) -> FusedPatchReport:
    """`apply_fused_ops` for a Llama model only (model_type 'llama'; e.g. LlamaForCausalLM, LlamaModel)."""
    return _apply(model, ("llama",), mlp, rope, "fused_ops.hf.apply_fused_ops_to_llama", recompute)


def _apply(model, allowed, mlp: bool, rope: bool, owner: str, recompute: bool = False) -> FusedPatchReport:
    model_type, prefix, base = _layers_of(model, owner, allowed)
    layers: List[nn.Module] = list(base.layers)
    for i, layer in enumerate(layers):
        _check_layer(i, layer, prefix, mlp, rope, owner)
    notes = []
    rotary = getattr(base, "rotary_emb", None)
    if rope:
        if type(rotary).__name__ != prefix + "RotaryEmbedding":
            raise ValueError(f"{owner}: {type(base).__name__}.rotary_emb is {type(rotary).__name__}, expected "
                             f"{prefix}RotaryEmbedding")
        _check_own_forward(rotary, f"{owner}: rotary_emb", _rotary_forward)
        scaling = rotary.attention_scaling
        if not (isinstance(scaling, (int, float)) and scaling == 1.0):
            rope = False
            notes.append(f"RoPE left to HF: attention_scaling={scaling} (rope_type "
                         f"{getattr(rotary, 'rope_type', '?')!r}) scales cos/sin, which the fused op does not")
            warnings.warn("fused_ops.hf: " + notes[-1], stacklevel=3)
        elif layers:
            for attn in {type(layer.self_attn).__module__: layer.self_attn for layer in layers}.values():
                _check_rope(rotary, attn, owner)
    # Every check passed: now change things.
    if mlp:
        for layer in layers:
            if not _is_bound(layer.mlp, _mlp_forward):
                _bind(layer.mlp, _mlp_forward)
            layer.mlp.__dict__[_RECOMPUTE] = bool(recompute)
    if rope and layers:
        for layer in layers:
            namespace = _attn_globals(layer.self_attn)
            if not hasattr(namespace["apply_rotary_pos_emb"], "_fused_ops_original"):
                namespace["apply_rotary_pos_emb"] = _make_rope_dispatch(namespace["apply_rotary_pos_emb"])
        if not _is_bound(rotary, _rotary_forward):
            _bind(rotary, _rotary_forward)
    return _report(model_type, base, notes)


def _report(model_type: str, base: nn.Module, notes) -> FusedPatchReport:
    mlp_layers = tuple(i for i, layer in enumerate(base.layers)
                       if _is_bound(getattr(layer, "mlp", nn.Module()), _mlp_forward))
    rotary = getattr(base, "rotary_emb", None)
    return FusedPatchReport(model_type, mlp_layers, rotary is not None and _is_bound(rotary, _rotary_forward),
                            tuple(notes))


def remove_fused_ops(model: nn.Module) -> FusedPatchReport:
    """Undoes `apply_fused_ops`: the MLPs and the rotary embedding run HF's forward again. Returns the (empty)
    report. The modeling module's `apply_rotary_pos_emb` dispatcher stays: without a patched rotary embedding it
    calls HF's original for every call."""
    model_type, _, base = _layers_of(model, "fused_ops.hf.remove_fused_ops", SUPPORTED)
    for module in [getattr(layer, "mlp", None) for layer in base.layers] + [getattr(base, "rotary_emb", None)]:
        if module is not None and (_is_bound(module, _mlp_forward) or _is_bound(module, _rotary_forward)):
            del module.forward
            module.__dict__.pop(_RECOMPUTE, None)
    return _report(model_type, base, ())
