"""Image data: time to prepare a run's image rows, encoded (every image opened, the processor run on it) against
read back from the token cache, side by side in one process.

N chat records, each a drawn 448 px picture (a few shapes in colours drawn from its index) before a GSM8K question
(`../shared/data/gsm8k_train_alpaca.json` where present, else a fixed question), its answer after; a Qwen2-VL
processor with the published Qwen2.5-VL preprocessor's pixel bounds (min 3136, max 12845056: a 448 px picture is
256 image tokens) on the tests' small tokenizer. For each N: `prepare_data` with the cache emptied (cold: encoded by
--data-workers' default, the node's cores, and written), then again (warm: read back), then once more in one process
without a cache (the path before the cache and the forked encoders).

    python -m benchmarks.image_data                  # writes benchmarks/image_data.{json,md}
    python -m benchmarks.image_data --sizes 100 --out /tmp/image_data
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path

from benchmarks.common import BENCH, ROOT, md_table, write_pair
from benchmarks.gpu.gpu_user import drawn_picture

GSM8K = ROOT.parent / "shared" / "data" / "gsm8k_train_alpaca.json"
# the published Qwen2.5-VL-3B preprocessor's bounds
PIXELS = (3136, 12845056)
SIDE = 448


def write_records(n: int, folder: Path) -> Path:
    """`n` chat records with a drawn SIDE px picture each, as the GPU user part's image case draws them."""
    rows = json.loads(GSM8K.read_text()) if GSM8K.is_file() else \
        [{"instruction": "How many shapes are in the picture?", "output": "Six."}]
    (folder / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        r = rows[i % len(rows)]
        drawn_picture(i, SIDE).save(folder / "images" / f"{i}.png")
        records.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": f"images/{i}.png"},
                                         {"type": "text", "text": r["instruction"]}]},
            {"role": "assistant", "content": r["output"]}]})
    path = folder / "data.json"
    path.write_text(json.dumps(records))
    return path


def measure(n: int, work: Path) -> dict:
    from toolkit.cli.startup import resolve_images, settle
    from toolkit.data.prepare import prepare_data
    from toolkit.model.load import load_tokenizer
    from toolkit.model.synthetic import build_qwen_vl_dir
    from toolkit.model.vision import processor_for

    model = work / "qwen2-vl"
    if not model.is_dir():
        build_qwen_vl_dir(model, pixels=PIXELS)
    data = write_records(n, work / f"data-{n}")
    cfg = resolve_images(settle(["--model", str(model), "--dataset", str(data), "--seq-len", "2048"]), str(model))
    tokenizer = load_tokenizer(str(model))
    processor = processor_for(str(model), tokenizer, pixels=(cfg.data.image_min_pixels, cfg.data.image_max_pixels))
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    out = {"examples": n}

    def prepare(where):
        if where is None:
            from toolkit.data.image_prepare import prepare_images

            # one process, every run: the path before the cache and the forked encoders
            prepared = prepare_images(cfg.replace(data_workers=1).data_settings, processor)
            return prepared, prepared[3].tokens
        prepared = prepare_data(cfg.data_settings, tokenizer, cache=where, processor=processor)
        return prepared, prepared.stats.tokens

    for arm, where in (("cold", cache), ("warm", cache), ("uncached", None)):
        t = time.perf_counter()
        prepared, tokens = prepare(where)
        out[f"{arm}_s"] = time.perf_counter() - t
        assert where is None or prepared.stats.cached == (arm == "warm"), arm
        del prepared
    # apart (tracemalloc slows what it traces): what the prepared rows hold on the Python heap, a memory-mapped
    # table's pages not on it
    for arm, where in (("warm", cache), ("uncached", None)):
        gc.collect()
        tracemalloc.start()
        prepared, _ = prepare(where)
        out[f"{arm}_held_mib"] = tracemalloc.get_traced_memory()[0] / 2**20
        tracemalloc.stop()
        del prepared
    out["tokens_per_example"] = tokens / n
    out["warm_speedup"] = out["uncached_s"] / out["warm_s"]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="300,3000")
    p.add_argument("--out", default=str(BENCH / "image_data"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure(int(n), Path(tmp)) for n in args.sizes.split(",")]
    rows = [(f"{r['examples']:,}", f"{r['tokens_per_example']:.0f}", f"{r['uncached_s']:.2f}",
             f"{1000 * r['uncached_s'] / r['examples']:.2f}", f"{r['cold_s']:.2f}",
             f"{r['uncached_s'] / r['cold_s']:.1f}x", f"{r['warm_s']:.3f}", f"{1000 * r['warm_s'] / r['examples']:.3f}",
             f"{r['warm_speedup']:.0f}x", f"{r['uncached_held_mib']:.1f}", f"{r['warm_held_mib']:.1f}")
            for r in results]
    lines = ["# Image data: encoded every run against read back from the token cache", "",
             f"`python -m benchmarks.image_data` on {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores; {SIDE} px drawn pictures, a Qwen2-VL processor at the published "
             "Qwen2.5-VL bounds. uncached: every image opened and the processor run on it in one process (the path "
             "before the cache); cold: the same in forked processes (the node's cores), written to the cache; warm: "
             "read back, memory-mapped. Rows on the heap: what "
             "`tracemalloc` counts still allocated once the data is prepared. Timings are one run each, as noisy as "
             "the machine.", "",
             *md_table(["examples", "tokens/example", "uncached (s)", "uncached (ms/example)", "cold (s)",
                        "uncached / cold", "warm (s)", "warm (ms/example)", "uncached / warm",
                        "uncached rows on the heap (MiB)", "warm rows on the heap (MiB)"], rows)]
    write_pair(args.out, {"results": results, "pixels": PIXELS, "side": SIDE}, lines)


if __name__ == "__main__":
    main()
