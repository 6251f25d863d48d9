"""Tiny random Hugging Face models and transformers' own answers on them, for ductile's tests.

Writes, under OUT:
  tokenizer.json                  a byte-level BPE trained here on a fixed text (300 tokens)
  llama/   LlamaForCausalLM: grouped-query attention (4 query, 2 KV heads), untied head,
           Llama 3.1 RoPE scaling, weights sharded (model.safetensors.index.json)
  qwen2/   Qwen2ForCausalLM: Q/K/V biases, tied head, one safetensors file
  gpt2/    GPT2LMHeadModel: Conv1D weights, gelu_new, learned positions, tied head; config.json
           with GPT-2's stock dropout (0.1, which ductile refuses unless a job turns it off),
           its weight file in the Hub's legacy names (no `transformer.` prefix, the attention's
           causal-mask buffers `h.{i}.attn.bias` beside the weights), as openai-community/gpt2's
  each with reference.safetensors: input_ids [3, 17], logits of input_ids[:, :16], the loss
  (mean cross-entropy against input_ids[:, 1:]), every parameter's gradient (grad.NAME) and
  greedy: the 8 ids transformers' greedy generate() continues input_ids[0, :5] with,
  all fp32, from transformers' eager forward with SDPA attention (GPT-2's in eval mode: no
  dropout).

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

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

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
    "gpt2": (
        GPT2LMHeadModel,
        GPT2Config(
            vocab_size=300,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            initializer_range=0.2,
            eos_token_id=0,
            bos_token_id=0,
        ),
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
    if name == "gpt2":
        # the Hub's legacy names: no base-model prefix, the causal-mask buffers beside them
        from safetensors.torch import load_file
        f = os.path.join(d, "model.safetensors")
        w = {k.removeprefix("transformer."): v for k, v in load_file(f).items()}
        for i in range(config.n_layer):
            w[f"h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
        save_file(w, f, metadata={"format": "pt"})
        # (transformers reads them back as the same model)
        again = cls.from_pretrained(d)
        for (n, p), (_, q) in zip(model.state_dict().items(), again.state_dict().items()):
            assert torch.equal(p, q), n
    # GPT-2's reference without dropout (eval changes nothing else in it)
    model.train(name != "gpt2")
    logits = model(input_ids=ids[:, :16]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    ref = {"input_ids": ids.contiguous(), "logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1)}
    for n, p in model.named_parameters():
        ref["grad." + n] = p.grad.detach().contiguous()
    # greedy decoding: 8 new tokens after the first 5 ids of the first sample
    with torch.no_grad():
        model.eval()
        ref["greedy"] = model.generate(
            input_ids=ids[:1, :5], max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0
        )[0, 5:].contiguous()
    save_file(ref, os.path.join(d, "reference.safetensors"))
    print(name, "->", d, "loss", float(loss.detach()), "params", sum(p.numel() for p in model.parameters()))
with open(os.path.join(out, "COMPLETE"), "w") as f:
    json.dump({"vocab": vocab}, f)
