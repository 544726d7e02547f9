"""Model families of forge's TensorRT-LLM target: one home for what differs between them.

Each family names the HF architectures it covers, ModelOpt's ``decoder_type`` for the checkpoint export, the
TensorRT-LLM 1.2 class that loads it (``MODEL_MAP`` in ``tensorrt_llm/models/__init__.py``), the per-layer
tensors beyond the Llama/Qwen2 set, and the semantics the reference numerics must apply.

Sources (TensorRT-LLM 1.2 line, read through the search index; the repository is too large to fetch, so files
without a resolvable commit are cited by their index id, as in shared/docs/trtllm-reference.md):

* MODEL_MAP: ``'LlamaForCausalLM': LLaMAForCausalLM``, ``'MistralForCausalLM': LLaMAForCausalLM``,
  ``'Qwen2ForCausalLM' / 'Qwen3ForCausalLM': QWenForCausalLM``, ``'Gemma3ForCausalLM': GemmaForCausalLM``
  (``tensorrt_llm/models/__init__.py``, index id 820782731).
* Llama / Mistral: ``LLaMAConfig`` (``tensorrt_llm/models/llama/config.py`` @ 04100fd): ``rotary_base`` =
  HF ``rope_theta``, ``rotary_scaling`` = HF ``rope_scaling`` verbatim (so ``{"rope_type": "llama3", "factor",
  "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}`` for Llama 3.x), ``attn_bias`` =
  HF ``bias`` or ``attention_bias``. LLaMAConfig has no sliding-window field: Mistral's window is a runtime
  setting of the engine (``max_attention_window_size``), so forge writes ``sliding_window`` into config.json
  (PretrainedConfig keeps unknown keys as attributes, "Implicitly setting ...") for the reference, the
  Triton repository and the evaluate runtime to read (:func:`attention_windows` turns it into the per-layer list).
* Qwen3: ``QWenConfig.from_hugging_face`` sets ``attn_bias = False`` for qwen3/qwen3_moe (index id 14645444);
  ``QWenDecoderLayer`` builds ``Attention(..., qk_layernorm=qk_layernorm, layernorm_type=LayerNormType.RmsNorm if
  qk_layernorm else LayerNorm)`` with ``qk_layernorm = config.qwen_type in ('qwen3', 'qwen3_moe')`` and passes no
  ``eps``. Upstream: ``tensorrt_llm/models/qwen/model.py`` as changed by NVIDIA/TensorRT-LLM PR #5650 "[feat] Add
  TensorRT-Engine Qwen3 (dense) model support" (merged by 2025-07-10; blob 16d748d -> 0fb003a) and PR #6470 (qwen3_moe,
  2025-07-30), both before the 1.2 line; the index's copy with those lines verbatim is index id 66032162657
  (NVIDIA header 2022-2026, no local plugins). Index id 54584513530 is a fork of the same file (it adds
  ``TRTLLM_QWEN_RMS_SCALE_SWIGLU_PLUGIN``) and is not cited. The commit of a v1.2.* tag could not be resolved: the
  repository snapshot (2.5 GB) is over the fetch limit (500 MiB) and the index labels no tags. The converter writes
  HF ``self_attn.q_norm`` / ``k_norm`` as ``attention.q_layernorm.weight`` / ``attention.k_layernorm.weight``
  (``tensorrt_llm/models/qwen/convert.py``, index id 1134239761, same PR). The q/k norm is an RMSNorm over
  ``head_size``, per head before RoPE, with Attention's default eps 1e-05 (reference.QK_NORM_EPS), not
  ``norm_epsilon``.
* Gemma 3: ``GemmaConfig`` (``tensorrt_llm/models/gemma/config.py``, index id 397088162) with
  ``Gemma3ConfigGroup`` = ``query_pre_attn_scalar, final_logit_softcapping, _sliding_window_pattern,
  rope_local_base_freq, sliding_window`` (``tensorrt_llm/models/modeling_utils.py``, index id 57035009897),
  all required for ``architecture == "Gemma3ForCausalLM"`` (``assert query_pre_attn_scalar is not None``).
  ``GemmaDecoderLayer`` (``tensorrt_llm/models/gemma/model.py``, index id 83670668): ``qk_layernorm=True``
  (no ``eps``: Attention's 1e-05), ``q_scaling = sqrt(query_pre_attn_scalar) / sqrt(head_size)``
  (softmax scale 1/sqrt(query_pre_attn_scalar)),
  ``is_sliding = bool((layer_idx + 1) % _sliding_window_pattern)`` with ``rotary_embedding_base_local =
  rope_local_base_freq``; ``inter_layernorms``: ``post_layernorm`` on the attention output before the residual
  add, ``pre_feedforward_layernorm`` before and ``post_feedforward_layernorm`` after the MLP; ``GemmaModel``
  scales the embedding by ``sqrt(hidden_size)`` (cast to the model dtype). TensorRT-LLM's ``RmsNorm`` is
  ``x * w``; Gemma's is ``x * (1 + w)``: ModelOpt's ``build_layernorm_config`` writes ``w + 1``
  (``_weights_plus_one`` for ``Gemma3RMSNorm``). The window itself, like Mistral's, is enforced by the runtime's
  per-layer ``max_attention_window_size``. ``GemmaConfig.__init__`` forces ``use_parallel_embedding = tp_size >
  1`` (a passed value is logged and ignored) and sets nothing about sharing: it has no ``share_embedding_table``
  logic (checked against that file, issue 27). Sharing is forge's own ``share_embedding_table: true``
  (checkpoint.py); contract.py accepts a checkpoint without ``lm_head`` only then, and with pp 1.
* GeGLU: TensorRT-LLM's ``gelu`` is the tanh approximation (``tensorrt_llm/functional.py``, index id 720191209),
  the same as HF's ``gelu_pytorch_tanh``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ForgeError


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]      # HF ``architectures[0]`` values covered
    decoder_type: str                      # ModelOpt export_tensorrt_llm_checkpoint decoder_type
    model_class: str                       # TensorRT-LLM 1.2 class MODEL_MAP gives for the architecture
    qk_norm: bool = False                  # attention.q_layernorm / k_layernorm per head (before RoPE)
    inter_layernorms: bool = False         # Gemma 2/3: post-attn + pre/post-feedforward norms
    embedding_scale: bool = False          # hidden = emb * sqrt(hidden_size)
    activation: str = "silu"               # gated MLP activation on mlp.fc
    qwen: bool = False                     # QWenConfig fields (qwen_type, attn_bias default True)
    extra_layer_tensors: tuple[str, ...] = field(default=())   # norms beyond input/post_layernorm


LLAMA = Family("llama", ("LlamaForCausalLM",), "llama", "LLaMAForCausalLM")
MISTRAL = Family("mistral", ("MistralForCausalLM",), "llama", "LLaMAForCausalLM")
QWEN2 = Family("qwen2", ("Qwen2ForCausalLM", "QWenForCausalLM"), "qwen", "QWenForCausalLM", qwen=True)
QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), "qwen", "QWenForCausalLM", qwen=True, qk_norm=True,
               extra_layer_tensors=("attention.q_layernorm.weight", "attention.k_layernorm.weight"))
GEMMA3 = Family("gemma3", ("Gemma3ForCausalLM",), "gemma3", "GemmaForCausalLM", qk_norm=True,
                inter_layernorms=True, embedding_scale=True, activation="gelu_pytorch_tanh",
                extra_layer_tensors=("attention.q_layernorm.weight", "attention.k_layernorm.weight",
                                     "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"))

FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3)
BY_ARCH: dict[str, Family] = {a: f for f in FAMILIES for a in f.hf_architectures}
ARCHITECTURES = frozenset(BY_ARCH)

# Gemma3 fields TensorRT-LLM's GemmaConfig requires (Gemma3ConfigGroup) and the HF key each comes from.
GEMMA3_FIELDS = {"query_pre_attn_scalar": "query_pre_attn_scalar",
                 "final_logit_softcapping": "final_logit_softcapping",
                 "_sliding_window_pattern": "sliding_window_pattern",
                 "rope_local_base_freq": "rope_local_base_freq",
                 "sliding_window": "sliding_window"}


def family_of(architecture: str) -> Family | None:
    return BY_ARCH.get(architecture)


def require_family(architecture: str) -> Family:
    fam = family_of(architecture)
    if fam is None:
        raise ForgeError(f"model.source: architecture {architecture} has no TensorRT-LLM checkpoint export in forge "
                         f"(supported: {', '.join(sorted(ARCHITECTURES))}); use build.target: onnxruntime")
    return fam


def sliding_layers(cfg: dict) -> list[bool]:
    """Per layer: does it use the sliding window? From a TensorRT-LLM checkpoint config (forge's fix-ups)."""
    L = int(cfg["num_hidden_layers"])
    win = cfg.get("sliding_window")
    if not win:
        return [False] * L
    pat = cfg.get("_sliding_window_pattern")
    if cfg.get("architecture") == "Gemma3ForCausalLM" and pat:
        return [bool((i + 1) % int(pat)) for i in range(L)]   # GemmaDecoderLayer.is_sliding
    return [True] * L                                         # Mistral: every layer


def attention_windows(cfg: dict, max_seq_len: int) -> list[int] | None:
    """Per-layer ``max_attention_window_size`` for a TensorRT-LLM checkpoint / engine ``pretrained_config``: the
    window on sliding layers, ``max_seq_len`` on the others, each capped at ``max_seq_len``. None when no layer's
    window is shorter than ``max_seq_len``: the runtime's default (every layer attends to ``max_seq_len``) is
    then already what the model means, and the setting stays unset.

    The runtime caps each entry at the engine's max_seq_len itself (with a warning) and cycles a list shorter than
    the layer count (``TrtGptModel`` ctor, cpp/tensorrt_llm/batch_manager/trtGptModel.h @ c8c6df08bd0e:
    ``std::min(maxAttenWin, mMaxSequenceLen)``, ``TLLM_CHECK ... must be > 0``, ``numRepeatsAttenWindow``); forge
    writes one capped entry per layer so the list says exactly what runs.
    """
    win = cfg.get("sliding_window")
    if not win or "num_hidden_layers" not in cfg:
        return None
    cap = int(max_seq_len)
    slide = sliding_layers(cfg)
    if not any(slide) or int(win) >= cap:
        return None
    return [int(win) if s else cap for s in slide]


def engine_attention_windows(engine_config: dict) -> list[int] | None:
    """:func:`attention_windows` of a ``trtllm-build`` engine ``config.json`` (``pretrained_config`` carries forge's
    window fields through PretrainedConfig's extra keys; ``build_config.max_seq_len`` is the engine's limit)."""
    pretrained = engine_config.get("pretrained_config") or {}
    if not pretrained.get("sliding_window"):
        return None
    max_seq_len = (engine_config.get("build_config") or {}).get("max_seq_len")
    if not max_seq_len:
        raise ForgeError("engine config.json: pretrained_config has a sliding_window but build_config has no "
                         "max_seq_len; rebuild the engine with trtllm-build (it always writes max_seq_len)")
    return attention_windows(pretrained, int(max_seq_len))
