"""A transformers Trainer run: tiny GPT-2 from a config, synthetic tokens, 2 ranks on CPU.

Run only as a script: pytest's `--doctest-modules` imports every module under tests/, and an
unguarded run trained into a folder named by pytest's first argument (`-q/0.json`).
"""

import json
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (32, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(out: str) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    )
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        logging_steps=1,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    report = {
        "args_mixed_precision": args.mixed_precision,
        "accelerator_mixed_precision": trainer.accelerator.mixed_precision,
        "grad_accum": args.gradient_accumulation_steps,
        "world_size": trainer.accelerator.num_processes,
        "losses": [row["loss"] for row in trainer.state.log_history if "loss" in row],
    }
    with open(f"{out}/{trainer.accelerator.process_index}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
