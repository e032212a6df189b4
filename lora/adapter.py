"""Load and validate PEFT LoRA directories; identity = name + digest of the content.

A PEFT directory holds adapter_config.json and adapter_model.safetensors with keys like
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` ([r, in]) and
``...lora_B.weight`` ([out, r]). The delta of one module is ``x @ A.T @ B.T * scaling``
with scaling = lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA; ``rank_pattern`` and
``alpha_pattern`` give some modules a rank and alpha of their own (lora/peft_patterns.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from lora.peft_patterns import module_shapes
from lora.peft_targets import module_targeter
from lora.targets import SUPPORTED_MODULES, LoraTargets

_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])\.weight$")

# Config switches that select LoRA variants we do not implement: (key, value that is fine).
# Not fan_in_fan_out: PEFT turns it off for nn.Linear, which every target module is.
_UNSUPPORTED_SWITCHES: tuple[tuple[str, Any], ...] = (
    ("use_dora", False), ("lora_bias", False), ("use_qalora", False),
    ("alora_invocation_tokens", None), ("modules_to_save", None),
    ("layer_replication", None), ("trainable_token_indices", None),
    ("target_parameters", None), ("use_bdlora", None),
)

MAX_CONFIG_BYTES = 1 << 20
"""adapter_config.json is a few hundred bytes; anything far larger is not a PEFT config."""


@dataclass(frozen=True)
class LoraAdapter:
    """A validated adapter in CPU memory.

    weights[(layer, module)] = (A [r, in], B_scaled [out, r]) in float32, with the module's
    scaling already folded into B; r is the module's own rank (rank_pattern), and ``rank``
    the largest of them, the rows of a slot the adapter needs.
    """

    name: str
    path: str
    digest: str
    rank: int
    alpha: float
    use_rslora: bool
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def identity(self) -> tuple[str, str]:
        return (self.name, self.digest)

    @property
    def target_modules(self) -> frozenset[str]:
        return frozenset(m for _, m in self.weights)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


MAX_WEIGHT_CHANGE = 1e4
"""An adapter whose weight change (B A scaling) may reach past this in any entry is refused:
trained adapters stay far below it (base weights are of order 0.01-1); past it, activations
overflow to inf and NaN."""


def _read_config(path: Path) -> dict[str, Any]:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"adapter directory {str(path)!r} has no adapter_config.json")
    if config_file.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"adapter_config.json in {str(path)!r} is over {MAX_CONFIG_BYTES} "
                         f"bytes")
    try:
        config = json.loads(config_file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"adapter_config.json in {str(path)!r} is not UTF-8") from None
    except RecursionError:  # json recurses per nesting level: "[[[[...]]]]" exhausts the stack
        raise ValueError(f"adapter_config.json in {str(path)!r} is nested too deeply"
                         ) from None
    except ValueError as exc:  # JSONDecodeError, or an integer over int_max_str_digits
        raise ValueError(f"adapter_config.json in {str(path)!r} is not valid JSON: {exc}"
                         ) from None
    if not isinstance(config, dict):
        raise ValueError(f"adapter_config.json in {str(path)!r} is not a JSON object")
    return config


def _check_config(config: dict[str, Any], where: str, max_rank: int) -> tuple[int, float, bool]:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r} is not supported "
                         f"(only LORA)")
    for key, fine in _UNSUPPORTED_SWITCHES:
        value = config.get(key, fine)
        if value not in (fine, None, False, [], {}):
            raise ValueError(f"{where}: {key}={value!r} is a LoRA variant loragate does not "
                             f"implement")
    # bias "all" or "lora_only" trains the base layers' own biases: a model without them
    # (Llama) saves none, and the weights check below refuses any bias a file holds.
    if config.get("bias", "none") not in ("none", "all", "lora_only"):
        raise ValueError(f"{where}: bias={config['bias']!r} is not one of PEFT's 'none', "
                         f"'all', 'lora_only'")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    # With a rank_pattern the modules' own ranks are checked as they are read.
    if rank > max_rank and not config.get("rank_pattern"):
        raise ValueError(f"{where}: rank {rank} exceeds max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    # Python's json reads NaN and Infinity; they would turn every output into NaN. PEFT sets
    # no sign or range for alpha, so only non-finite values are refused.
    if not math.isfinite(alpha):
        raise ValueError(f"{where}: lora_alpha must be finite, got {alpha!r}")
    return rank, float(alpha), bool(config.get("use_rslora", False))


def load_adapter(name: str, path: str | Path, targets: LoraTargets, max_rank: int
                 ) -> LoraAdapter:
    """Read, validate and digest a PEFT directory. Every problem is a ValueError naming it
    (an unreadable file included: callers catch ValueError only)."""
    if not name or not re.fullmatch(r"[A-Za-z0-9._:/-]{1,128}", name):
        raise ValueError(f"adapter name {name!r} must be 1-128 of [A-Za-z0-9._:/-]")
    try:
        return _load(name, Path(path), targets, max_rank)
    except OSError as exc:
        raise ValueError(f"adapter {name!r}: its files cannot be read ({exc.strerror})"
                         ) from None


def _load(name: str, path: Path, targets: LoraTargets, max_rank: int) -> LoraAdapter:
    if not path.is_dir():
        raise ValueError(f"adapter directory {str(path)!r} does not exist" if not path.exists()
                         else f"adapter path {str(path)!r} is not a directory (give the "
                              f"directory that holds adapter_config.json)")
    where = f"adapter {name!r}"
    config = _read_config(path)
    rank, alpha, use_rslora = _check_config(config, where, max_rank)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        # A pickle (adapter_model.bin) can run code as it loads: an uploader's is not read.
        pickled = " (adapter_model.bin is not read: save the adapter as safetensors, PEFT's " \
                  "default, or convert it)" if (path / "adapter_model.bin").is_file() else ""
        raise ValueError(f"{where}: {str(path)!r} has no adapter_model.safetensors{pickled}")
    raw = weights_file.read_bytes()
    try:  # parsed from the bytes digested below: the digest names exactly these weights
        tensors = load_safetensors(raw)
    except (SafetensorError, ValueError) as exc:
        raise ValueError(f"{where}: adapter_model.safetensors is corrupt: {exc}") from exc

    targeted = module_targeter(config, where, targets.model_type)
    shape_of = module_shapes(config, where, rank, alpha)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, str], str] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"{where}: unexpected weight {key!r} (only LoRA A/B of "
                             f"{', '.join(SUPPORTED_MODULES)} are supported)")
        layer, module, half = int(match[1]), match[3], match[4]
        if module not in SUPPORTED_MODULES:
            raise ValueError(f"{where}: target module {module!r} is not supported")
        if layer >= targets.num_layers:
            raise ValueError(f"{where}: weight for layer {layer}, the base model has "
                             f"{targets.num_layers} layers")
        module_name = f"model.layers.{layer}.{match[2]}.{module}"
        if (layer, module) not in pairs and not targeted(module_name):
            raise ValueError(f"{where}: adapter_model.safetensors holds weights for "
                             f"{module_name}, which adapter_config.json does not target "
                             f"(target_modules, layers_to_transform, exclude_modules): PEFT "
                             f"would not use them")
        pairs.setdefault((layer, module), {})[half] = tensor
        names[(layer, module)] = module_name
    if not pairs:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA weights")

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), halves in sorted(pairs.items()):
        if set(halves) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} lacks lora_"
                             f"{'B' if 'A' in halves else 'A'}")
        a, b = halves["A"], halves["B"]
        own = shape_of(names[(layer, module)])  # r and lora_alpha, or their patterns'
        if own.rank > max_rank:
            raise ValueError(f"{where}: rank {own.rank} exceeds max_lora_rank {max_rank} "
                             f"(rank_pattern, for layer {layer} {module})")
        fan_in, fan_out = targets.module_dims(module)
        if tuple(a.shape) != (own.rank, fan_in) or tuple(b.shape) != (fan_out, own.rank):
            raise ValueError(
                f"{where}: layer {layer} {module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}; the base model and r={own.rank} need A "
                f"{(own.rank, fan_in)} and B {(fan_out, own.rank)}")
        scaling = own.alpha / (math.sqrt(own.rank) if use_rslora else own.rank)
        a32, b32 = a.float().contiguous(), (b.float() * scaling).contiguous()
        # A NaN or inf (stored, or from overflow by the scaling) makes every logit of the
        # adapter's requests NaN: refused here rather than sampled from.
        for half, tensor in (("A", a32), ("B", b32)):
            if not bool(torch.isfinite(tensor).all()):
                stored = bool(torch.isfinite(a if half == "A" else b.float()).all())
                raise ValueError(f"{where}: layer {layer} {module} lora_{half} holds NaN or "
                                 f"infinite values" + (f" once scaled by {scaling:.3g} (check "
                                 f"lora_alpha)" if stored else ""))
        # Finite halves can still overflow in the forward (lora_alpha=-1e30 with small B):
        # bound the weight change's largest entry, |(B A)_ij| <= |B_i.| |A_.j| (in float64).
        bound = float(b32.double().norm(dim=1).max() * a32.double().norm(dim=0).max())
        if bound > MAX_WEIGHT_CHANGE:
            raise ValueError(f"{where}: layer {layer} {module} changes the base weights by "
                             f"up to {bound:.3g} (scaling {scaling:.3g}), over "
                             f"{MAX_WEIGHT_CHANGE:g}: its outputs would overflow (check "
                             f"lora_alpha)")
        weights[(layer, module)] = (a32, b32)

    # The digest covers everything that changes the KV an adapter produces: the weights and
    # each module's scaling.
    digest = hashlib.sha256(raw)
    digest.update(json.dumps({"r": rank, "alpha": alpha, "rslora": use_rslora},
                             sort_keys=True).encode())
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        digest.update(json.dumps([config.get("rank_pattern"), config.get("alpha_pattern")]
                                 ).encode())
    # A slot holds the largest of the modules' ranks; the others are zero-padded to it.
    largest = max(a.shape[0] for a, _ in weights.values())
    return LoraAdapter(name=name, path=str(path), digest=digest.hexdigest()[:32],
                       rank=largest, alpha=alpha, use_rslora=use_rslora, weights=weights)
