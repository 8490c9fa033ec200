"""ModelConfig: the architecture of one Qwen3.5/3.6/3.8 text model, read from config.json.

Accepts both layouts Hugging Face ships: the released multimodal one
(`Qwen3_5ForConditionalGeneration`, text dims under `text_config`) and the
text-only one (`Qwen3_5ForCausalLM`). Anything we cannot run correctly fails
here, at load, with a message naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from q27py.errors import ConfigError

LINEAR = "linear_attention"
FULL = "full_attention"

SUPPORTED_MODEL_TYPES = {"qwen3_5", "qwen3_5_text"}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    mtp_num_hidden_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived sizes (never stored, so they cannot disagree) ----
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    # ---- construction ----
    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json in the model directory") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: unreadable config.json ({exc})") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "config.json") -> "ModelConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        top = data
        text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data

        def need(key, kind=int):
            if key not in text:
                raise ConfigError(f"{source}: missing field '{key}'")
            value = text[key]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{source}: field '{key}' must be an integer, got {value!r}")
            if kind is int and value <= 0:
                raise ConfigError(f"{source}: field '{key}' must be positive, got {value}")
            return value

        model_type = text.get("model_type", top.get("model_type"))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: field 'model_type' is {model_type!r}; supported: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        n_layers = need("num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval", 4)
            if not isinstance(interval, int) or interval <= 0:
                raise ConfigError(f"{source}: field 'full_attention_interval' must be a positive integer")
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
        if not isinstance(layer_types, list) or len(layer_types) != n_layers:
            raise ConfigError(f"{source}: field 'layer_types' must list {n_layers} entries (num_hidden_layers)")
        bad = sorted({t for t in layer_types if t not in (LINEAR, FULL)})
        if bad:
            raise ConfigError(f"{source}: field 'layer_types' has unsupported entries {bad}")

        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: field 'rope_parameters' must be an object")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{source}: field 'rope_parameters.rope_type' {rope_type!r} is not supported")
        theta = rope.get("rope_theta", text.get("rope_theta", 1e7))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        head_dim = need("head_dim")
        rotary_dim = int(head_dim * partial)
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ConfigError(f"{source}: field 'partial_rotary_factor' {partial} gives rotary dim {rotary_dim}")
        mrope = rope.get("mrope_section")
        if mrope is not None and (not isinstance(mrope, list) or sum(mrope) != rotary_dim // 2):
            raise ConfigError(
                f"{source}: field 'rope_parameters.mrope_section' {mrope} must sum to rotary_dim/2 = {rotary_dim // 2}"
            )

        nq, nkv = need("num_attention_heads"), need("num_key_value_heads")
        if nq % nkv:
            raise ConfigError(f"{source}: field 'num_attention_heads' ({nq}) must be a multiple of 'num_key_value_heads' ({nkv})")
        hk, hv = need("linear_num_key_heads"), need("linear_num_value_heads")
        if hv % hk:
            raise ConfigError(f"{source}: field 'linear_num_value_heads' ({hv}) must be a multiple of 'linear_num_key_heads' ({hk})")
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: field 'hidden_act' {act!r} is not supported (silu only)")
        if text.get("attention_bias", False):
            raise ConfigError(f"{source}: field 'attention_bias' true is not supported")
        if text.get("layer_scale") is not None:
            raise ConfigError(f"{source}: field 'layer_scale' is not supported")
        if text.get("attn_output_gate", True) is False:
            raise ConfigError(f"{source}: field 'attn_output_gate' false is not supported (the gate is always built)")
        if text.get("mtp_use_dedicated_embeddings", False):
            raise ConfigError(f"{source}: field 'mtp_use_dedicated_embeddings' true is not supported")
        mtp_layers = text.get("mtp_num_hidden_layers", 0) or 0
        if mtp_layers not in (0, 1):
            raise ConfigError(f"{source}: field 'mtp_num_hidden_layers' {mtp_layers} is not supported (0 or 1)")
        tie = top.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        if "tie_word_embeddings" in text:
            tie = text["tie_word_embeddings"]
        eos = text.get("eos_token_id", top.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())

        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=nq,
            num_key_value_heads=nkv,
            head_dim=head_dim,
            linear_num_key_heads=hk,
            linear_num_value_heads=hv,
            linear_key_head_dim=need("linear_key_head_dim"),
            linear_value_head_dim=need("linear_value_head_dim"),
            linear_conv_kernel_dim=need("linear_conv_kernel_dim") if "linear_conv_kernel_dim" in text else 4,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            partial_rotary_factor=float(partial),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            mtp_num_hidden_layers=int(mtp_layers),
            eos_token_ids=eos_ids,
            extra={"model_type": model_type, "layout": "multimodal" if text is not top else "text"},
        )

    def to_hf_dict(self) -> dict:
        """A text-only config.json for this architecture (used by make-tiny)."""
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attn_output_gate": True,
            "mtp_num_hidden_layers": self.mtp_num_hidden_layers,
            "mtp_use_dedicated_embeddings": False,
            "eos_token_id": list(self.eos_token_ids),
            "torch_dtype": "bfloat16",
        }


def qwen36_27b_config() -> ModelConfig:
    """The real Qwen3.6-27B text dims (model.md §1.2), for random-weight benchmarks."""
    return ModelConfig(
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(64)),
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        tie_word_embeddings=False,
        max_position_embeddings=262144,
        mtp_num_hidden_layers=1,
        eos_token_ids=(248046, 248044),
    )
