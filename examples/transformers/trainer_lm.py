"""A causal language model trained with Hugging Face's `Trainer`, written as a user would write
one: no line of it knows ductile. Run it under `torchrun` or as a ductile
`runtime = "torchrun"` job with `[program] integrations = ["transformers"]`: ductile then adds
its callback (progress in `dctl status`, a save on notice of a drain or resize) and resumes
`trainer.train()` from the newest complete checkpoint in `--output_dir` after a restart.

A small Llama (random init) on a seeded synthetic corpus, CPU and gloo; the global batch stays
`--global_batch` at any world size (each rank takes its share), so a run that changes size
trains on the same samples step by step. At the end rank 0 writes the weights to
`OUTPUT_DIR/final.pt`.

    torchrun --nproc-per-node=2 trainer_lm.py --output_dir /tmp/lm --max_steps 40
"""

import argparse
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Corpus(torch.utils.data.Dataset):
    """Token sequences with a learnable pattern: each next token is the previous plus a
    per-sequence stride, mod the vocabulary."""

    def __init__(self, n, ctx, vocab, seed):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.x = (start + stride * torch.arange(ctx)) % vocab

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        ids = self.x[i]
        return {"input_ids": ids, "labels": ids.clone()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=40)
    p.add_argument("--save_steps", type=int, default=10)
    p.add_argument("--global_batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--learning_rate", type=float, default=3e-3)
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.global_batch % world:
        raise ValueError(f"--global_batch {a.global_batch} does not split over {world} ranks")
    torch.manual_seed(a.seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.max_steps,
        per_device_train_batch_size=a.global_batch // world,
        learning_rate=a.learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=4,
        logging_steps=1,
        save_steps=a.save_steps,
        save_total_limit=3,
        seed=a.seed,
        data_seed=a.seed,
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Corpus(4096, 32, 64, a.seed))
    trainer.train()
    if trainer.is_world_process_zero():
        torch.save(
            {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            os.path.join(a.output_dir, "final.pt"),
        )
        print(f"finished at step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
