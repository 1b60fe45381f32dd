"""Context parallelism (Ulysses) inside one forward/backward: two gloo ranks, each holding half of
every sequence, give the one-process loss and gradients (fp32, 1e-5), with SDPA and eager
attention, on a padded batch of odd length (padded again to split) and on a packed row of three
documents, whose loss must also equal the three documents run unpacked. The finetune.py parity
runs (cp2, cp2 x dp2 packed, cp2 x dp_shard2, cp2 x tp2) are in test_compositions.py."""

import pytest
import torch
from distributed import run_distributed
from helpers import tiny_llama

from toolkit.config import Config, validate
from toolkit.layout.dims import infer_dims

DOCS = (5, 6, 4)  # a packed row of three documents: 15 tokens, odd, so cp2 pads it to 16


def batches() -> dict[str, dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (2, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # the second row is right-padded
    labels = torch.where(mask == 1, ids, -100)
    labels[:, :3] = -100  # a prompt
    row = torch.randint(1, 100, (1, sum(DOCS)), generator=g)
    positions = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    packed_labels = torch.where(positions == 0, -100, row)  # a document's first token predicts nothing
    return {"padded": {"input_ids": ids, "attention_mask": mask, "labels": labels},
            "packed": {"input_ids": row, "attention_mask": torch.ones_like(row), "labels": packed_labels,
                       "position_ids": positions}}


def one_process(attn: str, name: str) -> tuple[float, dict]:
    from toolkit.data.packing import model_inputs
    from toolkit.objectives.sft.loss import token_loss_sum

    model, batch = tiny_llama(attn_implementation=attn), batches()[name]
    loss = token_loss_sum(model(**model_inputs(batch)).logits, batch["labels"])
    loss.backward()
    return loss.item(), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def unpacked_loss(attn: str) -> float:
    """The packed row's documents, each run on its own."""
    from toolkit.objectives.sft.loss import token_loss_sum

    model, batch, total, start = tiny_llama(attn_implementation=attn), batches()["packed"], 0.0, 0
    with torch.no_grad():
        for n in DOCS:
            ids = batch["input_ids"][:, start:start + n]
            labels = batch["labels"][:, start:start + n].clone()
            total += token_loss_sum(model(input_ids=ids).logits, labels).item()
            start += n
    return total


def cp_ranks(cases: list[tuple[str, str]]) -> list[tuple[float, dict]]:
    """One forward/backward per case with each rank holding its half of the sequence (one launch for
    all cases: spawning ranks costs more than the cases)."""
    import torch.distributed as dist

    from toolkit.parallel.cp import ContextParallel, use_ulysses
    from toolkit.objectives.sft.loss import target_loss_sum

    dist.init_process_group("gloo")
    out = []
    try:
        for attn, name in cases:
            model, batch = tiny_llama(attn_implementation=attn), batches()[name]
            use_ulysses(model)
            cp = ContextParallel(dist.group.WORLD, model.config)
            with cp.shard(batch) as local:
                assert local["inputs"]["input_ids"].shape[1] == -(-batch["input_ids"].shape[1] // 2)
                loss = target_loss_sum(model(**local["inputs"]).logits, local["targets"])
                loss.backward()  # inside: the backward's all-to-alls need the group too
            total = loss.detach().clone()
            dist.all_reduce(total)
            grads = {}
            for n, p in model.named_parameters():  # each rank's gradient covers its tokens: the sum is the whole
                dist.all_reduce(p.grad)
                grads[n] = p.grad.numpy().copy()
            out.append((total.item(), grads))
        return out
    finally:
        dist.destroy_process_group()


CASES = [(attn, name) for attn in ("sdpa", "eager") for name in ("padded", "packed")]


@pytest.fixture(scope="module")
def cp_results() -> dict:
    ranks = run_distributed(cp_ranks, 2, CASES)
    return {case: [r[i] for r in ranks] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("attn, name", CASES)
def test_ulysses_attention_matches_one_process(cp_results, attn, name):
    want_loss, want = one_process(attn, name)
    for loss, grads in cp_results[attn, name]:
        assert loss == pytest.approx(want_loss, rel=1e-6)
        for k in want:
            torch.testing.assert_close(torch.from_numpy(grads[k]), torch.from_numpy(want[k]), atol=1e-5, rtol=1e-5,
                                       msg=f"{attn}/{name}: {k}")
    if name == "packed":  # documents packed together never see each other, split over ranks or not
        assert cp_results[attn, name][0][0] == pytest.approx(unpacked_loss(attn), rel=1e-5)


def test_heads_must_divide_by_tp_times_cp():
    from transformers import LlamaConfig

    from toolkit.layout.rules import model_problems

    def cp_problems(config, tp, cp):  # what the runtime asks of a model's config (world: tp x cp ranks)
        return model_problems(config.to_dict(), tp=tp, pp=1, cp=cp, world=tp * cp)

    gqa = LlamaConfig(num_attention_heads=8, num_key_value_heads=2)
    assert cp_problems(gqa, tp=1, cp=2) == []
    (line,) = cp_problems(gqa, tp=2, cp=2)
    assert line == ("--cp 2 x --tp 2 needs query and key/value heads divisible by 4 (this model has 8 and 2); "
                    "choose cp x tp dividing both")
    assert cp_problems(LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3), tp=1, cp=3) == []


def test_cp_takes_its_share_of_the_world():
    dims, problems = infer_dims(8, tp=2, cp=2, sharded=True)
    assert problems == [] and (dims.dp_shard, dims.cp, dims.tp, dims.replicas) == (2, 2, 2, 4)
    _, problems = infer_dims(6, tp=2, cp=2)
    assert problems == ["--cp 2 x --tp 2 needs a world size that is a multiple of 4 (got 6); launch torchrun "
                        "--nproc_per_node 4 (times the data-parallel degree you want)"]


@pytest.mark.parametrize("flags, message", [
    ({"cp": 0}, "--cp must be >= 1 (got 0)"),
    ({"cp": 2, "zero_stage": 3}, "--cp 2 with --zero-stage 3 is not supported; context parallel composes with DDP, "
                                 "--dp-shard N (FSDP2 on the mesh) and --tp (drop one of them)"),
    ({"cp": 2, "pp": 2}, "--cp 2 with --pp 2 is not supported"),
])
def test_cp_flag_conflicts_are_named(flags, message):
    cfg = Config().replace(**flags)
    assert any(p.startswith(message) for p in validate(cfg)), validate(cfg)
