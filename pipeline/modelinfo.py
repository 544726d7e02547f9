"""Architecture facts of a causal LM, read from an HF config.json (local dir or a bundled public config).

Plan-time checks (TP/GQA rules, group sizes, memory) need these numbers before any weights exist,
so public configs of models we have recipes for ship in ``pipeline/model_configs/<name>.json``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import ForgeError

BUNDLED = Path(__file__).parent / "model_configs"


def sliding_window_pattern(hf_cfg: dict) -> int | None:
    """Gemma 3's period of global layers (every N-th layer is global). ``layer_types`` wins when present: transformers
    5 keeps a stale ``_sliding_window_pattern`` (default 6) in config.json even when layer_types says otherwise."""
    types = hf_cfg.get("layer_types")
    if types:
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        if not full:
            return len(types) + 1   # no global layer within the model
        pat = full[0] + 1
        expect = ["full_attention" if (i + 1) % pat == 0 else "sliding_attention" for i in range(len(types))]
        if list(types) != expect:
            raise ForgeError(f"model config: layer_types {types} is not a periodic sliding/global pattern; "
                             f"TensorRT-LLM's Gemma3 takes one _sliding_window_pattern")
        return pat
    pat = hf_cfg.get("sliding_window_pattern") or hf_cfg.get("_sliding_window_pattern")
    return int(pat) if pat else None


def _global_every(cfg: dict) -> int | None:
    if cfg.get("model_type") not in ("gemma3", "gemma3_text"):
        return None
    return sliding_window_pattern(cfg)


@dataclass(frozen=True)
class ModelInfo:
    model_type: str            # HF model_type: llama, qwen2, ...
    architecture: str          # HF architectures[0]: LlamaForCausalLM, Qwen2ForCausalLM, ...
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None = None   # tokens a sliding-window layer attends to (Mistral, Gemma 3), None = none
    qk_norm: bool = False               # per-head q/k RMSNorm (Qwen3, Gemma 3)
    norms_per_layer: int = 2            # RMSNorms of width hidden_size per layer (Gemma 3: 4)
    global_every: int | None = None     # Gemma 3: every N-th layer is global, the others slide; None: all slide

    def sliding_layers_in(self, layers: int) -> int:
        """How many of ``layers`` consecutive decoder layers use the sliding window."""
        if not self.sliding_window:
            return 0
        if self.global_every:
            return layers - layers // self.global_every
        return layers

    @property
    def num_params(self) -> int:
        h, i, v, l = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        attn = h * self.num_heads * self.head_dim * 2 + h * self.num_kv_heads * self.head_dim * 2
        mlp = 3 * h * i
        per_layer = attn + mlp + self.norms_per_layer * h + (2 * self.head_dim if self.qk_norm else 0)
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return l * per_layer + emb + h

    def linear_input_widths(self) -> dict[str, int]:
        """Input width of each kind of quantized linear in a decoder layer (what a quantizer's block must divide)."""
        return {
            "q/k/v_proj, gate/up_proj": self.hidden_size,
            "o_proj": self.num_heads * self.head_dim,
            "down_proj": self.intermediate_size,
        }

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelInfo":
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = cfg.get("rope_theta")
        if rope is None:
            rp = cfg.get("rope_parameters") or {}
            # transformers 5 nests per layer type for Gemma 3: the global (full_attention) layers' theta is rope_theta
            rp = rp.get("full_attention", rp) if isinstance(rp.get("full_attention"), dict) else rp
            rope = rp.get("rope_theta", 10000.0)
        model_type = cfg.get("model_type", "llama")
        window = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            window = None      # Qwen2/3 configs carry sliding_window but only use it with use_sliding_window
        return cls(
            model_type=cfg.get("model_type", "llama"),
            architecture=(cfg.get("architectures") or ["LlamaForCausalLM"])[0],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_theta=float(rope),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            sliding_window=int(window) if window else None,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"),
            norms_per_layer=4 if model_type in ("gemma2", "gemma3", "gemma3_text") else 2,
            global_every=_global_every(cfg),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelInfo":
        f = Path(path) / "config.json"
        try:
            cfg = json.loads(f.read_text())
            if not isinstance(cfg, dict):
                raise TypeError("not a JSON object")
            return cls.from_hf_config(cfg)
        except KeyError as e:
            raise ForgeError(f"{f}: a Hugging Face causal-LM config needs {e.args[0]!r}; is this the model's "
                             "config.json?") from None
        except (OSError, UnicodeDecodeError, ValueError, TypeError, RecursionError) as e:
            raise ForgeError(f"{f}: not a readable Hugging Face config ({type(e).__name__}: {e})") from None

    @classmethod
    def bundled(cls, name: str) -> "ModelInfo | None":
        """Public config shipped with forge for ``name`` (e.g. 'Qwen/Qwen2.5-7B-Instruct'), or None."""
        cfg = bundled_config(name)
        return cls.from_hf_config(cfg) if cfg is not None else None


def bundled_config(name: str) -> dict | None:
    """The HF config.json shipped with forge for ``name`` (e.g. 'mistralai/Mistral-7B-v0.1'), or None."""
    f = BUNDLED / (name.replace("/", "--") + ".json")
    return json.loads(f.read_text()) if f.exists() else None
