"""Image-text models (issue 73): a tiny LLaVA of random weights with its real processor (CLIP's PIL image processor),
built here and loaded through `from_pretrained`; PNG files drawn here. The data forms users have, the labels, SFT with
LoRA and full through finetune.py, the data-parallel layouts against one process, the saved folder in plain
transformers/peft, and bad input as one line."""

from __future__ import annotations

import base64
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from distributed import launch, launch_layouts, parity_args
from helpers import losses, records

from vlm_zoo import build_vlm_dir, class_dir, lfm2_vl_without_torchvision

from toolkit.model.synthetic import build_llava_dir

COLORS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
# (28 / 14)^2 patches + CLIP's class token (vision_feature_select_strategy "full")
TOKENS_PER_IMAGE = 5


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    return build_llava_dir(tmp_path_factory.mktemp("llava") / "model")


def chat_record(image: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                      {"type": "text", "text": "What color is it?"}]},
                         {"role": "assistant", "content": answer}]}


# TRL's reward signature: the picture's color's first letter anywhere in the completion (it varies among a random
# model's completions, and with the picture)
REWARD = '''
def initial(completions, answer, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(a[0] in t) for t, a in zip(texts, answer)]
'''


def pair_records(first: int, last: int) -> list[dict]:
    """TRL's image-text preference pairs (its `rlaif-v_formatted` layout: an images column, bare image parts in the
    prompt, completions as content parts): for each image first..last-1, its color chosen over each other color. A
    model blind to the images ranks at most the larger side of each two colors' pairs right."""
    asked = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is it?"}]}]
    names = list(COLORS)
    return [{"images": [f"images/{i}.png"], "prompt": asked,
             "chosen": [{"role": "assistant", "content": [{"type": "text", "text": names[i % 3]}]}],
             "rejected": [{"role": "assistant", "content": [{"type": "text", "text": names[(i + k) % 3]}]}]}
            for i in range(first, last) for k in (1, 2)]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """24 one-color PNGs of varied sizes in `images/`, and chat.jsonl beside it: each asks the color (relative paths),
    and one example with two images (one as OpenAI's image_url); mixed.jsonl adds a text-only example; pairs_train.jsonl
    and pairs_eval.jsonl, `pair_records` of images 0-15 and 16-23; prompts.jsonl, GRPO's prompts asking the color of
    images 0-15 (the fourth with two images), and reward.py (`REWARD`); unpaired.jsonl, KTO's form of images 0-15."""
    from PIL import Image

    d = tmp_path_factory.mktemp("vision")
    (d / "images").mkdir()
    rows = []
    for i in range(24):
        name = list(COLORS)[i % 3]
        Image.new("RGB", (30 + 3 * i, 44 - i), COLORS[name]).save(d / "images" / f"{i}.png")
        rows.append(chat_record(f"images/{i}.png", name))
    rows.append({"messages": [{"role": "user", "content": [
        {"type": "image", "image": "images/1.png"}, {"type": "image_url", "image_url": {"url": "images/2.png"}},
        {"type": "text", "text": "same color?"}]}, {"role": "assistant", "content": "no"}]})
    (d / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color?"}]}],
                "images": [f"images/{i}.png"], "answer": list(COLORS)[i % 3]} for i in range(16)]
    prompts[3]["prompt"][0]["content"].insert(0, {"type": "image"})
    prompts[3]["images"].insert(0, "images/5.png")
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    (d / "reward.py").write_text(REWARD)
    # KTO's unpaired form (TRL's): each image's color desirable, the next color not
    unpaired = [{"images": r["images"], "prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
                for r in pair_records(0, 16)[0::2] for side in ("chosen", "rejected")]
    (d / "unpaired.jsonl").write_text("".join(json.dumps(r) + "\n" for r in unpaired))
    for name, first, last in (("pairs_train", 0, 16), ("pairs_eval", 16, 24)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pair_records(first, last)))
    rows.insert(5, {"messages": [{"role": "user", "content": "the quick fox"},
                                 {"role": "assistant", "content": "jumps"}]})
    (d / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # text-only chats, to mix with the pictures (`--dataset chat.jsonl:0.7,text.jsonl:0.3`)
    words = ("cat", "dog", "fox", "owl", "bee", "ant")
    (d / "text.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"say {w}"},
                                                                  {"role": "assistant", "content": w}]}) + "\n"
                                          for w in words))
    return d


def prepared(argv: list[str]):
    """finetune.py's data for `argv`: the processor and the prepared rows (--images resolved as the run does)."""
    from toolkit.cli.startup import resolve_images, settle
    from toolkit.data.prepare import prepare_data
    from toolkit.model.load import load_tokenizer
    from toolkit.model.vision import processor_for

    cfg = settle(argv)
    cfg = resolve_images(cfg, cfg.model.model)
    tokenizer = load_tokenizer(cfg.model.model)
    processor = processor_for(cfg.model.model, tokenizer, pixels=(cfg.data.image_min_pixels,
                                                                  cfg.data.image_max_pixels)) \
        if cfg.data.images == "on" else None
    return processor, prepare_data(cfg.data_settings, tokenizer, processor=processor)


def test_labels_are_the_answer_tokens_and_never_an_image_token(llava, images):
    """Each image's placeholder expands to its TOKENS_PER_IMAGE tokens as the processor expands it; the labels are the
    answer and its end-of-turn token, wherever the image tokens moved them."""
    processor, data = prepared(["--model", str(llava), "--dataset", str(images / "mixed.jsonl")])
    image_id = processor.image_token_id
    assert len(data.train) == 26 and data.stats.examples == 26 and data.stats.dropped == 0
    lines = (images / "mixed.jsonl").read_text().splitlines()
    answers = [json.loads(line)["messages"][-1]["content"] for line in lines]
    for row, answer in zip(data.train, answers):
        assert row["input_ids"].count(image_id) == TOKENS_PER_IMAGE * len(row["images"])
        trained = [t for t in row["labels"] if t != -100]
        assert image_id not in trained
        assert processor.tokenizer.decode(trained) == answer + "<|im_end|>"
        # the labels sit on the answer's own ids
        assert all(t == -100 or t == i for t, i in zip(row["labels"], row["input_ids"]))
    assert [len(r["images"]) for r in data.train].count(0) == 1
    assert all(Path(p).is_absolute() and Path(p).is_file() for r in data.train for p in r["images"])


def test_the_forms_users_have_give_the_same_rows(llava, images, tmp_path):
    """LLaMA-Factory/ShareGPT's <image> placeholders with an images column, alpaca rows with an image column (named
    with --columns), and an image as a data URL give the rows chat messages with image parts give."""
    first = [json.loads(line) for line in (images / "chat.jsonl").read_text().splitlines()][:3]
    path = [r["messages"][0]["content"][0]["image"] for r in first]
    answers = [r["messages"][1]["content"] for r in first]
    sharegpt = [{"conversations": [{"from": "human", "value": "<image>What color is it?"},
                                   {"from": "gpt", "value": a}], "images": [p]} for p, a in zip(path, answers)]
    alpaca = [{"instruction": "What color is it?", "output": a, "photo": p} for p, a in zip(path, answers)]
    # Hugging Face's layout: bare image parts, the images' paths in a column
    asked = [{"type": "image"}, {"type": "text", "text": "What color is it?"}]
    bare = [{"messages": [{"role": "user", "content": asked}, {"role": "assistant", "content": a}], "images": [p]}
            for p, a in zip(path, answers)]
    (images / "bare.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bare))
    url = "data:image/png;base64," + base64.b64encode((images / path[0]).read_bytes()).decode()
    (images / "sharegpt.json").write_text(json.dumps(sharegpt))
    (images / "alpaca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in alpaca))
    (images / "chat3.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
    (tmp_path / "url.jsonl").write_text(json.dumps(chat_record(url, answers[0])) + "\n")
    base = ["--model", str(llava)]
    want = prepared(base + ["--dataset", str(images / "chat3.jsonl")])[1].train
    for argv in (["--dataset", str(images / "sharegpt.json")], ["--dataset", str(images / "bare.jsonl")],
                 ["--dataset", str(images / "alpaca.jsonl"), "--columns", "image=photo"]):
        got = prepared(base + argv)[1].train
        assert [(r["input_ids"], r["labels"], r["images"]) for r in got] == \
            [(r["input_ids"], r["labels"], r["images"]) for r in want], argv
    processor, data = prepared(base + ["--dataset", str(tmp_path / "url.jsonl")])
    (row,) = data.train
    assert (row["input_ids"], row["labels"]) == (want[0]["input_ids"], want[0]["labels"])
    from toolkit.data.image_rows import MediaCollate

    a, b = (MediaCollate(processor, 0)([r]) for r in (row, want[0]))
    assert torch.equal(a["media:pixel_values"], b["media:pixel_values"])


def test_image_pairs_train_the_completions_and_read_in_the_forms_users_have(llava, images, tmp_path):
    """A pair's two sequences share the prompt and its image; labels on each completion and its end-of-turn token
    only, ORPO's NLL labels on the chosen sequence's text, never an image token. ShareGPT's pairs (<image>, images
    column) and a prompt with OpenAI's image_url give the rows TRL's layout gives; a batch is chosen, rejected, ..."""
    from toolkit.data.image_rows import MediaCollate

    base = ["--model", str(llava), "--objective", "dpo"]
    processor, data = prepared(base + ["--dataset", str(images / "pairs_train.jsonl")])
    tok, image_id = processor.tokenizer, processor.image_token_id
    records = pair_records(0, 16)
    assert len(data.train) == 32 and data.stats.dropped == 0
    for row, r in zip(data.train, records):
        for ids, labels, side in ((row["input_ids"], row["labels"], "chosen"),
                                  (row["rejected_input_ids"], row["rejected_labels"], "rejected")):
            assert ids.count(image_id) == TOKENS_PER_IMAGE
            assert tok.decode([t for t in labels if t != -100]) == r[side][0]["content"][0]["text"] + "<|im_end|>"
            assert all(t == -100 or t == i for t, i in zip(labels, ids))
        assert image_id not in row["orpo_labels"] and sum(t != -100 for t in row["orpo_labels"]) == \
            len(row["input_ids"]) - TOKENS_PER_IMAGE
    first = records[:2]
    sharegpt = [{"conversations": [{"from": "human", "value": "<image>What color is it?"}],
                 "chosen": {"from": "gpt", "value": r["chosen"][0]["content"][0]["text"]},
                 "rejected": {"from": "gpt", "value": r["rejected"][0]["content"][0]["text"]}, "images": r["images"]}
                for r in first]
    openai = [{"prompt": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": r["images"][0]}}, {"type": "text", "text": "What color is it?"}]}],
        "chosen": r["chosen"][0]["content"][0]["text"], "rejected": r["rejected"][0]["content"][0]["text"]}
        for r in first]
    keys = ("input_ids", "labels", "rejected_input_ids", "rejected_labels", "images", "orpo_labels")
    for name, rows in (("sharegpt_pairs", sharegpt), ("openai_pairs", openai)):
        (images / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        got = prepared(base + ["--dataset", str(images / f"{name}.jsonl")])[1].train
        assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in list(data.train)[:2]], name
    batch = MediaCollate(processor, tok.pad_token_id)(list(data.train)[:2])
    assert batch["input_ids"].shape[0] == 4 and batch["media:pixel_values"].shape[0] == 4 and int(batch["pairs"]) == 2
    assert batch["input_ids"][1, :len(data.train[0]["rejected_input_ids"])].tolist() == \
        data.train[0]["rejected_input_ids"]
    assert torch.equal(batch["media:pixel_values"][0], batch["media:pixel_values"][1])


def loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean next-token loss of `batch` (padded rows, or one row end to end) through `model`, and its gradients."""
    import torch.nn.functional as F

    from toolkit.data.packing import model_inputs

    model.zero_grad()
    logits = model(**model_inputs(batch)).logits
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["llava", "idefics3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_padding_free_image_batches_give_the_padded_loss_and_gradients(llava, zoo, images, kind):
    """Four examples (one with two images) end to end in one row, each one's image features at its own tokens, the
    language model's attention kept to each example by the varlen kernel (the vision tower keeps its own), and
    Qwen2/2.5/3-VL's multi-axis positions (M-RoPE) laid out per example: the loss and every gradient of the padded
    batch, within 1e-5 (fp32; the kernels round apart). Pairs likewise: each sequence's DPO log-probability."""
    from transformers import AutoModelForImageTextToText

    from toolkit.data.image_rows import MediaCollate
    from toolkit.model.attention import register
    from toolkit.model.vision import lay_out_positions, parts
    from toolkit.objectives.logps import whole_row_logps

    path = llava if kind == "llava" else zoo[kind]
    processor, data = prepared(["--model", str(path), "--dataset", str(images / "chat.jsonl"), "--seq-len", "128"])
    rows = [data.train[i] for i in (0, 1, 24, 2)]
    assert len(rows[2]["images"]) == 2
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    model.set_attn_implementation({"text_config": register("varlen")})
    assert model.config.vision_config._attn_implementation == "sdpa"
    assert lay_out_positions(model) == kind.startswith("qwen")
    pad = processor.tokenizer.pad_token_id
    padded, free = MediaCollate(processor, pad)(rows), MediaCollate(processor, pad, padding_free=True, whole=True)(rows)
    assert free["input_ids"].shape == (1, sum(len(r["input_ids"]) for r in rows))
    assert torch.equal(padded["media:pixel_values"], free["media:pixel_values"])
    want, want_grads = loss_and_grads(model, padded)
    got, got_grads = loss_and_grads(model, free)
    assert got == pytest.approx(float(want), rel=1e-5)
    (tower,) = parts(model)["tower"]
    assert want_grads.keys() == got_grads.keys() and any(n.startswith(tower + ".") for n in got_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # image pairs: each sequence's log-probability, chosen and rejected
    _, pairs = prepared(["--model", str(path), "--dataset", str(images / "pairs_train.jsonl"), "--objective", "dpo",
                         "--seq-len", "128"])
    two = [pairs.train[0], pairs.train[3]]
    want = whole_row_logps(model, MediaCollate(processor, pad)(two))
    got = whole_row_logps(model, {**MediaCollate(processor, pad, padding_free=True, whole=True)(two), "documents": 4})
    assert got.tolist() == pytest.approx(want.tolist(), rel=1e-5)


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_packed_image_rows_give_their_examples_padded_loss_and_gradients(llava, zoo, images, kind):
    """--packing: the examples in first-fit-decreasing bins of at most --seq-len tokens (an image's tokens counted),
    every example in one bin; a micro-batch of two bins is their examples end to end in one row (M-RoPE laid out per
    example): the loss and every gradient of those examples' padded batch, within 1e-5 (fp32)."""
    from transformers import AutoModelForImageTextToText

    from toolkit.data.image_rows import ImageBins, MediaCollate
    from toolkit.model.attention import register
    from toolkit.model.vision import lay_out_positions

    path = llava if kind == "llava" else zoo[kind]
    processor, data = prepared(["--model", str(path), "--dataset", str(images / "chat.jsonl"), "--seq-len", "128",
                                "--packing"])
    bins = ImageBins(data.train, 128)
    assert sorted(i for b in bins.bins for i in b) == list(range(len(data.train)))
    assert max(bins.lengths) <= 128 and len(bins) < len(data.train) and len(bins.bins[0]) > 1
    batch = [bins[0], bins[1]]
    examples = [x for b in batch for x in b]
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    model.set_attn_implementation({"text_config": register("varlen")})
    lay_out_positions(model)
    pad = processor.tokenizer.pad_token_id
    packed = MediaCollate(processor, pad, padding_free=True, whole=True)(batch)
    assert packed["input_ids"].shape == (1, bins.lengths[0] + bins.lengths[1]) and len(examples) > 2
    want, want_grads = loss_and_grads(model, MediaCollate(processor, pad)(examples))
    got, got_grads = loss_and_grads(model, packed)
    assert got == pytest.approx(float(want), rel=1e-5) and want_grads.keys() == got_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_image_pixel_bounds_reach_the_processor_and_final(zoo, images, tmp_path):
    """--image-min-pixels / --image-max-pixels are the processor's own min_pixels / max_pixels (Qwen2-VL's, as
    `AutoProcessor.from_pretrained` takes them): each example's image tokens are those of Qwen2-VL's image processor
    built with the bounds (its merged 28x28 patches), 1 to 2 an image of chat.jsonl under 784 to 1568 pixels and
    16 or more over 112x112, where the folder's own bounds give 4 to 8; final/'s processor keeps them. (A processor
    that declares no such bound is one line: `test_bad_image_input_is_one_line_before_the_model_loads`.)"""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from toolkit.data.images import open_image
    from toolkit.model.vision import load_processor

    def tokens(low: int, high: int) -> tuple[list[int], list[int], object]:
        flags = [f for name, v in (("--image-min-pixels", low), ("--image-max-pixels", high)) if v
                 for f in (name, str(v))]
        processor, data = prepared(["--model", str(zoo["qwen2_vl"]), "--dataset", str(images / "chat.jsonl"),
                                    "--seq-len", "256", *flags])
        pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        alone = Qwen2VLImageProcessorPil(min_pixels=low or 56 * 56, max_pixels=high or 112 * 112, patch_size=14)
        want = [sum(int(g.prod()) // 4 for g in alone([open_image(i) for i in r["images"]])["image_grid_thw"])
                for r in data.train]
        return [r["input_ids"].count(pad) for r in data.train], want, processor

    own, want, _ = tokens(0, 0)
    assert own == want and min(own) == 4 and max(own) == 12
    small, want, processor = tokens(784, 1568)
    assert small == want and all(s < o for s, o in zip(small, own))
    large, want, _ = tokens(112 * 112, 0)
    assert large == want and min(large) >= 16 and all(lg > o for lg, o in zip(large, own))
    processor.save_pretrained(tmp_path / "final")
    assert load_processor(str(tmp_path / "final")).image_processor.size["longest_edge"] == 1568
    # built without its video processor here: the source's config for it saved beside (what loads the folder where
    # torchvision is installed)
    assert type(processor).__mro__[1].__name__ == "Qwen2VLProcessor"
    assert (tmp_path / "final" / "preprocessor_config.json").read_text() == \
        (zoo["qwen2_vl"] / "preprocessor_config.json").read_text()


def test_a_transformers_that_cannot_name_the_image_processor_without_torchvision_asks_for_it(zoo, monkeypatch,
                                                                                             tmp_path):
    """transformers 5.4 (the floor) without torchvision resolves no image processor for Qwen2-VL and says so as a
    ValueError about the folder (its words below, run there by hand on 2026-12-03): the line names torchvision, not
    the folder's files, where the folder names its image processor; where it names none, the files."""
    import importlib.util

    from transformers import AutoProcessor

    from toolkit.errors import UserError
    from toolkit.model.vision import load_processor

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the line would rightly blame the folder")
    path = str(zoo["qwen2_vl"])

    def older(*args, **kwargs):
        raise ValueError(f"Unrecognized image processor in {path}. Should have a `image_processor_type` key in its "
                         "preprocessor_config.json of config.json, or one of the following `model_type` keys in its "
                         "config.json: aimv2, ...")

    monkeypatch.setattr(AutoProcessor, "from_pretrained", older)
    with pytest.raises(UserError, match=r"its processor needs torchvision \(`pip install torchvision`"):
        load_processor(path)
    # a folder whose preprocessor_config.json names no image processor lacks its files, torchvision or not
    (tmp_path / "preprocessor_config.json").write_text("{}")
    path = str(tmp_path)
    with pytest.raises(UserError, match="the folder needs the processor's files"):
        load_processor(path)


def test_an_image_column_of_decoded_images_or_bytes_reads_as_the_file(images):
    """datasets gives an Image feature's values as PIL images (or {bytes, path} undecoded): both become data URLs whose
    pixels are the file's; a bare image part takes them in order."""
    from PIL import Image

    from toolkit.data.images import open_image, with_images

    conv = [{"role": "user", "content": [{"type": "image", "image": ""}, {"type": "image", "image": ""},
                                         {"type": "text", "text": "?"}]}, {"role": "assistant", "content": "red"}]
    png = images / "images" / "0.png"
    row = {"images": [Image.open(png), {"bytes": png.read_bytes(), "path": None}]}
    got = [p["image"] for p in with_images(conv, row, str(images / "x.jsonl"), "")[0]["content"][:2]]
    assert all(ref.startswith("data:") for ref in got)
    assert all(list(open_image(ref).getdata()) == list(open_image(str(png)).getdata()) for ref in got)


def test_images_are_read_where_the_model_and_data_have_them(llava, zoo, images, tmp_path):
    """--images auto: on for image data on an image-text model; a model that also loads as a causal LM (Gemma 3)
    trains text-only data as one (its padding-free text path, its causal class); LLaVA, which loads only as an
    image-text model, reads text-only data through the processor too; off trains the text alone."""
    from toolkit.cli.startup import resolve_images, settle
    from toolkit.model.vision import auto_class

    text = tmp_path / "text.jsonl"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    text.write_text(json.dumps({"messages": chat}) + "\n")

    def images_of(model, data, *flags):
        cfg = settle(["--model", str(model), "--dataset", str(data), *flags])
        return resolve_images(cfg, str(model)).data.images

    assert images_of(zoo["gemma3"], images / "chat.jsonl") == "on"
    assert images_of(zoo["gemma3"], text) == "off"
    assert images_of(llava, text) == "on"
    assert images_of(zoo["gemma3"], images / "chat.jsonl", "--images", "off") == "off"
    # Gemma 3's image batches are padded whatever kernel --attn names (its token_type_ids are per row); LLaVA's not
    for model, want in ((zoo["gemma3"], False), (llava, None)):
        cfg = settle(["--model", str(model), "--dataset", str(images / "chat.jsonl"), "--attn", "varlen"])
        assert resolve_images(cfg, str(model)).data.padding_free is want
    from transformers import AutoConfig

    assert auto_class(AutoConfig.from_pretrained(zoo["mllama"])).__name__ == "AutoModelForCausalLM"
    assert auto_class(AutoConfig.from_pretrained(zoo["mllama"]), True).__name__ == "AutoModelForImageTextToText"


def test_images_for_a_vision_model_of_no_image_text_class_are_one_line(images, tmp_path):
    """A config with a vision_config whose model type is no image-text class (CLIP) is told so, not called text-only."""
    from transformers import AutoConfig

    from toolkit.cli.startup import resolve_images, settle
    from toolkit.errors import UserError

    AutoConfig.for_model("clip").save_pretrained(tmp_path / "clip")
    cfg = settle(["--model", str(tmp_path / "clip"), "--dataset", str(images / "chat.jsonl")])
    with pytest.raises(UserError, match="is no image-text model \\(model type clip is no class of "
                                        "AutoModelForImageTextToText\\)"):
        resolve_images(cfg, str(tmp_path / "clip"))


def test_lora_targets_named_by_the_user_stay_on_the_language_model(llava, images):
    """--lora-targets q_proj,v_proj: the CLIP tower's q_proj and v_proj share the names, and keep their weights."""
    from toolkit.cli.startup import resolve_images, settle
    from toolkit.model.load import ModelShape, apply_lora, load_model

    cfg = settle(["--model", str(llava), "--dataset", str(images / "chat.jsonl"), "--lora-targets", "q_proj,v_proj"])
    cfg = resolve_images(cfg, str(llava))
    model = apply_lora(load_model(cfg, str(llava)), ModelShape.of(cfg))
    adapted = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    assert adapted and all(".language_model." in n and n.endswith(("q_proj", "v_proj")) for n in adapted)


def test_an_image_free_micro_batch_runs_a_blank_image_on_several_ranks(llava, images, monkeypatch):
    """On several ranks a micro-batch without an image would skip the vision tower the other ranks run (a ZeRO-3 or
    FSDP hang, DDP's unused projector). Padding-free, it runs one blank image as a document of its own without
    labels: the loss and every gradient equal the batch's alone (the tower's and projector's now exist, zero), and
    the examples and tokens counted do not include it. Padded batches (--no-padding-free), and GRPO's prompts, are
    refused in one line before the model loads."""
    from transformers import AutoModelForImageTextToText

    from toolkit.data.image_rows import MediaCollate
    from toolkit.data.packing import count_examples
    from toolkit.errors import UserError
    from toolkit.model.attention import register

    processor, data = prepared(["--model", str(llava), "--dataset", str(images / "mixed.jsonl"), "--seq-len", "128"])
    plain = [r for r in data.train if not r["images"]]
    pad = processor.tokenizer.pad_token_id
    alone = MediaCollate(processor, pad, padding_free=True, whole=True, ranks=1)(plain)
    ranked = MediaCollate(processor, pad, padding_free=True, whole=True, ranks=2)(plain)
    assert "media:pixel_values" not in alone and ranked["media:pixel_values"].shape[0] == 1
    assert ranked["input_ids"].shape[1] > alone["input_ids"].shape[1]
    assert count_examples(ranked) == count_examples(alone) == 1
    assert ranked["attention_mask"].sum() == alone["attention_mask"].sum()
    model = AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32)
    model.set_attn_implementation({"text_config": register("varlen")})
    want, want_grads = loss_and_grads(model, alone)
    got, got_grads = loss_and_grads(model, ranked)
    assert got == want
    extra = got_grads.keys() - want_grads.keys()
    assert any(".vision_tower." in n for n in extra) and any("multi_modal_projector" in n for n in extra)
    assert all(not got_grads[n].any() for n in extra)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=0, msg=name)

    monkeypatch.setenv("WORLD_SIZE", "2")
    prepared(["--model", str(llava), "--dataset", str(images / "mixed.jsonl")])
    # the ranks that read different micro-batches decide it: under --tp 2 alone both read the same one
    from toolkit.cli.startup import settle
    from toolkit.data.loader import training_loader
    from toolkit.model.load import load_tokenizer

    for flags, blank in (([], True), (["--tp", "2"], False)):
        cfg = settle(["--model", str(llava), "--dataset", str(images / "mixed.jsonl"), *flags])
        loader = training_loader(cfg, data.train, load_tokenizer(str(llava)), lambda line: None, False, True,
                                 register("varlen"))
        assert loader.collate_fn.idle == blank, flags
    with pytest.raises(UserError, match="1 of 26 examples have no image; on 2 ranks a padded micro-batch"):
        prepared(["--model", str(llava), "--dataset", str(images / "mixed.jsonl"), "--no-padding-free"])
    # padded too, under --tp 2 alone both ranks read the same micro-batch: no refusal, before the layout as after
    prepared(["--model", str(llava), "--dataset", str(images / "mixed.jsonl"), "--no-padding-free", "--tp", "2"])
    # held-out examples are evaluated padded
    with pytest.raises(UserError, match="mixed.jsonl: 1 of 26 held-out examples have no image; on 2 ranks a padded"):
        prepared(["--model", str(llava), "--dataset", str(images / "chat.jsonl"), "--eval-dataset",
                  str(images / "mixed.jsonl")])
    # GRPO's prompts alike
    rows = [json.loads(line) for line in (images / "prompts.jsonl").read_text().splitlines()]
    rows.append({"prompt": "What color?", "answer": "red"})
    (images / "prompts_mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match="1 of 17 prompts have no image; on 2 ranks"):
        prepared(["--model", str(llava), "--dataset", str(images / "prompts_mixed.jsonl"), "--objective", "grpo",
                  "--reward", f"{images / 'reward.py'}:initial", "--num-generations", "4", "--micro-batch-size", "4"])


def test_a_row_the_reference_pass_did_not_score_is_an_error(llava, images):
    """A pair whose reference log-probabilities are NaN (not scored: `rows_read` and the loader disagree) reads as NaN
    (the loader fetches a batch past the last step) but is an error in the loss, never a NaN loss."""
    from toolkit.data.image_rows import MediaCollate
    from toolkit.objectives.preference.loss import ObjectiveSpec, PreferenceLoss

    processor, data = prepared(["--model", str(llava), "--dataset", str(images / "pairs_train.jsonl"), "--objective",
                                "dpo"])
    rows = data.train
    rows.reference = torch.zeros(len(rows), 2)
    rows.reference[1, 0] = float("nan")
    loss = PreferenceLoss(ObjectiveSpec("dpo", 0.1, reference="precomputed"))
    good, bad = (MediaCollate(processor, processor.tokenizer.pad_token_id)([rows[i]]) for i in (0, 1))
    assert loss.reference_logps(None, good).tolist() == [0.0, 0.0]
    with pytest.raises(RuntimeError, match="a pair without reference log-probabilities reached the loss"):
        loss.reference_logps(None, bad)


def common(llava, images) -> list[str]:
    args = parity_args(llava, images / "chat.jsonl", "unused", "lora")
    i = args.index("--output-dir")
    return args[:i] + args[i + 2:]


TERM_AT = 3
LEARN_STEPS = 60
ZOO = ("idefics3", "gemma3", "mllama", "paligemma", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, Path]:
    """Idefics3 (SmolVLM), Gemma 3 and Mllama, tiny, with their real processors (`vlm_zoo`)."""
    root = tmp_path_factory.mktemp("zoo")
    return {kind: build_vlm_dir(root / kind, kind) for kind in ZOO}


@pytest.fixture(scope="module")
def runs(llava, images, zoo, tmp_path_factory) -> dict[str, Path]:
    """One process (micro-batch 4) and 2 ranks (micro-batch 2 each: the same global batch), one launch each: LoRA
    (also training the projector, and SIGTERMed at step TERM_AT of the 7 of an epoch), full; DDP LoRA, ZeRO-3 and
    FSDP2 full, and the SIGTERMed run resumed on 2 ranks (`--resume auto`). The same for DPO on image pairs (ORPO and
    SimPO on one process), a DPO full finetune of LEARN_STEPS steps scored on held-out pairs, and GRPO on image
    prompts."""
    out: dict[str, Path] = {}
    pairs = ["--dataset", str(images / "pairs_train.jsonl"), "--objective", "dpo"]
    grpo = ["--dataset", str(images / "prompts.jsonl"), "--objective", "grpo", "--reward",
            f"{images / 'reward.py'}:initial", "--num-generations", "4", "--max-completion-length", "8", "--max-steps",
            "4", "--steps-per-generation", "2", "--num-iterations", "2", "--lr", "1e-2"]
    lora_beta, full_b0 = ["--beta", "0.05"], ["--method", "full", "--loss-type", "grpo"]
    # a text-only example among the image ones: an epoch of 13 steps of 2
    mixed = ["--dataset", str(images / "mixed.jsonl"), "--max-steps", "13"]
    kto = ["--dataset", str(images / "unpaired.jsonl"), "--objective", "kto", "--lr", "1e-2"]
    mixture = ["--dataset", f"{images / 'chat.jsonl'}:0.7,{images / 'text.jsonl'}:0.3"]
    one = {"lora": ["--micro-batch-size", "4"], "full": ["--method", "full", "--micro-batch-size", "4"],
           "lora_projector": ["--micro-batch-size", "4", "--train-vision", "projector"],
           "term": ["--micro-batch-size", "4"], "qlora": ["--micro-batch-size", "4", "--method", "qlora"],
           "padded": ["--micro-batch-size", "4", "--no-padding-free"],
           # --packing: bins of <= 128 tokens, 2 a micro-batch end to end
           "packed": ["--micro-batch-size", "2", "--packing", "--seq-len", "128"],
           "qwen2_vl_packed": ["--model", str(zoo["qwen2_vl"]), "--micro-batch-size", "2", "--packing", "--seq-len",
                               "128"],
           "qwen2_vl_padded": ["--model", str(zoo["qwen2_vl"]), "--micro-batch-size", "4", "--no-padding-free"],
           # a mixture of the pictures and text-only chats, drawn with the seed
           "mixture": [*mixture, "--micro-batch-size", "4"],
           # the planner picks the layout (one process: DDP at the asked micro-batch, as "lora" runs)
           "auto": ["--strategy", "auto", "--micro-batch-size", "4"],
           **{name: [*mixed, *flags, "--micro-batch-size", "2"] for name, flags in (
               ("mixed_full", ["--method", "full"]), ("mixed_projector", ["--train-vision", "projector"]))},
           # PaliGemma's LoRA at 1e-3 moves its loss less than 5 batches differ (7.325 -> 7.328 measured): 1e-2
           **{f"{kind}_{method}": ["--model", str(zoo[kind]), "--method", method, "--micro-batch-size", "4",
                                   *(["--lr", "1e-2"] if kind == "paligemma" else [])]
              for kind in ZOO for method in ("lora", "full")},
           **{name: [*pairs, *flags, "--micro-batch-size", "4"] for name, flags in (
               ("dpo_lora", []), ("dpo_full", ["--method", "full"]), ("dpo_term", ["--method", "full"]),
               ("dpo_padded", ["--method", "full", "--no-padding-free"]),
               ("dpo_packed", ["--method", "full", "--packing", "--seq-len", "128"]),
               ("orpo", ["--objective", "orpo"]), ("simpo", ["--objective", "simpo"]),
               ("paligemma_dpo", ["--model", str(zoo["paligemma"])]),
               ("dpo_learns", ["--method", "full", "--max-steps", str(LEARN_STEPS), "--lr-schedule", "constant",
                               "--eval-dataset", str(images / "pairs_eval.jsonl"), "--eval-every", str(LEARN_STEPS),
                               "--log-every", "10"]))},
           "kto_lora": [*kto, "--micro-batch-size", "4"],
           "kto_full": [*kto, "--method", "full", "--micro-batch-size", "4"],
           # the KL rows' M-RoPE positions laid out on the row (padded ones:
           # test_kto_sequences_score_as_each_alone)
           "qwen2_vl_kto": [*kto, "--model", str(zoo["qwen2_vl"]), "--micro-batch-size", "4"],
           # the KL rows' token_type_ids their own (test_kto_sequences_score_as_each_alone)
           "gemma3_kto": [*kto, "--model", str(zoo["gemma3"]), "--micro-batch-size", "4"],
           # the KL rows' cross-attention mask their own
           "mllama_kto": [*kto, "--model", str(zoo["mllama"]), "--micro-batch-size", "4"],
           "grpo_lora": [*grpo, *lora_beta, "--micro-batch-size", "8"],
           "grpo_full": [*grpo, *full_b0, "--micro-batch-size", "8"],
           "qwen2_vl_grpo": [*grpo, *lora_beta, "--model", str(zoo["qwen2_vl"]), "--micro-batch-size", "8"],
           # its image tokens attend both ways: token_type_ids made of each padded row's ids
           "gemma3_grpo": [*grpo, *lora_beta, "--model", str(zoo["gemma3"]), "--micro-batch-size", "8"],
           # its text cross-attends to the images: cross_attention_mask made of each padded row's ids
           "mllama_grpo": [*grpo, *lora_beta, "--model", str(zoo["mllama"]), "--micro-batch-size", "8"]}
    two = {"ddp": ["--micro-batch-size", "2"], "zero3": ["--method", "full", "--zero-stage", "3", "--micro-batch-size",
                                                         "2"],
           "fsdp": ["--method", "full", "--fsdp", "--micro-batch-size", "2"],
           "resumed": ["--micro-batch-size", "2", "--resume", "auto"],
           # tensor parallel: dp 1, so the one process's micro-batch
           "tp": ["--tp", "2", "--micro-batch-size", "4"],
           "packed_ddp": ["--micro-batch-size", "1", "--packing", "--seq-len", "128"],
           "qwen2_vl_packed_fsdp": ["--model", str(zoo["qwen2_vl"]), "--micro-batch-size", "1", "--packing",
                                    "--seq-len", "128", "--fsdp"],
           "gemma3_tp": ["--model", str(zoo["gemma3"]), "--tp", "2", "--micro-batch-size", "4"],
           "mixture_ddp": [*mixture, "--micro-batch-size", "2"],
           # one example a rank: the text-only one alone on its rank once an epoch (a blank image runs there)
           **{name: [*mixed, *flags, "--micro-batch-size", "1"] for name, flags in (
               ("mixed_zero3", ["--method", "full", "--zero-stage", "3"]),
               ("mixed_ddp", ["--train-vision", "projector"]))},
           # M-RoPE positions laid out per example on each rank's padding-free row
           "qwen2_vl_fsdp": ["--model", str(zoo["qwen2_vl"]), "--method", "full", "--fsdp", "--micro-batch-size", "2"],
           **{name: [*pairs, *flags, "--micro-batch-size", "2"] for name, flags in (
               ("dpo_ddp", []), ("dpo_zero3", ["--method", "full", "--zero-stage", "3"]),
               ("dpo_fsdp", ["--method", "full", "--fsdp"]),
               ("dpo_resumed", ["--method", "full", "--fsdp", "--resume", "auto"]))},
           "dpo_tp": [*pairs, "--method", "full", "--tp", "2", "--micro-batch-size", "4"],
           "kto_ddp": [*kto, "--micro-batch-size", "2"],
           "kto_fsdp": [*kto, "--method", "full", "--fsdp", "--micro-batch-size", "2"],
           "qwen2_vl_kto_ddp": [*kto, "--model", str(zoo["qwen2_vl"]), "--micro-batch-size", "2"],
           # GRPO: the same 8 completions a step (2 ranks x 2 x 2; under --tp both ranks sample the 8)
           "grpo_ddp": [*grpo, *lora_beta, "--micro-batch-size", "2", "--grad-accum", "2"],
           "grpo_zero3": [*grpo, *full_b0, "--micro-batch-size", "2", "--grad-accum", "2", "--zero-stage", "3"],
           "grpo_tp": [*grpo, *lora_beta, "--micro-batch-size", "8", "--tp", "2"],
           "qwen2_vl_grpo_ddp": [*grpo, *lora_beta, "--model", str(zoo["qwen2_vl"]), "--micro-batch-size", "2",
                                 "--grad-accum", "2"]}
    terms = {"term": "resumed", "dpo_term": "dpo_resumed"}
    for n, group in ((1, one), (2, two)):
        root = tmp_path_factory.mktemp(f"vision{n}")
        if n == 2:
            for term, resumed in terms.items():
                shutil.copytree(out.pop(term), root / resumed)
        env = {term: {"TOOLKIT_FAULT": f"step:{TERM_AT}:signal=term"} for term in terms} if n == 1 else None
        for name, r in launch_layouts(root, common(llava, images), group, nproc=n, run_env=env).items():
            assert r["exit"] == (143 if name in terms else 0), f"{name}:\n{r['stderr'].read_text()[-3000:]}"
            out[name] = r["out"]
            out[name + ".stdout"] = r["stdout"]
    return out


def test_a_preempted_run_resumes_exactly_on_another_layout(runs):
    """SIGTERM mid-epoch: a checkpoint and exit 143; --resume auto on 2 ranks continues at the next step, and every
    step's loss equals the uninterrupted one-process run's (1e-5, fp32: the sums split over 2 ranks)."""
    assert f"preempted at step {TERM_AT}" in runs["term.stdout"].read_text()
    assert f"checkpoint-{TERM_AT}: continuing at step {TERM_AT + 1}" in runs["resumed.stdout"].read_text()
    got, want = dict(losses(runs["resumed"], steps=True)), dict(losses(runs["lora"], steps=True))
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5]
    assert [got[s] for s in sorted(got)] == pytest.approx([want[s] for s in sorted(want)], rel=1e-5)


@pytest.mark.parametrize("layout, reference", [("ddp", "lora"), ("zero3", "full"), ("fsdp", "full"), ("tp", "lora"),
                                               ("gemma3_tp", "gemma3_lora"), ("qwen2_vl_fsdp", "qwen2_vl_full")])
def test_data_parallel_layouts_give_one_process_losses(runs, layout, reference):
    """Same seed and data: each step's loss within 1e-5 (relative, fp32) of one process's; under --tp 2 the language
    model's blocks split over the ranks, the vision tower and projector whole on each (LLaVA padding-free, Gemma 3
    padded), and the saved folder reloads to the trained loss."""
    want, got = losses(runs[reference]), losses(runs[layout])
    assert len(got) == len(want) == 5
    assert got == pytest.approx(want, rel=1e-5)
    assert want[-1] < want[0]
    if layout.endswith("tp"):
        assert "layout: device mesh tp 2" in runs[f"{layout}.stdout"].read_text()
        assert json.loads((runs[layout] / "integrity.json").read_text())["ok"]


def test_packed_image_pairs_start_at_their_reference_to_the_bit(runs):
    """DPO on packed image pairs (a full finetune: the reference scored before step 1, end to end as the pairs
    train): each pair meets its own reference (step 1's margins exactly 0, its loss ln 2); the loss falls; the
    folder reloads."""
    said = runs["dpo_packed.stdout"].read_text()
    assert "packing: 32 pairs -> " in said and "rows of <= 256 tokens" in said
    first = records(runs["dpo_packed"], "loss")[0]
    assert first["rewards/margins"] == 0.0 and first["loss"] == pytest.approx(math.log(2), rel=1e-7)
    got = losses(runs["dpo_packed"])
    assert len(got) == 5 and got[-1] < got[0] and json.loads((runs["dpo_packed"] / "integrity.json").read_text())["ok"]


@pytest.mark.parametrize("layout, reference", [("packed_ddp", "packed"), ("qwen2_vl_packed_fsdp", "qwen2_vl_packed")])
def test_packed_image_runs_give_one_process_losses_on_two_ranks(runs, layout, reference):
    """finetune.py --packing on image examples (LLaVA; Qwen2-VL's M-RoPE laid out per example): the packing line,
    each step's loss on 2 ranks (DDP; FSDP2) within 1e-5 of one process's, the loss falling, and the saved folder
    reloading to the trained loss."""
    said = runs[f"{reference}.stdout"].read_text()
    assert "packing: 25 examples -> " in said and "rows of <= 128 tokens" in said
    # the global batch is counted in packed rows, not examples
    assert re.search(r"global batch .* = \d+ packed rows of <= 128 tokens", said)
    want, got = losses(runs[reference]), losses(runs[layout])
    assert len(got) == len(want) == 5 and got == pytest.approx(want, rel=1e-5) and want[-1] < want[0]
    for name in (layout, reference):
        assert json.loads((runs[name] / "integrity.json").read_text())["ok"], name


def test_a_mixture_of_image_and_text_files_trains_alike_on_two_ranks(runs):
    """--dataset chat.jsonl:0.7,text.jsonl:0.3 on LLaVA: each source named with its share; every rank draws the
    same mixture (the seed's), so 2 DDP ranks (blank images where a rank's micro-batch holds only text) give one
    process's losses within 1e-5, and the folder reloads to the trained loss."""
    said = runs["mixture.stdout"].read_text()
    assert re.search(r"mixture source \S+chat.jsonl: format chat, weight 0.700, 25 training records", said)
    assert re.search(r"mixture source \S+text.jsonl: format chat, weight 0.300, 6 training records", said)
    want, got = losses(runs["mixture"]), losses(runs["mixture_ddp"])
    assert len(want) == 5 and got == pytest.approx(want, rel=1e-5)
    assert json.loads((runs["mixture"] / "integrity.json").read_text())["ok"]


def test_a_mixture_draws_every_source_whole_with_the_seed(llava, images, tmp_path):
    """Image data in a mixture is drawn as text mixtures are: every training example of each source at least once
    (smaller sources cycled, none cut short), in an order the seed decides; --eval-split is held out of each source;
    preference pairs mix as well; a source with nothing left to train is one line."""
    from toolkit.errors import UserError

    chat, text = images / "chat.jsonl", images / "text.jsonl"
    mix = f"{chat}:0.7,{text}:0.3"
    _, alone = prepared(["--model", str(llava), "--dataset", str(chat)])
    _, words = prepared(["--model", str(llava), "--dataset", str(text)])
    _, data = prepared(["--model", str(llava), "--dataset", mix])
    # an example: its tokens and its pictures (the colors repeat)
    key = lambda r: (tuple(r["input_ids"]), tuple(r["images"]), tuple(r.get("rejected_input_ids", ())))  # noqa: E731
    drawn = [key(r) for r in data.train]
    sources = [{key(r) for r in alone.train}, {key(r) for r in words.train}]
    assert set(drawn) == sources[0] | sources[1] and len(drawn) > len(sources[0]) + len(sources[1])
    assert data.stats.examples - data.stats.dropped == len(drawn)
    assert data.stats.tokens == sum(len(k[0]) for k in drawn)
    # text-only rows are mixed among the image rows, not appended
    first_text = next(i for i, k in enumerate(drawn) if k in sources[1])
    assert first_text < len(sources[0])
    _, other = prepared(["--model", str(llava), "--dataset", mix, "--seed", "8"])
    assert [key(r) for r in other.train] != drawn
    _, held = prepared(["--model", str(llava), "--dataset", mix, "--eval-split", "0.2"])
    assert {key(r) for r in held.eval} & sources[0] and {key(r) for r in held.eval} & sources[1]
    assert not {key(r) for r in held.eval} & {key(r) for r in held.train}
    _, pairs = prepared(["--model", str(llava), "--objective", "dpo", "--dataset",
                         f"{images / 'pairs_train.jsonl'}:1,{images / 'pairs_eval.jsonl'}:1"])
    assert {len(r["images"]) for r in pairs.train} == {1} and len({key(r) for r in pairs.train}) == 48
    (tmp_path / "empty.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                   {"role": "assistant", "content": " "}]}) + "\n")
    with pytest.raises(UserError, match="empty.jsonl has nothing left to train"):
        prepared(["--model", str(llava), "--dataset", f"{chat}:1,{tmp_path / 'empty.jsonl'}:1"])


def test_encoded_image_rows_are_cached_and_encoded_again_when_an_input_changes(zoo, images, tmp_path, monkeypatch):
    """Encoding opens every image (the processor counts its tokens); a second run reads the rows back from the token
    cache, equal to the first's. An image replaced in place (another size: more tokens), other pixel bounds, another
    --seq-len or another seed's eval split encode them again."""
    from dataclasses import replace

    from PIL import Image

    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data"
    shutil.copytree(images, data)
    argv = ["--model", str(zoo["qwen2_vl"]), "--dataset", str(data / "chat.jsonl")]
    _, first = prepared(argv)
    _, again = prepared(argv)
    assert not first.stats.cached and again.stats.cached
    assert list(again.train) == list(first.train) and replace(again.stats, cached=False) == first.stats
    # the 30x44 picture of example 0 replaced by a 110x110 one (16 image tokens, the most the bounds give)
    Image.new("RGB", (110, 110), (255, 0, 0)).save(data / "images" / "0.png")
    _, changed = prepared(argv)
    assert not changed.stats.cached and len(changed.train[0]["input_ids"]) > len(first.train[0]["input_ids"])
    assert list(changed.train)[1:] == list(first.train)[1:]
    for flags in (["--image-max-pixels", str(56 * 56)], ["--seq-len", "52"], ["--eval-split", "0.2"],
                  ["--eval-split", "0.2", "--seed", "8"]):
        _, other = prepared([*argv, *flags])
        assert not other.stats.cached, flags


def test_examples_are_encoded_in_forked_processes_as_in_one(zoo, tmp_path, monkeypatch):
    """From 1024 examples on, --data-workers processes encode them (each opens its images and runs the processor):
    the rows and their counts equal one process's, and a record the processor refuses is the same one line naming
    it (an image beyond the bounds of a processor that does not resize), whichever process met it."""
    from PIL import Image

    from toolkit.errors import UserError

    qwen = tmp_path / "qwen2-vl"
    shutil.copytree(zoo["qwen2_vl"], qwen)
    config = qwen / "preprocessor_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "do_resize": False}))
    for name, size in (("small", (56, 56)), ("tall", (56, 84)), ("wide", (280, 140))):
        Image.new("RGB", size, (30, 30, 200)).save(tmp_path / f"{name}.png")
    rows = [chat_record(str(tmp_path / ("small.png" if i % 3 else "tall.png")), "blue") for i in range(1030)]
    data = tmp_path / "many.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = {}
    for workers in ("1", "2"):
        monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / f"cache{workers}"))
        _, got[workers] = prepared(["--model", str(qwen), "--dataset", str(data), "--data-workers", workers])
    assert len(got["1"].train) == 1030 and list(got["2"].train) == list(got["1"].train)
    assert got["2"].stats == got["1"].stats
    # two refused records in different processes' shares: the first in the file is named
    rows[1011] = rows[100] = chat_record(str(tmp_path / "wide.png"), "blue")
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for workers in ("1", "2"):
        monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / f"bad{workers}"))
        with pytest.raises(UserError, match=r"many.jsonl: record 101 \(line 101\): image .*wide.png \(280x140\) is "
                                            "beyond the bounds"):
            prepared(["--model", str(qwen), "--dataset", str(data), "--data-workers", workers])


FORKED = """
import sys, torch
from types import SimpleNamespace
from toolkit.data.image_prepare import _encoded_each
def resize(x):  # a processor that resizes with torch (transformers' torchvision-backed ones)
    return int(torch.nn.functional.interpolate(torch.rand(1, 3, 224, 224), size=(112, 112)).sum() > 0)
resize(0)  # the parent has run torch's thread pool (a small source encoded here first)
out = _encoded_each(resize, list(enumerate(range(1100))), SimpleNamespace(flag="--dataset", path="x"),
                    SimpleNamespace(data=SimpleNamespace(data_workers=2)))
print(len(out), sum(out))
"""


def test_forked_encoders_run_torch_after_the_parent_did():
    """A thread pool torch used before fork does not survive it: each forked encoder runs torch on one thread, so a
    processor that resizes with torch returns in a child after the parent ran one (it hung there before)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.split() == ["1100", "1100"], done.stderr[-2000:]


@pytest.mark.parametrize("layout, reference", [("mixed_zero3", "mixed_full"), ("mixed_ddp", "mixed_projector")])
def test_a_text_only_example_trains_among_image_ones_on_several_ranks(runs, layout, reference):
    """mixed.jsonl's text-only example alone on its rank once in the epoch: that rank runs a blank image through the
    vision tower (ZeRO-3 gathers its weights with the other rank's; DDP's projector, trained, is used), and every
    step's loss is one process's within 1e-5."""
    want, got = losses(runs[reference]), losses(runs[layout])
    assert len(got) == len(want) == 13 and got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("run, method, train_vision, layout, ranks", [
    ("lora", "lora", "none", "ddp", 1), ("full", "full", "none", "ddp", 1),
    ("lora_projector", "lora", "projector", "ddp", 1), ("ddp", "lora", "none", "ddp", 2),
    ("zero3", "full", "none", "zero3", 2), ("fsdp", "full", "none", "fsdp_full", 2),
    ("tp", "lora", "none", "tp2", 2), ("qwen2_vl_full", "full", "none", "ddp", 1),
    ("qwen2_vl_fsdp", "full", "none", "fsdp_full", 2)])
def test_the_planner_counts_the_vision_side_as_measured(runs, llava, zoo, run, method, train_vision, layout, ranks):
    """The planner's per-rank weights, gradients and Adam state for an image-text model (its language model's as for
    text, beside the vision tower and projector counted on a weightless skeleton: `toolkit.model.vision.plan_view`,
    frozen or trained as --method and --train-vision leave them, LoRA's trained copies held beside the originals)
    against each rank's bytes measured at step 1 (metrics.jsonl), within 5%: the runs above, not launched again.
    (The vision side's activations are not modelled: a frozen tower saves none for backward; no allocator peak is
    measured on a CPU, so the planner's whole peak for these models is not checked here.) --strategy auto plans an
    image-text model: one process, DDP, the losses of the run it names."""
    from toolkit.layout.dims import infer_dims
    from toolkit.model.vision import plan_view
    from toolkit.planner.estimate import PlanInput, estimate
    from toolkit.planner.layouts import stage_bytes
    from toolkit.planner.memory import STRATEGIES

    model = zoo["qwen2_vl"] if run.startswith("qwen2_vl") else llava
    text, vision = plan_view(json.loads((model / "config.json").read_text()))
    assert vision[0] > 0  # Qwen2-VL's merger is its tower's own: no projector apart
    inp = PlanInput(model=text, gpu_memory=2**40, gpus_per_node=ranks, method=method, lora_r=16, seq_len=64,
                    micro_batch=4 // ranks, precision="no", vision=vision, train_vision=train_vision)
    if layout == "tp2":
        dims, _ = infer_dims(2, tp=2)
        want = stage_bytes(inp, dims, 0, False, 4)
    else:
        want = estimate(inp, STRATEGIES[layout], False, 4 // ranks).bytes
    measured = records(runs[run])[0]
    for rank in range(ranks):
        assert measured["param_bytes"][rank] == pytest.approx(want["weights"], rel=0.05), rank
        optim = measured["optim_bytes"][rank] + measured["master_bytes"][rank]
        assert optim == pytest.approx(want["optimizer"], rel=0.05), rank
        if measured["grad_bytes"] is not None:  # null under DeepSpeed (freed inside its step)
            assert measured["grad_bytes"][rank] == pytest.approx(want["grads"], rel=0.05), rank
    if run == "lora":
        said = runs["auto.stdout"].read_text()
        assert "chosen: ddp" in said and losses(runs["auto"]) == pytest.approx(losses(runs["lora"]), rel=1e-6)


@pytest.mark.parametrize("padded, free", [("padded", "lora"), ("dpo_padded", "dpo_full"),
                                          ("qwen2_vl_padded", "qwen2_vl_lora")])
def test_image_runs_go_padding_free_by_default_with_the_padded_losses(runs, padded, free):
    """LLaVA's and Qwen2-VL's image batches go padding-free by default (their image features are placed at their
    tokens in order; Qwen2-VL's M-RoPE positions laid out per example): each step's loss within 1e-5 of the same
    run's padded batches (--no-padding-free), SFT and DPO (whose reference pass scores the rows end to end as it
    trains them)."""
    said = runs[f"{free}.stdout"].read_text()
    assert "batches: padding-free: each micro-batch's 4" in said and "with the processor's image inputs" in said
    padded_said = runs[f"{padded}.stdout"].read_text()
    assert "batches: padded to each micro-batch's longest row (--no-padding-free" in padded_said
    want, got = losses(runs[padded]), losses(runs[free])
    assert len(got) == len(want) == 5 and got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("layout, reference", [("dpo_ddp", "dpo_lora"), ("dpo_zero3", "dpo_full"),
                                               ("dpo_fsdp", "dpo_full"), ("dpo_resumed", "dpo_full"),
                                               ("dpo_tp", "dpo_full")])
def test_image_pairs_train_alike_on_every_data_parallel_layout(runs, layout, reference):
    """DPO on image pairs: step 1's loss is ln 2 (the policy is its reference: the base with the adapters off, or the
    log-probabilities computed before step 1); each step's loss within 1e-5 (relative, fp32) of one process's, a
    full finetune SIGTERMed at step TERM_AT and resumed on 2 ranks under FSDP2 included (its reference read back
    from the run's folder, not computed again from the trained weights)."""
    want, got = losses(runs[reference]), losses(runs[layout])
    assert len(got) == len(want) == 5 and want[0] == pytest.approx(math.log(2), rel=1e-6)
    assert got == pytest.approx(want, rel=1e-5)
    assert want[-1] < want[0]
    if layout == "dpo_resumed":
        assert "reference: train pairs' log-probabilities read from" in runs["dpo_resumed.stdout"].read_text()


def sampled(out: Path) -> list[tuple]:
    return [(c["step"], c["completion"], json.dumps(c["rewards"]))
            for c in map(json.loads, (out / "completions.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("layout, reference", [("grpo_ddp", "grpo_lora"), ("grpo_zero3", "grpo_full"),
                                               ("grpo_tp", "grpo_lora"), ("qwen2_vl_grpo_ddp", "qwen2_vl_grpo")])
def test_grpo_on_image_prompts_samples_and_trains_as_one_process(runs, layout, reference):
    """GRPO on image prompts (the images in each prompt's forward when sampling and training, the reference's too:
    LoRA's base, adapters off, beta 0.05; Qwen2-VL's multi-axis positions in each): each layout's completions equal
    one process's as text, every step's, and its losses, rewards and KL within 1e-5 (fp32)."""
    from distributed import assert_metric_close

    assert sampled(runs[layout]) == sampled(runs[reference])
    a, b = records(runs[layout], "loss"), records(runs[reference], "loss")
    assert [r["step"] for r in b] == [1, 2, 3, 4] and any(r["loss"] != 0 for r in b)
    # one round (2 prompt batches x 2 iterations): its reward logged at step 1, neither none nor all of it
    rewards = [r["reward"] for r in b if "reward" in r]
    assert len(rewards) == 1 and 0 < rewards[0] < 1
    for key in ("loss", "grad_norm", "reward", "kl", "entropy"):
        assert_metric_close(a, b, key, rel=1e-5, abs=1e-6, what=layout)


@pytest.mark.parametrize("kind", ["llava", *ZOO])
def test_every_tiny_model_reads_its_pictures(llava, zoo, kind):
    """The fixtures' own check: a red and a blue picture give each tiny model other next-token log-probabilities
    (by more than 0.01), so a test on it can tell an image read from one dropped (transformers starts Gemma 3's
    projector and Mllama's cross-attention gates at zero: `vlm_zoo` starts them random)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from toolkit.model.vision import load_processor

    path = llava if kind == "llava" else zoo[kind]
    processor, model = load_processor(str(path)), AutoModelForImageTextToText.from_pretrained(path)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                         "text": "the fox"}]}],
                                         tokenize=False, add_generation_prompt=True)
    got = []
    for color in ((255, 0, 0), (0, 0, 255)):
        enc = processor(text=[text], images=[[Image.new("RGB", (56, 56), color)]], add_special_tokens=False,
                        return_tensors="pt")
        with torch.no_grad():
            got.append(model(**enc).logits[0, -1].log_softmax(-1))
    assert (got[0] - got[1]).abs().max() > 0.01


@pytest.mark.parametrize("kind", ["gemma3", "mllama"])
def test_grpo_and_kto_on_per_token_image_inputs_train_through_the_cli(runs, kind):
    """finetune.py --objective grpo on Gemma 3 (its image tokens attending both ways, by token_type_ids made of each
    left-padded row's ids) and Mllama (its text cross-attending to the images, by a cross_attention_mask made of the
    ids): `test_image_prompts_sample_as_transformers_generate_does` holds sampling and the training forward to
    transformers', and that image tokens are never sampled. A round's completions logged, the steps' losses and KL
    not all zero, and the saved folder reloads to the trained loss (the integrity check, through the processor). KTO
    (`test_kto_sequences_score_as_each_alone` holds its KL sequences to transformers'): its loss falls, the folder
    reloads."""
    done = [json.loads(x) for x in (runs[f"{kind}_grpo"] / "completions.jsonl").read_text().splitlines()]
    assert {c["step"] for c in done} == {1, 2} and len(done) == 16
    b = records(runs[f"{kind}_grpo"], "loss")
    assert [r["step"] for r in b] == [1, 2, 3, 4] and any(r["loss"] != 0 for r in b) and any(r["kl"] > 0 for r in b)
    assert json.loads((runs[f"{kind}_grpo"] / "integrity.json").read_text())["ok"]
    kto = losses(runs[f"{kind}_kto"])
    assert len(kto) == 5 and kto[-1] < kto[0] and json.loads((runs[f"{kind}_kto"] / "integrity.json").read_text())["ok"]


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl", "gemma3", "mllama"])
def test_image_prompts_sample_as_transformers_generate_does(llava, zoo, images, kind):
    """The sampler's prompt forward reads the images: greedy completions (top-k 1) of image prompts, one of them with
    two images, left-padded together, equal transformers' `generate` on each prompt alone from the processor's own
    inputs (Qwen2-VL: its multi-axis positions from the given text positions, each decode step's continued from the
    prompt's; Gemma 3: its image tokens attending both ways, by token_type_ids made of the left-padded ids, in the
    prefill alone, as `generate` gives them; Mllama: its cross-attention mask made of the left-padded ids, each
    decode step carrying the prompt's last token's, as `generate` extends it); another picture gives other
    completions. The training forward's completion log-probabilities equal those of transformers' forward on each
    row alone, which computes its positions itself (Gemma 3: with the processor's token_type_ids; Mllama: the
    processor's cross-attention mask, its last row repeated over the completion as `generate` does)."""
    from transformers import AutoModelForImageTextToText

    from toolkit.data.images import open_image
    from toolkit.model.vision import lay_out_positions
    from toolkit.objectives.grpo.loss import completion_logps
    from toolkit.objectives.grpo.rollout import eos_ids, suppressed
    from toolkit.objectives.grpo.sampling import SamplingConfig, sample

    path = llava if kind == "llava" else zoo[kind]
    processor, data = prepared(["--model", str(path), "--dataset", str(images / "prompts.jsonl"),
                                "--objective", "grpo", "--reward", f"{images / 'reward.py'}:initial",
                                "--num-generations", "4", "--micro-batch-size", "4"])
    prompts = data.train
    rows = [0, 3, 1]
    assert len(prompts.images[3]) == 2 and len(prompts.prompt_ids[3]) > len(prompts.prompt_ids[0])
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    assert lay_out_positions(model) == (kind == "qwen2_vl")
    tok, ends = processor.tokenizer, eos_ids(processor.tokenizer, model)
    # the image token is never sampled (it would ask the training forward for another image), as transformers'
    # suppress_tokens does; Gemma 3's soft token too (its `image_token_id` is the begin-of-image mark)
    never = suppressed(prompts)
    assert (processor.tokenizer.convert_tokens_to_ids("<image_soft_token>") in never) == (kind == "gemma3")
    cfg = SamplingConfig(6, 1.0, top_k=1, suppress=never)
    ours = sample(model, [prompts.prompt_ids[r] for r in rows], [0] * 3, cfg, ends, tok.pad_token_id,
                  media=prompts.media(rows)).token_lists()
    for r, got in zip(rows, ours):
        enc = processor(text=[prompts.texts[r]], images=[[open_image(x) for x in prompts.images[r]]],
                        add_special_tokens=False, return_tensors="pt")
        want = model.generate(**enc, max_new_tokens=6, do_sample=False, eos_token_id=ends,
                              pad_token_id=tok.pad_token_id, suppress_tokens=list(never))
        assert got == want[0, enc["input_ids"].shape[1]:].tolist()[:len(got)] and got, r
    # the first prompt with the second's picture (another color)
    other = prompts.media([1])
    swapped = sample(model, [prompts.prompt_ids[0]], [0], cfg, ends, tok.pad_token_id, media=other).token_lists()
    assert swapped[0] != ours[0]
    # the training forward: left-padded prompts, right-padded completions, text positions given
    width, plen = max(map(len, ours)), max(len(prompts.prompt_ids[r]) for r in rows)
    ids = torch.full((3, plen + width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, (r, got) in enumerate(zip(rows, ours)):
        row = prompts.prompt_ids[r] + got
        ids[i, plen - len(prompts.prompt_ids[r]):plen + len(got)] = torch.tensor(row)
        mask[i, plen - len(prompts.prompt_ids[r]):plen + len(got)] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "positions": (mask.cumsum(1) - 1).clamp(min=0),
             "completion_ids": ids[:, plen:], **{"media:" + k: v for k, v in prompts.media(rows, ids).items()}}
    assert ("media:token_type_ids" in batch) == (kind == "gemma3")
    assert ("media:cross_attention_mask" in batch) == (kind == "mllama")
    with torch.no_grad():
        logps, _ = completion_logps(model, batch, 1.0)
        for i, (r, got) in enumerate(zip(rows, ours)):
            enc = processor(text=[prompts.texts[r]], images=[[open_image(x) for x in prompts.images[r]]],
                            add_special_tokens=False, return_tensors="pt")
            alone = torch.cat([enc["input_ids"], torch.tensor([got])], 1)
            extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
            for key in ("mm_token_type_ids", "token_type_ids"):
                if key in extra:
                    extra[key] = torch.nn.functional.pad(extra[key], (0, len(got)))
            if "cross_attention_mask" in extra:
                last = extra["cross_attention_mask"][:, -1:]
                extra["cross_attention_mask"] = torch.cat([extra["cross_attention_mask"],
                                                           last.expand(-1, len(got), -1, -1)], 1)
            logits = model(input_ids=alone, **extra).logits[0, enc["input_ids"].shape[1] - 1:-1]
            want = logits.log_softmax(-1).gather(1, torch.tensor(got)[:, None])[:, 0]
            torch.testing.assert_close(logps[i, :len(got)], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout, reference", [("kto_ddp", "kto_lora"), ("kto_fsdp", "kto_full"),
                                               ("qwen2_vl_kto_ddp", "qwen2_vl_kto")])
def test_kto_on_image_examples_trains_alike_on_every_data_parallel_layout(runs, layout, reference):
    """KTO on image examples (each KL sequence its own example's prompt and images with another's completion): step
    1's loss is 0.5 (the policy is its reference), each step's loss within 1e-5 of one process's; LLaVA's and
    Qwen2-VL's (its KL rows' multi-axis positions laid out on each rank's row)."""
    from distributed import assert_metric_close

    a, b = records(runs[layout], "loss"), records(runs[reference], "loss")
    assert len(b) == 5 and b[0]["loss"] == pytest.approx(0.5, rel=1e-6)
    # the full finetune's estimate rises above TRL's clamp at 0 (the LoRA's stays at it over these 5 steps)
    assert reference != "kto_full" or any(r["kl"] > 0 for r in b)
    for key in ("loss", "rewards/margins"):
        assert_metric_close(a, b, key, rel=1e-5, abs=1e-6, what=layout)
    # the estimate is a mean of differences of sequence log-probabilities some 30 in size, each summed in fp32 on
    # rows of another length on each layout: 1e-5 absolute is their rounding (Qwen2-VL DDP: 2.9e-6 off at 0.0143)
    assert_metric_close(a, b, "kl", rel=1e-5, abs=1e-5 if layout.startswith("qwen") else 1e-6, what=layout)


@pytest.mark.parametrize("kind, padding_free", [("qwen2_vl", True), ("qwen2_vl", False), ("gemma3", False),
                                                ("mllama", False)])
def test_kto_sequences_score_as_each_alone(zoo, images, kind, padding_free):
    """KTO's KL sequences on a model with multi-axis positions (Qwen2-VL's M-RoPE), whose image tokens attend both
    ways (Gemma 3's token_type_ids) or whose text cross-attends to its images (Mllama's cross_attention_mask): each
    one (its example's prompt and images, the previous example's completion) scores the log-probability transformers
    gives it alone, within 1e-5 (fp32), end to end (Qwen2-VL: its positions laid out per sequence) and padded (the
    model's own positions or mask, from the KL rows' own ids: here one is wider than every example, 48 tokens to 47
    on Qwen2-VL, 50 to 49 on Gemma 3). Mllama's alone: the processor's mask of its example's prompt, the last prompt
    token's carried over the other completion, as `generate` carries it."""
    from transformers import AutoModelForImageTextToText

    from toolkit.data.image_rows import MediaCollate, open_image
    from toolkit.model.attention import register
    from toolkit.model.vision import lay_out_positions
    from toolkit.objectives.logps import sequence_logps, whole_row_logps
    from toolkit.objectives.preference.functions import kl_batch

    path = zoo[kind]
    processor, data = prepared(["--model", str(path), "--dataset", str(images / "unpaired.jsonl"), "--objective",
                                "kto", "--seq-len", "256"])
    # four examples, a KL sequence wider than each of them (a row the examples' per-token inputs do not span)
    rows = [data.train[i] for i in ((0, 6, 12, 18) if kind == "qwen2_vl" else (0, 5, 11, 17))]
    assert max(len(r["kl_input_ids"]) for r in rows) > max(len(r["input_ids"]) for r in rows)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    if padding_free:
        model.set_attn_implementation({"text_config": register("varlen")})
    assert lay_out_positions(model) == (kind == "qwen2_vl")
    batch = MediaCollate(processor, processor.tokenizer.pad_token_id, padding_free, padding_free)(rows)
    assert ("kl_media:token_type_ids" in batch) == (kind == "gemma3")
    assert ("kl_media:cross_attention_mask" in batch) == (kind == "mllama")
    got = whole_row_logps(model, {**kl_batch(batch), **({"documents": len(rows)} if padding_free else {})})
    want = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["kl_input_ids"]])
            if kind == "mllama":
                enc = processor(text=[r["text"]], images=[[open_image(x) for x in r["images"]]],
                                add_special_tokens=False, return_tensors="pt")
                assert enc["input_ids"][0].tolist() == r["input_ids"]
                # the prompt the example and its KL sequence share, then the other completion
                shared = next(i for i, (a, b) in enumerate(zip(r["input_ids"], r["kl_input_ids"])) if a != b)
                mask = enc["cross_attention_mask"][:, :shared]
                mask = torch.cat([mask, mask[:, -1:].expand(-1, ids.shape[1] - shared, -1, -1)], 1)
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), cross_attention_mask=mask,
                               **{k: enc[k] for k in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")}).logits
                want.append(float(sequence_logps(logits, torch.tensor([r["kl_labels"]]))[0][0]))
                continue
            pixels = processor.image_processor(images=[open_image(x) for x in r["images"]], return_tensors="pt")
            types = torch.tensor(processor.create_mm_token_type_ids(ids.tolist()))
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **pixels,
                           **{"mm_token_type_ids" if kind == "qwen2_vl" else "token_type_ids": types}).logits
            want.append(float(sequence_logps(logits, torch.tensor([r["kl_labels"]]))[0][0]))
    assert got.tolist() == pytest.approx(want, rel=1e-5)


def test_orpo_and_simpo_train_on_image_pairs(runs):
    """ORPO (its NLL on the chosen sequences' text tokens) and SimPO train on image pairs, and DPO on PaliGemma (each
    side's prompt its bidirectional prefix, its completion the causal suffix): losses fall, the folder reloads to
    the trained loss; DPO's step 1 is ln 2 (the policy is the reference)."""
    for name in ("orpo", "simpo", "paligemma_dpo"):
        got = losses(runs[name])
        assert len(got) == 5 and got[-1] < got[0], (name, got)
        assert json.loads((runs[name] / "integrity.json").read_text())["ok"]
    assert losses(runs["paligemma_dpo"])[0] == pytest.approx(math.log(2), abs=1e-6)
    assert records(runs["paligemma_dpo"], "loss")[0]["causal_check_gap"] == 0


def test_dpo_on_image_pairs_learns_to_rank_by_the_picture(runs):
    """After LEARN_STEPS steps of DPO the policy ranks (nearly) every held-out pair right: images 16-23 it never saw,
    each color chosen over both others, where a model blind to the image ranks at most 9 of the 16 right (the larger
    side of each two colors' pairs)."""
    (record,) = [r for r in records(runs["dpo_learns"], "eval_loss")]
    assert record["step"] == LEARN_STEPS
    assert record["eval_rewards/accuracies"] >= 15 / 16 and record["eval_loss"] < 0.5 * math.log(2), record


def test_the_saved_folder_loads_in_plain_transformers_and_peft(runs, llava, images):
    """final/ holds the processor; AutoProcessor + AutoModelForImageTextToText (+ PeftModel on the base) load it, and
    its forward on an image example gives the loss the run's integrity check reloaded (itself equal to the trained
    model's)."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from toolkit.data.image_rows import MediaCollate
    from toolkit.data.packing import model_inputs

    _, data = prepared(["--model", str(llava), "--dataset", str(images / "chat.jsonl"), "--seq-len", "64"])
    for name in ("lora", "full", "zero3", "fsdp", "lora_projector"):
        final = runs[name] / "final"
        check = json.loads((runs[name] / "integrity.json").read_text())
        assert check["ok"] and check["relative_diff"] < 1e-5, name
        processor = AutoProcessor.from_pretrained(final)
        if (final / "adapter_config.json").is_file():
            model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(llava), final)
        else:
            model = AutoModelForImageTextToText.from_pretrained(final)
        batch = MediaCollate(processor, processor.tokenizer.pad_token_id)(list(data.train[:3]))
        with torch.no_grad():
            loss = model(**model_inputs(batch), labels=batch["labels"]).loss
        assert torch.isfinite(loss), name
        ids = model.generate(**model_inputs(batch), max_new_tokens=2, do_sample=False)
        assert ids.shape[1] == batch["input_ids"].shape[1] + 2


@pytest.mark.parametrize("kind", ZOO)
def test_more_image_text_architectures_train_with_lora_and_full(runs, zoo, kind):
    """Each trains through finetune.py as LLaVA does (the pipeline names no architecture): its losses fall, its
    folder reloads to the trained loss in plain transformers/peft, a full finetune leaves its vision tower as it was."""
    for method in ("lora", "full"):
        run = runs[f"{kind}_{method}"]
        got = losses(run)
        assert len(got) == 5 and got[-1] < got[0], (method, got)
        assert json.loads((run / "integrity.json").read_text())["ok"]
        # the text stays causal with the processor's inputs (`toolkit.train.loss_check.check_causal`)
        assert records(run, "loss")[0]["causal_check_gap"] == 0
    base, full = tensors(zoo[kind] / "model.safetensors"), tensors(runs[f"{kind}_full"] / "final" / "model.safetensors")
    # the checkpoints' own names
    tower, language = {"idefics3": ("vision_model", "text_model"), "gemma3": ("vision_tower", "language_model"),
                       "mllama": ("vision_model", "language_model"), "paligemma": ("vision_tower", "language_model"),
                       "qwen2_vl": ("visual", "layers"),
                       "qwen2_5_vl": ("visual", "layers"), "qwen3_vl": ("visual", "language_model")}[kind]
    assert base.keys() == full.keys()
    frozen = [k for k in base if k.split(".")[:2].count(tower)]
    assert frozen and all(torch.equal(base[k], full[k]) for k in frozen)
    assert any(not torch.equal(base[k], full[k]) for k in base if k.split(".")[:2].count(language))


def test_a_model_whose_text_sees_later_tokens_is_one_line_before_step_1(zoo, images, tmp_path, capsys,
                                                                         monkeypatch):
    """PaliGemma's processor gives token_type_ids of 0 (its bidirectional prefix) on the whole row unless the text
    comes as prefix and `suffix` (`toolkit.data.image_rows.prefix_suffix`, which the toolkit does): without the
    split a token would see the answer it is trained to predict. Before step 1 the run changes the first row's last
    target token and finds the earlier positions moved: one line, exit 2, no step. (Every image run passes the same
    check: its gap, 0, is in each run's metrics.)"""
    import finetune

    monkeypatch.setattr("toolkit.data.image_rows.prefix_suffix",
                        lambda processor, text, start, where="", images=1: {"text": text})
    model = zoo["paligemma"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        finetune.main(["--model", str(model), "--dataset", str(images / "chat.jsonl"), "--output-dir",
                       str(tmp_path / "out"), "--max-steps", "2", "--verify", "none"])
    said = capsys.readouterr()
    # the progress bar's lines besides
    lines = [line for line in said.err.splitlines() if "error" in line]
    assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in said.err, said.err
    assert lines[0].startswith("finetune.py: error: model type paligemma: with the inputs its processor gives "
                               "(token_type_ids: True), a token sees later ones")
    assert not (tmp_path / "out" / "checkpoint-1").exists()


def test_generate_answers_a_prompt_about_an_image(runs, images, capsys):
    """`python -m toolkit generate --image` on final/ (an adapter and a full model): one line, the greedy
    completion of the prompt after the image, as plain transformers gives it from the saved processor and model."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from toolkit.cli.main import main as cli
    from toolkit.data.images import open_image

    image = str(images / "images" / "0.png")
    for name in ("lora", "full"):
        final = runs[name] / "final"
        cli(["generate", "--model", str(final), "--prompt", "What color is it?", "--image", image,
             "--max-new-tokens", "3"])
        got = capsys.readouterr().out.strip().splitlines()
        processor = AutoProcessor.from_pretrained(final)
        model = AutoModelForImageTextToText.from_pretrained(
            json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
            if name == "lora" else final)
        model = PeftModel.from_pretrained(model, final) if name == "lora" else model
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is it?"}]}]
        enc = processor(text=[processor.apply_chat_template(messages, add_generation_prompt=True)],
                        images=[[open_image(image)]], add_special_tokens=False, return_tensors="pt")
        ids = model.eval().generate(**enc, max_new_tokens=3, do_sample=False)
        want = processor.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)[0].strip()
        assert got == [want], name


def tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_what_trains_on_the_vision_side(runs, llava):
    """A full finetune leaves the vision tower as it was and trains the projector and the language model; LoRA
    adapts the language model's linears only, and --train-vision projector saves the projector whole beside them."""
    base, full = tensors(llava / "model.safetensors"), tensors(runs["full"] / "final" / "model.safetensors")
    changed = {k for k in base if not torch.equal(base[k], full[k])}
    assert not any("vision_tower" in k for k in changed)
    assert any("multi_modal_projector" in k for k in changed) and any("language_model" in k for k in changed)
    lora = tensors(runs["lora"] / "final" / "adapter_model.safetensors")
    assert lora and all(".language_model." in k and "lora_" in k for k in lora)
    extra = tensors(runs["lora_projector"] / "final" / "adapter_model.safetensors")
    assert {k for k in extra if "lora_" not in k} and all(
        "multi_modal_projector" in k for k in extra if "lora_" not in k)
    assert records(runs["lora"], "loss")[-1]["loss"] < records(runs["lora"], "loss")[0]["loss"]


def test_the_quickstart_learns_to_read_the_pictures(tmp_path):
    """configs/vlm_quickstart.yaml as the README runs it, shortened to 150 of its 300 steps, in a fresh toolkit cache:
    the built-in model and pictures are built there, and the held-out exact match rises from 0 (the random model
    answers no word) to at least 40/64 (54/64 measured, seed 1; 64/64 after the 300 steps on seeds 1, 2 and 3)."""
    import re

    root = Path(__file__).resolve().parents[1]
    p = launch(["--config", str(root / "configs" / "vlm_quickstart.yaml"), "--max-steps", "150", "--eval-every", "0",
                "--output-dir", str(tmp_path / "out")], env={"TOOLKIT_CACHE": str(tmp_path / "cache")},
               launcher="python", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    before, after = map(int, re.search(r"before (\d+)/64 .* after (\d+)/64", p.stdout).groups())
    assert before == 0 and after >= 40, p.stdout[-2000:]
    assert (tmp_path / "cache" / "models" / "tiny-llava-v1" / "config.json").is_file()


def test_qlora_quantizes_the_language_model_only(runs, llava, images):
    """QLoRA: the language model's linears in NF4, the vision tower, the projector and the output head as they were;
    the run trains and its adapter reloads in plain transformers/peft (with the same skip list) to the trained loss."""
    import bitsandbytes as bnb

    from toolkit.cli.startup import settle
    from toolkit.model.load import load_model

    cfg = settle(["--model", str(llava), "--dataset", str(images / "chat.jsonl"), "--method", "qlora"])
    model = load_model(cfg, str(llava))
    kinds = {name: type(m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert all(k is bnb.nn.Linear4bit for n, k in kinds.items() if ".language_model." in n)
    assert all(k is torch.nn.Linear for n, k in kinds.items() if ".language_model." not in n)
    assert any(".vision_tower." in n for n in kinds) and any("multi_modal_projector" in n for n in kinds)
    got = losses(runs["qlora"])
    assert len(got) == 5 and got[-1] < got[0]
    assert json.loads((runs["qlora"] / "integrity.json").read_text())["ok"]


def bad(tmp_path: Path, llava: Path, images: Path, case: str) -> tuple[list[str], str]:
    rows = [json.loads(line) for line in (images / "chat.jsonl").read_text().splitlines()]
    # beside the images: their paths are relative to it
    data = images / f"{case}.jsonl"
    if case == "missing_image":
        rows[3] = chat_record("images/nope.png", "red")
        expect = "missing_image.jsonl: record 4 (line 4): image images/nope.png not found"
    elif case == "unreadable_image":
        (tmp_path / "broken.png").write_bytes(b"not a png")
        rows[2] = chat_record(str(tmp_path / "broken.png"), "red")
        expect = "unreadable_image.jsonl: record 3 (line 3): an image could not be read"
    elif case == "placeholders_and_images_differ":
        rows = [{"conversations": [{"from": "human", "value": "<image><image>What?"}, {"from": "gpt", "value": "red"}],
                 "images": [str(images / "images" / "0.png")]}]
        expect = "record 1 (line 1): has 2 <image> placeholders but 1 image in 'images'"
    elif case == "images_for_a_text_model":
        from toolkit.model.synthetic import build_model_dir

        data = images / "chat.jsonl"
        return (["--model", str(build_model_dir(tmp_path / "text-model")), "--dataset", str(data)],
                "chat.jsonl holds images, but --model")
    elif case == "processor_needs_torchvision":
        return (["--model", str(lfm2_vl_without_torchvision(tmp_path / "lfm2-vl")), "--dataset",
                 str(images / "chat.jsonl")], "its processor needs torchvision (`pip install torchvision`")
    elif case == "packing_on_gemma3":
        return (["--model", str(build_vlm_dir(tmp_path / "gemma3", "gemma3")), "--dataset", str(images / "chat.jsonl"),
                 "--packing"],
                "--packing: Gemma3ForConditionalGeneration: its image tokens attend both ways (token_type_ids), which "
                "a row of examples laid end to end does not keep apart")
    elif case == "kto_on_paligemma":
        paligemma = build_vlm_dir(tmp_path / "paligemma", "paligemma")
        return (["--model", str(paligemma), "--dataset", str(images / "unpaired.jsonl"), "--objective", "kto"],
                "--objective kto: PaliGemmaProcessor's token_type_ids are not each token's modality (they mark a "
                "prefix the model attends to both ways, as PaliGemma's do), which its KL sequences do not lay out")
    elif case == "grpo_on_paligemma":
        # PaliGemma's token_type_ids mark a prefix, not the image tokens (told from what its processor gives, once
        # the prompts are read)
        return (["--model", str(build_vlm_dir(tmp_path / "paligemma", "paligemma")), "--dataset",
                 str(images / "prompts.jsonl"), "--objective", "grpo", "--reward", f"{images / 'reward.py'}:initial",
                 "--num-generations", "4", "--micro-batch-size", "4"],
                "--objective grpo: PaliGemmaProcessor's token_type_ids are not each token's modality (they mark a "
                "prefix")
    elif case == "pixels_on_a_fixed_size_processor":
        return (["--model", str(llava), "--dataset", str(images / "chat.jsonl"), "--image-max-pixels", "1000"],
                "--image-max-pixels: CLIPImageProcessorPil takes no max_pixels (it resizes by its own settings")
    elif case == "paligemma_without_an_image":
        paligemma = build_vlm_dir(tmp_path / "paligemma", "paligemma")
        return (["--model", str(paligemma), "--dataset", str(images / "mixed.jsonl")],
                "record 6 (line 6): PaliGemmaProcessor takes an example's images before its prompt")
    elif case == "vision_tower_inside_the_language_model":
        return (["--model", str(class_dir(tmp_path / "git", "git")), "--dataset", str(images / "chat.jsonl")],
                "GitForCausalLM: its language model (git) holds its vision tower (git.image_encoder), so its language "
                "side cannot train alone")
    elif case == "no_vision_tower_of_its_own":
        return (["--model", str(class_dir(tmp_path / "fuyu", "fuyu")), "--dataset", str(images / "chat.jsonl")],
                "model type fuyu reads images without a vision tower of its own (no vision_config in its "
                "config.json), which the toolkit does not train on images yet; pass --images off")
    elif case == "image_beyond_the_bounds_with_resizing_off":
        qwen = build_vlm_dir(tmp_path / "qwen2-vl", "qwen2_vl")
        config = qwen / "preprocessor_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "do_resize": False}))
        from PIL import Image

        Image.new("RGB", (280, 140), (200, 30, 30)).save(tmp_path / "wide.png")
        # one image the processor takes as given (sides of whole merged patches), one beyond its bounds
        Image.new("RGB", (56, 56), (30, 30, 200)).save(tmp_path / "small.png")
        rows = [chat_record(str(tmp_path / "small.png"), "blue"), chat_record(str(tmp_path / "wide.png"), "red")]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return (["--model", str(qwen), "--dataset", str(data)],
                f"record 2 (line 2): image {tmp_path / 'wide.png'} (280x140) is beyond the bounds "
                "Qwen2VLImageProcessorPil resizes to, and its do_resize is false: as given it makes 235200 pixel "
                "values, 47040 once resized")
    elif case == "pipeline":
        return (["--model", str(llava), "--dataset", str(images / "chat.jsonl"), "--pp", "2"],
                "--pp 2: not yet for image-text models (LlavaConfig); their layouts are data-parallel (DDP, "
                "--zero-stage 1/2/3, --fsdp) and --tp")
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["--model", str(llava), "--dataset", str(data)], expect


@pytest.mark.parametrize("case", ["missing_image", "unreadable_image", "placeholders_and_images_differ",
                                  "images_for_a_text_model", "pipeline",
                                  "processor_needs_torchvision", "grpo_on_paligemma",
                                  "kto_on_paligemma", "packing_on_gemma3", "pixels_on_a_fixed_size_processor",
                                  "paligemma_without_an_image", "vision_tower_inside_the_language_model",
                                  "no_vision_tower_of_its_own", "image_beyond_the_bounds_with_resizing_off"])
def test_bad_image_input_is_one_line_before_the_model_loads(tmp_path, llava, images, capsys, case):
    import finetune
    from transformers.utils import is_torchvision_available

    if case == "processor_needs_torchvision" and is_torchvision_available():
        pytest.skip("torchvision is installed: LFM2-VL's processor loads")

    argv, expect = bad(tmp_path, llava, images, case)
    # what building a model printed
    capsys.readouterr()
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        finetune.main(argv + ["--output-dir", str(out)])
    said = capsys.readouterr()
    lines = [line for line in said.err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("finetune.py: error: "), said.err
    assert expect in lines[0] and "Traceback" not in said.err
    assert "model:" not in said.out and not out.exists()
