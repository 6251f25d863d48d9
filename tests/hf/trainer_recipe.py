"""transformers' Trainer on the run a ductile job made: the same model directory, the same
samples in the same order (each step's, from ductile's ledger), the same global batch and the
same recipe. Prints, as JSON, the learning rate each optimizer step ran at and each step's loss.

usage: trainer_recipe.py RUN.json   (RUN: model, tokens, ctx, batch, steps: [[sample, ...], ...],
                                      lr, warmup_steps, min_lr, betas, eps, weight_decay,
                                      max_grad_norm, out)
"""

import json
import sys

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

run = json.load(open(sys.argv[1]))
torch.set_num_threads(1)
# ductile's token stream: DUCTOK01, the header's length (u32 LE), the header (JSON), tokens
raw = open(run["tokens"], "rb").read()
assert raw[:8] == b"DUCTOK01", "not a ductile token stream"
n = int.from_bytes(raw[8:12], "little")
header = json.loads(raw[12 : 12 + n])
width = {2: "<u2", 4: "<u4"}[header["width"]]
tokens = np.frombuffer(raw[12 + n :], dtype=width).astype(np.int64)
ctx = run["ctx"]
order = [k for step in run["steps"] for k in step]


class Samples(torch.utils.data.IterableDataset):
    """ductile's sample k: tokens[k·ctx .. k·ctx + ctx + 1] (the labels are the inputs: the
    model shifts them), in the order ductile's steps took them."""

    def __iter__(self):
        for k in order:
            ids = torch.from_numpy(tokens[k * ctx : k * ctx + ctx + 1].copy())
            yield {"input_ids": ids, "labels": ids.clone()}


lrs, losses = [], []


class Rates(TrainerCallback):
    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
        lrs.append(optimizer.param_groups[0]["lr"])


class Recorded(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        losses.append((out[0] if return_outputs else out).item())
        return out


model = AutoModelForCausalLM.from_pretrained(run["model"], dtype=torch.float32, attn_implementation="eager")
args = TrainingArguments(
    output_dir=run["out"],
    max_steps=len(run["steps"]),
    per_device_train_batch_size=run["batch"],
    learning_rate=run["lr"],
    lr_scheduler_type="cosine_with_min_lr",
    lr_scheduler_kwargs={"min_lr": run["min_lr"]},
    warmup_steps=run["warmup_steps"],
    optim="adamw_torch",
    adam_beta1=run["betas"][0],
    adam_beta2=run["betas"][1],
    adam_epsilon=run["eps"],
    weight_decay=run["weight_decay"],
    max_grad_norm=run["max_grad_norm"],
    logging_steps=10_000,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
    dataloader_num_workers=0,
    remove_unused_columns=False,
    seed=0,
)
trainer = Recorded(
    model=model,
    args=args,
    train_dataset=Samples(),
    data_collator=default_data_collator,
    callbacks=[Rates()],
)
no_decay = sorted(n for n, _ in model.named_parameters() if n not in trainer.get_decay_parameter_names(model))
trainer.train()
print(json.dumps({"lr": lrs, "loss": losses, "no_decay": no_decay}))
