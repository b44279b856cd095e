"""One rank of `test_trainer_ddp_two_ranks`: run by `torchrun --nproc_per_node 2 ddp_trainer_script.py CKPT WHICH OUT`.

Two Trainer steps on the CPU (gloo) with gradient checkpointing, then each rank writes the sums of its trainable
parameters to OUT/rank{RANK}.json. WHICH: "released" (the released container, vision side frozen, as text-only
fine-tuning does) or "language_model"."""

import json
import os
import sys

import torch
from transformers import Trainer, TrainingArguments

from transformers_k3 import KimiK3ForConditionalGeneration


class Motifs(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, 500, (24,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def main(path, which, out):
    model = KimiK3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    if which == "released":
        model.vision_tower.requires_grad_(False)
        model.mm_projector.requires_grad_(False)
    else:
        model = model.language_model
    rank = int(os.environ["RANK"])
    args = TrainingArguments(
        output_dir=os.path.join(out, "trainer"), use_cpu=True, save_strategy="no", report_to=[], max_steps=2,
        learning_rate=1e-3, per_device_train_batch_size=2, gradient_checkpointing=True, dataloader_num_workers=0,
        seed=0, disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=Motifs()).train()
    sums = [float(p.double().sum()) for p in model.parameters() if p.requires_grad]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(sums, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
