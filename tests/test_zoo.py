"""The architectures people finetune (issue 46), each on every layout, each training the model's own loss.

`toolkit.model.synthetic.ZOO`'s tiny random models (13 architectures: what makes each differ from Llama kept
at hidden 64, 2 blocks) run finetune.py as a user would, 2 steps of full-batch data, in two launches
(one process; two ranks). Every cell asserts one of
two things:

- it ran, and the start-up loss check held: the loss it trained was the model's own
  (`model(input_ids, labels=...)`, its logit transforms and router loss included) within 1e-4; where the
  layout has one data-parallel rank (TP, PP, CP), its step losses equal one process's within 1e-4;
- or it was refused before any step, in one line (exit 2, no traceback; before the weights load except
  for what only the loaded model shows, the packing check), with the words of the refusal expected for it
  below: a refusal that appears or disappears is a change this test shows.

Data-parallel layouts (ZeRO-3, FSDP) are held to the loss check only: a MoE router's load-balancing
loss is a product of means over the tokens a rank sees, so two ranks' halves are not one process's whole.
"""

from __future__ import annotations

import pytest
from distributed import launch_layouts
from helpers import losses, records

from toolkit.model.synthetic import ZOO, build_zoo_model_dir

ARCHS = list(ZOO)
ONE = {"full": ["--method", "full"], "lora": ["--method", "lora"], "packed": ["--method", "full", "--packing"]}
TWO = {"zero3": ["--zero-stage", "3", "--method", "lora"], "fsdp": ["--fsdp", "--method", "full"]}
SAME = {"tp2": ["--tp", "2", "--method", "full"], "pp2": ["--pp", "2", "--pp-microbatches", "2", "--method", "full"],
        "cp2": ["--cp", "2", "--method", "full"]}  # one data-parallel rank: one process's batches
LAYOUTS = [*ONE, *TWO, *SAME]
MOE_AUX = ("mixtral", "qwen3_moe", "gpt_oss")  # output_router_logits with coefficient 0.5
# (architecture, layout) -> words of its expected one-line refusal
REFUSED = {
    ("gpt2", "tp2"): "declares no base_model_tp_plan",
    ("gpt_oss", "tp2"): "embedding_rowwise",  # the only entry of its plan: nothing inside the blocks to split
    ("gpt2", "pp2"): "declares no base_model_pp_plan",
    **{(a, "pp2"): "--router-aux-loss-coef 0" for a in MOE_AUX},
    **{(a, "cp2"): "--router-aux-loss-coef 0" for a in MOE_AUX},
    # its forward builds the attention mask without the positions: found by the packing check before step 1
    ("gpt_oss", "packed"): "does not keep a packed row's documents apart",
}
COMMON = ["--seq-len", "64", "--max-steps", "2", "--log-every", "1", "--micro-batch-size", "4", "--lr", "1e-3",
          "--warmup-steps", "0", "--mixed-precision", "no", "--seed", "7", "--report-to", "none", "--verify", "load"]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, data_files):
    """(arch, layout) -> {"exit", "stdout", "stderr", "out"}: two launches of every cell."""
    models = {a: build_zoo_model_dir(tmp_path_factory.mktemp("zoo") / a, a) for a in ARCHS}
    common = ["--dataset", str(data_files["alpaca"]), *COMMON]

    def cells(layouts: dict[str, list[str]]) -> dict[str, list[str]]:
        return {f"{a}-{name}": ["--model", str(models[a]), *flags] for a in ARCHS for name, flags in layouts.items()}

    results = {}
    for layouts, nproc in ((ONE, 1), ({**TWO, **SAME}, 2)):
        root = tmp_path_factory.mktemp(f"zoo_{'_'.join(layouts)}")
        runs = launch_layouts(root, common, cells(layouts), nproc=nproc, launcher="fork",
                              timeout=1800)
        results.update({tuple(name.split("-", 1)): r for name, r in runs.items()})
    return results


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_each_architecture_trains_its_own_loss_on_each_layout_or_is_refused_in_one_line(zoo, arch, layout):
    run = zoo[(arch, layout)]
    said, err = run["stdout"].read_text(), run["stderr"].read_text()
    assert "Traceback" not in err, err[-3000:]
    if (arch, layout) in REFUSED:
        lines = [x for x in err.splitlines() if x.startswith("finetune.py: error:")]
        assert run["exit"] == 2 and len(lines) == 1, err[-3000:]
        assert REFUSED[(arch, layout)] in lines[0], lines[0]
        metrics = run["out"] / "metrics.jsonl"
        assert not metrics.exists() or not metrics.read_text().strip()  # refused before any step
        return
    assert run["exit"] == 0, err[-3000:]
    assert "loss check: the loss trained is model type" in said and "falls back" not in said, said[-3000:]
    assert "integrity: " in said and "reloads with plain transformers/peft" in said  # final/ reloads, same loss
    steps = losses(run["out"])
    assert len(steps) == 2
    moe = arch in MOE_AUX or arch == "deepseek_v3"  # the routers' spread is in every record (toolkit.model.router_load)
    for r in records(run["out"], "loss"):
        assert ("expert_load_cv" in r) == moe, (arch, layout)
        if moe:
            assert 0 <= r["expert_load_min"] <= 1 <= r["expert_load_max"] and r["expert_load_cv"] >= 0
    if layout in SAME:
        assert steps == pytest.approx(losses(zoo[(arch, "full")]["out"]), rel=1e-4)
