"""Hugging Face <-> Megatron-Core conversion for the dense Llama, Qwen2 and Qwen3 families, one module per concern.

- :mod:`trainer.hf.config`: :func:`~trainer.hf.config.config_from_hf` reads a checkpoint's ``config.json`` into a :class:`~rtrl.sections.trainer.ModelSettings`
  (layers, width, heads, GQA groups, head width, FFN width, vocabulary, RMSNorm epsilon, SwiGLU, RoPE base
  and scaling, QKV bias, Qwen3's QK-norm, tied embeddings, positions) and refuses, with a
  :class:`~rtrl.errors.ConfigError` naming the field, what megatron-core's ``GPTModel`` cannot represent
  (mixture of experts, sliding windows, RoPE types other than default/linear/llama3, ...).
  :func:`~trainer.hf.config.config_from_settings` is what ``model.hf_path`` does.
- :mod:`trainer.hf.layout`: :func:`~trainer.hf.layout.name_table` maps every megatron tensor to the Hugging Face tensors it is made of, for the local
  layer spec (CPU) and the Transformer Engine spec (GPU: the norms before attention and MLP are fused into
  ``linear_qkv.layer_norm_weight`` and ``linear_fc1.layer_norm_weight``).
- :mod:`trainer.hf.load`, the import: :func:`~trainer.hf.load.load_hf` fills a built model (any tp, pp) from the safetensors files: each rank reads only its own
  shard of each tensor through ``safe_open(...).get_slice(name)[...]``; no full tensor is materialised and no
  rank talks to another.
- :mod:`trainer.hf.export`: :func:`~trainer.hf.export.export_hf` gathers the tensor-parallel shards and writes ``config.json`` (the one imported, as read)
  and ``model.safetensors`` (one file per pipeline stage plus ``model.safetensors.index.json`` when pp > 1),
  which ``transformers.AutoModelForCausalLM.from_pretrained`` loads. Import then export is bit-exact.

Layouts (per layer; ``ng`` query groups = KV heads, ``qpg`` query heads per group, ``d`` head width):

- ``linear_qkv`` is laid out per query group: ``[q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1,
  ...]`` (megatron's ``SelfAttention.get_query_key_value_tensors`` views it as ``[ng, (qpg + 2) * d]``); the
  HF ``q_proj``/``k_proj``/``v_proj`` rows are interleaved so on import and taken apart on export. Tensor
  parallelism splits it by whole groups: rank r holds groups ``r * ng/tp .. (r+1) * ng/tp - 1``, so it reads
  three contiguous row ranges (its groups' q heads, k heads, v heads). Biases alike.
- ``linear_fc1`` is ``[gate; up]`` (SwiGLU: ``silu(x W_gate) * (x W_up)``); rank r holds
  ``[gate rows of r; up rows of r]``, read as two row ranges.
- Row-parallel ``linear_proj`` (``o_proj``) and ``linear_fc2`` (``down_proj``): rank r reads its column range.
- Vocab-parallel embedding and output layer: the vocabulary is padded to ``cfg.padded_vocab_size`` (a multiple of
  lcm(:data:`VOCAB_MULTIPLE`, tp), Megatron-LM's ``make_vocab_size_divisible_by`` = 128 without the tp factor
  for power-of-two tp, so the padded size and hence checkpoints do not depend on tp); rank r holds rows
  ``r * Vp/tp ..``, reads the real ones among them and leaves the padding rows zero. Their logits are masked
  (:func:`trainer.model.mask_padded_vocab`); export cuts them off.
- Norms (and row-parallel biases) are replicated: every rank reads them whole.

The model builder (:mod:`trainer.model`) never reads Hugging Face weights: the factory (:mod:`trainer.factory`)
calls the import after it builds a model.
"""
