"""A Hugging Face directory of a Llama-architecture family as one GGUF file, the format llama.cpp, Ollama and
LM Studio run, written with the ``gguf`` package (llama.cpp's own writer: ``pip install 'ipuft[gguf]'``).
:func:`ipuft.run.export.export_gguf` exports a checkpoint as such a directory first (LoRA merged) and
converts that.

What is written is what llama.cpp's convert_hf_to_gguf.py writes for the same directory: the architecture
(``llama`` for Llama and Mistral, ``qwen2``, ``qwen3``, ``gemma3`` for Gemma 3's text model), its metadata, the
tokenizer (:mod:`ipuft.io.gguf_tokenizer`) and every tensor under the name llama.cpp's own tensor map gives it,
with llama.cpp's value changes: Llama's q and k rows permuted to its rotary layout, Gemma's norm gains written as
``1 + w``, Llama 3.1's rope scaling as the ``rope_freqs`` tensor. A family or a setting whose GGUF form llama.cpp
does not know (GPT-J, OLMo 2, Gemma 2, Phi-3, a sliding window on a Llama or Qwen, another Gemma 3 layer pattern)
is refused in one line, before anything is written.

Types (``--gguf-type``): ``f32``, ``f16``, ``bf16`` or ``q8_0`` for the matrices; vectors (norms, biases) stay
float32, as llama.cpp keeps them, and a q8_0 matrix whose rows are not a multiple of 32 long is float16. It
streams: the header first, then one tensor at a time read, changed, converted and written.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ipuft.errors import CheckpointError
from ipuft.families import HFConfigError, ModelFamily
from ipuft.io.files import read_json, read_text
from ipuft.io.gguf_tokenizer import add_tokenizer, read_vocab
from ipuft.io.model_files import limit

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
# config.json's model_type → llama.cpp's architecture.
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
# Gemma 3 as llama.cpp runs it (llama-model.cpp): five sliding layers then a global one, the sliding layers'
# rotary base 10000 without scaling, the softmax scale head_dim ** -0.5 (27B, 62 layers: (hidden / heads) ** -0.5).
GEMMA3_PATTERN, GEMMA3_LOCAL_BASE, GEMMA3_27B_LAYERS = 6, 10000.0, 62
LLAMA = "plugins.llama"


def is_gguf_file(path: Path) -> bool:
    """Whether ``path`` is a GGUF file (an earlier export, which a new one replaces)."""
    try:
        if not path.is_file():  # never opened otherwise: a FIFO would block
            return False
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def gguf_library():
    """The ``gguf`` package, or one line saying which extra installs it."""
    try:
        import gguf
    except ImportError:
        raise CheckpointError("--gguf: writing a GGUF file needs the gguf package (llama.cpp's writer); "
                              "pip install 'ipuft[gguf]'") from None
    return gguf


def _no(model_type: str, what: str, supported: str) -> CheckpointError:
    return CheckpointError(f"--gguf: {model_type} with {what} has no GGUF form llama.cpp runs; {supported}")


def check_model(model_type: str, settings: Mapping[str, Any]) -> str:
    """llama.cpp's architecture for a model of ``model_type`` with ``settings`` (ipuft's config keys, as the
    family reads its config.json), after refusing in one line whatever llama.cpp would run otherwise."""
    if model_type not in ARCHITECTURES:
        raise CheckpointError(f"--gguf: model.family={str(model_type)[:40]} has no GGUF export here; it writes "
                              f"{', '.join(ARCHITECTURES)}")
    arch = ARCHITECTURES[model_type]
    get = settings.get
    scaling = get(f"{LLAMA}.rope_scaling") or {}
    if scaling.get("rope_type") == "llama3" and arch != "llama":
        raise _no(model_type, "llama3 rope scaling", "llama3 scaling is Llama's")
    if get(f"{LLAMA}.mlp_bias") or (get(f"{LLAMA}.qkv_bias") and arch != "qwen2") or get(f"{LLAMA}.output_bias"):
        raise CheckpointError(f"--gguf: {model_type} with attention_bias or mlp_bias is not exported to GGUF here "
                              f"(transformers' GGUF reader would drop the biases, so nothing checks them); it writes "
                              f"Qwen2's q/k/v biases only")
    if arch != "gemma3":
        if (window := get(f"{LLAMA}.sliding_window")) is not None:
            fix = "sliding_window null" if model_type == "mistral" else "use_sliding_window false"
            raise _no(model_type, f"sliding_window={window}",
                      f"llama.cpp's {arch} attends over the whole context: export {model_type} with {fix}")
        return arch
    layers, hidden, heads = get("model.layers"), get("model.hidden_size"), get("model.attention.heads")
    head_dim = get(f"{LLAMA}.head_dim") or hidden // heads
    pattern = ["full_attention" if (i + 1) % GEMMA3_PATTERN == 0 else "sliding_attention" for i in range(layers)]
    if get(f"{LLAMA}.sliding_window") is None or list(get(f"{LLAMA}.layer_types") or []) != pattern:
        raise _no(model_type, "another layer pattern", "llama.cpp runs Gemma 3's sliding window on five layers "
                                                       "of six, every sixth global")
    local = get(f"{LLAMA}.local_rope_theta")
    if local is not None and local != GEMMA3_LOCAL_BASE:
        raise _no(model_type, f"rope_local_base_freq={local:g}", f"llama.cpp's is {GEMMA3_LOCAL_BASE:g}")
    scalar = hidden // heads if layers == GEMMA3_27B_LAYERS else head_dim
    if get(f"{LLAMA}.query_pre_attn_scalar") != scalar:
        raise _no(model_type, f"query_pre_attn_scalar={get(f'{LLAMA}.query_pre_attn_scalar')}",
                  f"llama.cpp scales by {scalar} ** -0.5 at {layers} layers")
    if get(f"{LLAMA}.final_logit_softcap") is not None or get(f"{LLAMA}.attn_logit_softcap") is not None:
        raise _no(model_type, "logit soft-capping", "llama.cpp's Gemma 3 caps nothing")
    return arch


def _metadata(writer, gguf, arch: str, s: Mapping[str, Any], positions: int, file_type: int) -> None:
    """The architecture's keys, as convert_hf_to_gguf.py writes them."""
    head_dim = s[f"{LLAMA}.head_dim"]
    writer.add_type("model")
    writer.add_context_length(positions)
    writer.add_embedding_length(s["model.hidden_size"])
    writer.add_block_count(s["model.layers"])
    writer.add_feed_forward_length(s["model.intermediate_size"])
    writer.add_head_count(s["model.attention.heads"])
    writer.add_head_count_kv(s[f"{LLAMA}.kv_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(s["model.attention.rotary_dim"])
    writer.add_rope_freq_base(float(s["model.attention.rotary_positional_embeddings_base"]))
    writer.add_layer_norm_rms_eps(float(s["model.layer_norm_epsilon"]))
    writer.add_vocab_size(s["model.embedding.vocab_size"])
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    scaling = s[f"{LLAMA}.rope_scaling"] or {}
    if scaling.get("rope_type") == "linear":  # on Gemma 3's global layers only, as transformers has it
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    if arch == "gemma3":
        writer.add_sliding_window(s[f"{LLAMA}.sliding_window"])


def llama3_rope_factors(s: Mapping[str, Any]):
    """Llama 3.1's rope scaling as llama.cpp's ``rope_freqs`` tensor: each frequency's divisor (convert_hf_to_gguf
    .py's LlamaModel.generate_extra_tensors)."""
    import numpy as np

    scaling, dim = s[f"{LLAMA}.rope_scaling"], s["model.attention.rotary_dim"]
    base = float(s["model.attention.rotary_positional_embeddings_base"])
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _permuted(rows, heads: int):
    """q or k rows (or their bias) in llama.cpp's rotary layout (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _changes(arch: str, s: Mapping[str, Any]) -> Callable[[str, Any], Any]:
    """What llama.cpp's converter does to a tensor's values on the way, by its Hugging Face name."""
    heads, kv_heads = s["model.attention.heads"], s[f"{LLAMA}.kv_heads"]

    def change(name: str, array):
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            return _permuted(array, heads)
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            return _permuted(array, kv_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            return array + 1  # llama.cpp's Gemma norms multiply by the gain itself
        return array

    return change


def _safetensors(directory: Path) -> list[tuple[str, Path]]:
    """``(name, file)`` of every tensor of the directory's weights, in the files' order."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    files = [directory / "model.safetensors"]
    if index.exists():
        weight_map = read_json(index, limit("config.json"), str(index)).get("weight_map", {})
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
    out = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            out.extend((name, file) for name in f.keys())  # noqa: SIM118 (safe_open is no mapping)
    return out


def _tensors(directory: Path, gguf, arch: str, s: Mapping[str, Any], qtype) -> Iterator[tuple]:
    """``(gguf name, shape, type, read)`` of every tensor to write, ``read()`` giving its converted array."""
    import numpy as np
    from safetensors import safe_open

    types = gguf.GGMLQuantizationType
    arch_enum = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_enum, s["model.layers"])
    change = _changes(arch, s)

    def reader(name: str, file: Path, kind) -> Callable[[], Any]:
        def read():
            with safe_open(file, framework="pt") as f:
                array = change(name, f.get_tensor(name).float().numpy())
            out = gguf.quants.quantize(array, kind)
            if kind == types.F16 and not np.isfinite(out).all() and np.isfinite(array).all():
                raise CheckpointError(f"--gguf-type f16: {name} has values beyond float16's range (±65504); "
                                      f"choose bf16 or f32")
            return out
        return read

    for name, file in _safetensors(directory):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise CheckpointError(f"--gguf: {name} has no name in llama.cpp's {arch} tensor map")
        with safe_open(file, framework="pt") as f:
            shape = tuple(f.get_slice(name).get_shape())
        kind = qtype if len(shape) > 1 else types.F32
        if kind == types.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[types.Q8_0][0]:
            kind = types.F16  # as llama.cpp's converter falls back
        yield gguf_name, shape, kind, reader(name, file, kind)
    if (s[f"{LLAMA}.rope_scaling"] or {}).get("rope_type") == "llama3":
        factors = llama3_rope_factors(s)
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors.shape, types.F32, lambda: factors


def write_gguf(directory: Path, path: Path, gguf_type: str, family: ModelFamily, name: str) -> Path:
    """Write Hugging Face directory ``directory`` (config.json, safetensors weights, tokenizer.json and the
    tokenizer's other files) of ``family`` as GGUF file ``path``, its matrices in ``gguf_type`` (of
    :data:`GGUF_TYPES`), named ``name`` (``general.name``)."""
    import numpy as np

    gguf = gguf_library()
    config = read_json(directory / "config.json", limit("config.json"), "config.json")
    try:
        settings = family.read_config(config)
    except HFConfigError as exc:
        raise CheckpointError(f"--gguf: config.json: {exc}") from None
    arch = check_model(family.model_type, settings)
    if not (directory / "tokenizer.json").is_file():
        raise CheckpointError("--gguf: the checkpoint has no tokenizer.json, and a GGUF file carries its tokenizer")
    rows = settings["model.embedding.vocab_size"]
    vocab = read_vocab(read_text(directory / "tokenizer.json", limit("tokenizer.json"), "tokenizer.json"), rows)
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int) or positions < 1:
        raise CheckpointError("--gguf: config.json gives no max_position_embeddings (the GGUF's context length)")
    types = gguf.GGMLQuantizationType
    qtype = {"f32": types.F32, "f16": types.F16, "bf16": types.BF16, "q8_0": types.Q8_0}[gguf_type]
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type]

    writer = gguf.GGUFWriter(None, arch)
    try:
        writer.add_name(name)
        _metadata(writer, gguf, arch, settings, positions, int(file_type))
        add_tokenizer(writer, vocab, directory)
        tensors = list(_tensors(directory, gguf, arch, settings, qtype))
        for gguf_name, shape, kind, _ in tensors:
            numpy_type = {types.F32: np.float32, types.F16: np.float16}.get(kind, np.uint8)
            stored = shape if numpy_type is not np.uint8 else gguf.quants.quant_shape_to_byte_shape(shape, kind)
            nbytes = math.prod(stored) * np.dtype(numpy_type).itemsize
            writer.add_tensor_info(gguf_name, stored, np.dtype(numpy_type), nbytes, raw_dtype=kind)
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for *_, read in tensors:
            writer.write_tensor_data(read())
    finally:
        writer.close()
    return path
