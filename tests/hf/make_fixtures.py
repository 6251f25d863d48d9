"""Tiny random Hugging Face models and transformers' own answers on them, for ductile's tests.

Writes, under OUT:
  tokenizer.json                  a byte-level BPE trained here on a fixed text (300 tokens)
  llama/   LlamaForCausalLM: grouped-query attention (4 query, 2 KV heads), untied head,
           Llama 3.1 RoPE scaling, weights sharded (model.safetensors.index.json)
  qwen2/   Qwen2ForCausalLM: Q/K/V biases, tied head, one safetensors file
  each with reference.safetensors: input_ids [3, 17], logits of input_ids[:, :16], the loss
  (mean cross-entropy against input_ids[:, 1:]) and every parameter's gradient (grad.NAME),
  all fp32, from transformers' eager forward with SDPA attention.

Run with the venv scripts/setup.sh makes (torch, transformers, tokenizers, safetensors).
"""
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
torch.manual_seed(0)

TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Elastic training keeps going when a node dies, a spot instance is reclaimed, or a job is resized.",
    "Madrid is the capital of Spain; Paris is the capital of France; Rome is the capital of Italy.",
    "Every committed step is kept, and no sample is skipped or repeated.",
]

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=300,
    special_tokens=["<|endoftext|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
)
tok.train_from_iterator(TEXT, trainer)
tok_path = os.path.join(out, "tokenizer.json")
tok.save(tok_path)
vocab = tok.get_vocab_size()
assert vocab <= 300, vocab

# the ids Python's tokenizers gives for a text ductile's tokenizer must reproduce
SAMPLE = "Madrid is the capital of Spain. Ünïcödé, digits 12345, and   spaces\n\tend."
with open(os.path.join(out, "tokenized.json"), "w") as f:
    json.dump({"text": SAMPLE, "ids": tok.encode(SAMPLE, add_special_tokens=False).ids}, f)

from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

common = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
    eos_token_id=0,
    bos_token_id=0,
)
fixtures = {
    "llama": (
        LlamaForCausalLM,
        LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        "4KB",
    ),
    "qwen2": (
        Qwen2ForCausalLM,
        Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000.0),
        None,
    ),
}

g = torch.Generator().manual_seed(1)
ids = torch.randint(0, vocab, (3, 17), generator=g)
for name, (cls, config, shard) in fixtures.items():
    config._attn_implementation = "sdpa"
    torch.manual_seed(2)
    model = cls(config).float()
    d = os.path.join(out, name)
    if shard:
        model.save_pretrained(d, max_shard_size=shard)
    else:
        model.save_pretrained(d)
    shutil.copy(tok_path, os.path.join(d, "tokenizer.json"))
    model.train()
    logits = model(input_ids=ids[:, :16]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    ref = {"input_ids": ids.contiguous(), "logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1)}
    for n, p in model.named_parameters():
        ref["grad." + n] = p.grad.detach().contiguous()
    save_file(ref, os.path.join(d, "reference.safetensors"))
    print(name, "->", d, "loss", float(loss.detach()), "params", sum(p.numel() for p in model.parameters()))
with open(os.path.join(out, "COMPLETE"), "w") as f:
    json.dump({"vocab": vocab}, f)
