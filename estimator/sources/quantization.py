"""A bitsandbytes `BitsAndBytesConfig` dict (or a model config's `quantization_config`) -> quant,
double_quant (transformers 5.23 `utils/quantization_config.py` `BitsAndBytesConfig`); an MXFP4
`Mxfp4Config` (GPT-OSS as shipped) -> quant mxfp4, or none where it asks to dequantize; a GPTQ or AWQ
checkpoint's config (`GPTQConfig`, `AwqConfig`: quant_method, bits, group_size) -> quant gptq / awq
(4 bits in groups of 128, estimator.states.int4_linear_bytes)."""

from __future__ import annotations

from estimator.errors import InputError
from estimator.sources import Mapper, Reading
from estimator.workload import INT4_QUANTS


def read(config: dict, name: str = "quantization config") -> Reading:
    m = Mapper(config, name)
    method = m.get("quant_method", str)
    if method == "mxfp4":
        dequantize = bool(m.get("dequantize", bool, False))
        m.set("quant", "none" if dequantize else "mxfp4",
              "quant_method mxfp4" + (" + dequantize (bf16 experts)" if dequantize else ""))
        m.quiet("modules_to_not_convert")
        return m.finish()
    if method in INT4_QUANTS:
        return _int4(m, method, name)
    if method is not None and method != "bitsandbytes":
        raise InputError(f"{name}: quant_method {method!r} is not modelled (bitsandbytes 4-bit and 8-bit, "
                         "GPT-OSS's mxfp4, and GPTQ/AWQ 4-bit are)")
    four, eight = m.get("load_in_4bit", bool), m.get("load_in_8bit", bool)
    if four and eight:
        raise InputError(f"{name}: load_in_4bit and load_in_8bit are both true")
    if four:
        kind = m.get("bnb_4bit_quant_type", str, "fp4")       # BitsAndBytesConfig's default is fp4
        if kind not in ("nf4", "fp4"):
            raise InputError(f"{name}: bnb_4bit_quant_type must be nf4 or fp4; got {kind!r}")
        m.set("quant", kind, "load_in_4bit + bnb_4bit_quant_type")
        m.set("double_quant", bool(m.get("bnb_4bit_use_double_quant", bool, False)), "bnb_4bit_use_double_quant")
    elif eight:
        m.set("quant", "int8", "load_in_8bit")
    m.unmodelled("bnb_4bit_quant_storage", "the storage dtype matters only under FSDP (--fsdp stores bf16)")
    m.quiet("bnb_4bit_compute_dtype", "llm_int8_threshold", "llm_int8_skip_modules", "llm_int8_enable_fp32_cpu_offload",
            "llm_int8_has_fp16_weight", "bnb_4bit_use_double_quant", "bnb_4bit_quant_type", "_load_in_4bit",
            "_load_in_8bit")
    return m.finish()


def _int4(m: Mapper, method: str, name: str) -> Reading:
    """GPTQ/AWQ: 4 bits in groups of `int4_group_size` are modelled; anything else is refused."""
    from estimator.defaults import overhead

    bits, group = m.get("bits", int, 4), m.get("group_size", int, 128)
    if bits != 4 or group != int(overhead("int4_group_size")):
        raise InputError(f"{name}: {method} with bits {bits} and group_size {group} is not modelled (4 bits in "
                         f"groups of {int(overhead('int4_group_size'))} are)")
    m.set("quant", method, "quant_method + bits + group_size")
    m.quiet("desc_act", "sym", "damp_percent", "true_sequential", "static_groups", "checkpoint_format", "meta",
            "pack_dtype", "lm_head", "dataset", "tokenizer", "model_seqlen", "block_name_to_quantize",
            "module_name_preceding_first_block", "batch_size", "pad_token_id", "use_exllama", "use_cuda_fp16",
            "max_input_length", "exllama_config", "cache_block_outputs", "modules_in_block_to_quantize",
            "backend", "zero_point", "version", "modules_to_not_convert", "do_fuse", "fuse_max_seq_len",
            "quant_type")
    return m.finish()
