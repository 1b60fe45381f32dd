"""A quiet console: a default run prints the toolkit's own lines and the progress bar, nothing else."""

from __future__ import annotations

import io
import re
import warnings

from distributed import launch

from toolkit import console

NOISE = ["[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU. If you have GPU or other "
         "accelerator, we were unable to detect it.",
         "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
         "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'."]


def test_line_filter_drops_library_lines_and_keeps_the_rest():
    out = io.StringIO()
    f = console.LineFilter(out)
    for line in NOISE:  # print() writes the text, then the newline on its own
        f.write(line)
        f.write("\n")
    f.write("model: tiny (156.0K params)")
    f.write("\n")
    f.write("\rtrain:  50%|#####     | 1/2")  # a progress-bar update is kept whole
    assert out.getvalue() == "model: tiny (156.0K params)\n\rtrain:  50%|#####     | 1/2"


def test_quiet_ignores_the_listed_warnings_and_debug_keeps_them(monkeypatch):
    monkeypatch.setenv("TOOLKIT_DEBUG", "1")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        console.quiet()  # --debug: installs nothing
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
    assert len(seen) == 1
    monkeypatch.delenv("TOOLKIT_DEBUG")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        console.quiet()
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning)
        warnings.warn("something the user can act on", UserWarning)
    assert [str(w.message) for w in seen] == ["something the user can act on"]


def test_default_run_prints_only_the_toolkits_lines_and_the_bar(tmp_path, tiny_model, data_files):
    """A default LoRA run on the tiny model as a user starts it: stderr is the progress bar, stdout
    the toolkit's own lines (each starts with one of its prefixes)."""
    out = tmp_path / "out"
    p = launch(["--model", str(tiny_model), "--dataset", str(data_files["alpaca"]), "--output-dir", str(out),
                "--max-steps", "3"], launcher="python")
    assert p.returncode == 0, p.stderr[-3000:]
    bar = [seg for seg in re.split(r"[\r\n]", p.stderr) if seg.strip()]
    assert bar and all(seg.startswith("train:") for seg in bar), p.stderr
    prefixes = ("data:", "model:", "learning rate:", "layout:", "loss:", "training:", "loss check:", "compile:",
                "batches:", "integrity:", "done:")
    assert all(line.startswith(prefixes) for line in p.stdout.splitlines() if line.strip()), p.stdout
    for text in NOISE:
        assert text.split(":")[0] not in p.stdout + p.stderr
