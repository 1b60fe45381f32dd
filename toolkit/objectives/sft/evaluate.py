"""SFT's evaluation: the mean token loss over held-out rows, and the exact-match accuracy of greedy answers
(a built-in task's). Each rank takes a strided shard of the examples and the sums are all-reduced, so the
numbers are exact for any world size (`toolkit.objectives.evaluate.sharded_batches`)."""

from __future__ import annotations

import torch

from toolkit.data.labels import count_targets
from toolkit.data.images import answer_texts, image_refs, open_image, template_messages
from toolkit.data.tokenize import prompt_text
from toolkit.objectives.evaluate import sharded_batches


@torch.no_grad()
# compiled blocks keep their training graphs
@torch.compiler.set_stance("force_eager")
def eval_loss(strategy, model, rows: list[dict], batch_size: int, pad_id: int) -> float:
    """Mean token loss over `rows`; `strategy` (toolkit.parallel.strategy) runs the forward."""
    accelerator = strategy.accelerator
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for batch, held in sharded_batches(strategy, rows, batch_size, pad_id, strategy.eval_device(model)):
        loss = strategy.eval_loss_sum(model, batch).to(accelerator.device)
        total += bool(held) * torch.stack([loss.double(),
                                           count_targets(batch["labels"]).double().to(accelerator.device)])
    # model-parallel peers count both sums as often: the ratio holds
    total = accelerator.reduce(total, "sum")
    model.train()
    return (total[0] / total[1]).item()


@torch.no_grad()
# compiled blocks keep their training graphs
@torch.compiler.set_stance("force_eager")
def exact_match(strategy, model, tokenizer, conversations: list, answers: list[str],
                batch_size: int = 16, max_new_tokens: int = 16, processor=None) -> tuple[int, int, list[str]]:
    """(correct, total, rank-0 samples): greedy completion of each prompt vs the expected answer. `processor`: an
    image-text model's, which renders the prompts and reads their images (`toolkit.data.images`)."""
    accelerator = strategy.accelerator
    model.eval()
    gen_model = strategy.unwrap(model)
    # Before prepare() the model is still where it was loaded (CPU, or its device_map for QLoRA).
    device = next(gen_model.parameters()).device
    asked = [[m for m in c if m["role"] != "assistant"] for c in conversations]
    prompts = [prompt_text(tokenizer, c) if processor is None else processor.apply_chat_template(
        template_messages(c), tokenize=False, add_generation_prompt=True) for c in asked]
    rank, ranks, replicas = strategy.data.rank, strategy.data.ranks, strategy.data.replicas
    idx = list(range(rank, len(prompts), ranks))
    per_rank = -(-len(prompts) // ranks)
    # equal work on every rank; padding not scored
    idx += [idx[0] if idx else 0] * (per_rank - len(idx))
    n_real = len(range(rank, len(prompts), ranks))
    old_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    correct, samples = 0, []
    for start in range(0, len(idx), batch_size):
        chunk = idx[start:start + batch_size]
        if processor is None:
            enc = tokenizer([prompts[i] for i in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        else:
            enc = processor(text=[prompts[i] for i in chunk], return_tensors="pt", padding=True, padding_side="left",
                            add_special_tokens=False, images=[[open_image(r) for r in image_refs(asked[i])]
                                                              for i in chunk] if any(map(image_refs, asked)) else None)
        enc = enc.to(device)
        out = gen_model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, use_cache=True,
                                 synced_gpus=accelerator.num_processes > 1)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for j, (i, text) in enumerate(zip(chunk, texts)):
            if start + j < n_real:
                correct += text.strip() == answers[i].strip()
                if len(samples) < 3:
                    question = " ".join(answer_texts(next(m for m in reversed(conversations[i])
                                                          if m["role"] == "user")))
                    samples.append(f"{question!r} -> {text.strip()!r} "
                                   f"(expected {answers[i]!r})")
    tokenizer.padding_side = old_side
    total = accelerator.reduce(torch.tensor([correct], device=accelerator.device), "sum").item() // replicas
    model.train()
    return int(total), len(prompts), samples


class ExactMatch:
    """A built-in task's exact-match accuracy of greedy answers, before training (on the prepared model: ZeRO-3's
    weights are partitioned by then) and after: the run's `scores` (`toolkit.train.output.summarize`). Nothing
    where the data holds no answers."""

    def __init__(self, strategy, tokenizer, conversations: list, answers: list[str] | None, log=print, processor=None):
        self.strategy, self.tokenizer, self.log, self.processor = strategy, tokenizer, log, processor
        self.conversations, self.answers, self.scores = conversations, answers, {}

    def before(self, prepared) -> None:
        self.scores["before"] = exact_match(self.strategy, prepared, self.tokenizer, self.conversations, self.answers,
                                             processor=self.processor)
        self.log(f"exact match before training: {self.scores['before'][0]}/{self.scores['before'][1]}")

    def after(self, model) -> dict:
        if self.answers:
            self.scores["after"] = exact_match(self.strategy, model, self.tokenizer, self.conversations, self.answers,
                                            processor=self.processor)
        return self.scores
