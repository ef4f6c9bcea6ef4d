"""``train.compile``: the blocks compiled per block train like the eager model, with no graph break inside a block
and no recompilation across steps, micro-batches and validation; a failed compile falls back to eager.

The fast tests compile through ``aot_eager`` (dynamo and AOTAutograd trace exactly the graphs inductor would get,
forward and backward, fake kernels included, and run them with eager kernels): inductor's own code generation costs
over a minute per block kind on two cores, so the inductor variant is marked slow.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from conftest import MICRO_CONFIG
from zaya.config import load_config
from zaya.distributed.runtime import Runtime
from zaya.model import loss as loss_module
from zaya.train import compile as compile_module
from zaya.core.compile import CACHE_ENV, compile_wanted

STEPS = 3
# fp32 (an AMX machine's "auto" would be bf16); two micro-batches a step; no checkpoints: only the steps matter.
OVERRIDES = ["train.dtype=float32", "train.global_batch_tokens=256", "checkpoint.every=0", "train.eval_every=0",
             "train.sample_tokens=0"]


def _trainer(tmp_path, dataset, compile_choice: str):
    from zaya.train.trainer import Trainer

    cfg = tmp_path / "micro.toml"
    cfg.write_text(MICRO_CONFIG.format(dataset=dataset, run_dir=tmp_path / "run"))
    return Trainer.build(load_config(cfg, OVERRIDES + [f"train.compile={compile_choice}"]), Runtime(), resume="never")


def _losses(trainer, after_first_step=lambda: None) -> list[float]:
    """The losses of ``STEPS`` steps, with a validation after each; ``after_first_step`` runs once, after the
    first step and its validation (every graph of the run has been compiled by then)."""
    losses = []
    try:
        for step in range(STEPS):
            record = trainer.step()
            assert record["accumulation"] == 2
            losses.append(record["loss"])
            trainer.evaluate()
            if step == 0:
                after_first_step()
    finally:
        trainer.close()
    return losses


@pytest.fixture(autouse=True)
def _no_trace_capture(monkeypatch):
    """pytest's log capture attaches itself to every logger that does not propagate, torch's structured compile
    trace included, and then keeps every traced graph's dump: 190 s for this module instead of 30."""
    monkeypatch.setattr(logging.getLogger("torch.__trace"), "disabled", True)


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory, shakespeare_dataset):
    return _losses(_trainer(tmp_path_factory.mktemp("eager"), shakespeare_dataset, "off"))


def _compiled_run(tmp_path, dataset, monkeypatch, backend: str):
    """(losses, the counting backend, frames compiled after the first step) of a compiled run."""
    counter = CompileCounterWithBackend(backend)
    monkeypatch.setattr(compile_module, "BACKEND", counter)
    torch._dynamo.reset()
    counters.clear()
    trainer = _trainer(tmp_path, dataset, "on")
    assert trainer.compiled is not None and trainer.compiled.active
    warmed = {}
    losses = _losses(trainer, lambda: warmed.update(frames=counter.frame_count))
    return losses, counter, warmed["frames"]


def _check_compiled(losses, counter, warmed_frames, eager, rel):
    # Block 0 (no previous router latent) and block 1 (EDA) are two kinds, each traced for training (with
    # gradients, 4 x 32 tokens), validation and the routing probe (no gradients; 4 x 32 and 1 x 32 tokens): six
    # graphs; the loss two (training and validation; the probe has no labels): eight, compiled during the first
    # step and validation, none after.
    assert dict(counters["graph_break"]) == {}, counters["graph_break"]
    assert warmed_frames == counter.frame_count == 8, counter.frame_count
    assert losses == pytest.approx(eager, rel=rel)


def test_compiled_blocks_train_as_eager_without_breaks_or_recompiles(tmp_path, shakespeare_dataset, monkeypatch,
                                                                    eager_losses):
    losses, counter, warmed = _compiled_run(tmp_path, shakespeare_dataset, monkeypatch, "aot_eager")
    # The traced graphs run aten's decompositions of a few ops (silu's backward, the softmax), whose fp32 rounding
    # differs from the fused kernels' by ~1e-7 relative; three optimizer steps keep that far below 1e-5.
    _check_compiled(losses, counter, warmed, eager_losses, rel=1e-5)


@pytest.mark.slow
def test_inductor_compiled_blocks_train_as_eager(tmp_path, shakespeare_dataset, monkeypatch, eager_losses):
    losses, counter, warmed = _compiled_run(tmp_path, shakespeare_dataset, monkeypatch, "inductor")
    # Inductor fuses and reorders fp32 reductions (RMSNorm, softmax, the loss-side sums stay eager): ~1e-6
    # relative per step, compounded over three steps.
    _check_compiled(losses, counter, warmed, eager_losses, rel=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_loss_and_its_gradient_equal_the_chunked_eager_loss(monkeypatch, dtype):
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 16 * 256)  # the eager loss in 4 chunks of 16 rows
    torch._dynamo.reset()
    compiled = torch.compile(loss_module.fused_cross_entropy, backend="aot_eager", dynamic=False)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 32, 256, generator=generator) * 4).to(dtype).requires_grad_()
    labels = torch.randint(0, 256, (2, 32), generator=generator)
    labels[:, ::5] = loss_module.IGNORE_INDEX
    results = []
    for loss_fn in (loss_module.cross_entropy, compiled):
        loss = loss_fn(logits, labels)
        results.append((loss, torch.autograd.grad(loss, logits)[0]))
    (eager, eager_grad), (fused, fused_grad) = results
    # Both are fp32 throughout (the loss ~5.6, its gradient ~1e-4 down to ~1e-12 per element), summed in another
    # order: a few fp32 ulps. bf16 logits: both gradients are the fp32 value rounded once to bf16, so an element
    # can differ by one bf16 ulp (2^-8 to 2^-7 relative) where the two fp32 values straddle a rounding boundary.
    assert fused.dtype == eager.dtype == torch.float32 and fused_grad.dtype == dtype
    torch.testing.assert_close(fused, eager, rtol=1e-6, atol=0)
    torch.testing.assert_close(fused_grad, eager_grad, rtol=1e-5 if dtype == torch.float32 else 2**-7, atol=1e-12)


def test_a_failed_compile_warns_once_and_trains_eagerly(tmp_path, shakespeare_dataset, monkeypatch, eager_losses):
    def no_compiler(graph, example_inputs):
        raise RuntimeError("no working C++ compiler (forced by the test)")

    monkeypatch.setattr(compile_module, "BACKEND", no_compiler)
    torch._dynamo.reset()
    trainer = _trainer(tmp_path, shakespeare_dataset, "on")
    messages = []
    trainer.compiled.log = messages.append
    losses = _losses(trainer)
    warnings = [m for m in messages if m.startswith("warning: train.compile")]
    assert len(warnings) == 1 and "no working C++ compiler (forced by the test)" in warnings[0], messages
    assert not trainer.compiled.active
    assert losses == eager_losses  # the failed attempt changed nothing: the same steps, bit for bit


def test_compile_is_on_for_gpus_by_default_and_as_configured():
    assert compile_wanted("auto", torch.device("cuda", 0)) and not compile_wanted("auto", torch.device("cpu"))
    assert compile_wanted("on", torch.device("cpu")) and not compile_wanted("off", torch.device("cuda", 0))


def test_the_compile_benchmark_reports_both_steps(monkeypatch, capsys):
    """`benchmarks/compile.py` on its micro shape through aot_eager, in this process (its whole path; the timings
    mean nothing here)."""
    from bench_helpers import run_benchmark

    monkeypatch.setattr(compile_module, "BACKEND", compile_module.BACKEND)  # the script sets it
    monkeypatch.setenv(CACHE_ENV, "")  # the script sets it too
    machine, row, final = run_benchmark(monkeypatch, capsys, "compile.py", "--shapes", "micro", "--backend",
                                        "aot_eager", "--steps", "2", "--warmup", "0", "--threads", "1",
                                        "--quiet-below", "1", "--profile", "1", "--cpp-gemm")
    assert machine["machine"] and machine["threads"] == 1
    assert row["shape"] == "micro" and row["dtype"] == "fp32" and row["backend"] == "aot_eager", row
    assert len(row["eager_times_s"]) == len(row["compiled_times_s"]) == 2 and row["speedup"] > 0, row
    assert row["eager_cpu_s"] > 0 and row["compiled_cpu_s"] > 0 and row["cpu_speedup"] > 0, row
    # The ratio of the unrounded medians; the printed ones are rounded to 1e-4 s (steps of tens of ms here).
    assert abs(row["speedup"] - row["eager_step_s"] / row["compiled_step_s"]) <= 0.01 * row["speedup"], row
    assert row["max_loss_rel_diff"] < 1e-5, row  # the same steps (aot_eager: aten's decompositions' rounding)
    shares = row["shares"]  # the profiled step's parts: each there, together the whole
    assert set(shares) == {"compiled forward", "eager forward", "compiled backward", "eager backward", "clip",
                           "optimizer"} and shares["compiled forward"] > 0 and shares["compiled backward"] > 0, row
    assert abs(sum(shares.values()) - 1) < 0.01 and row["top_self"], row
    gemms = row["gemm_shares"]  # the micro shape's experts run through grouped_mm, its other projections through mm
    assert gemms["experts' grouped_mm"] > 0 and gemms["other GEMMs"] > 0, row
    # The third copy (its own compile through aot_eager here: no autotuning), timed in the same rounds.
    assert len(row["cpp_gemm_times_s"]) == 2 and row["cpp_gemm_cpu_s"] > 0 and row["cpp_gemm_autotuned"] == 0, row
    assert final == {"final": True, "speedups": {"micro/fp32": row["speedup"]}, "target": 1.3, "target_met": False}


def test_the_compile_benchmark_times_the_expert_and_head_gemms(monkeypatch, capsys):
    """`benchmarks/compile.py --gemms` on its micro shape: every expert product timed grouped and dense, the head's
    product in bf16 and computed in fp32 (the figures mean nothing here)."""
    from bench_helpers import run_benchmark

    monkeypatch.setenv(CACHE_ENV, "")  # the script sets it
    _, row = run_benchmark(monkeypatch, capsys, "compile.py", "--gemms", "--shapes", "micro", "--steps", "2",
                           "--threads", "1")
    products = row["experts_grouped_dense_ms"]
    assert set(products) == {f"{p} {part}" for p in ("up", "down") for part in ("forward", "input grad",
                                                                              "weight grad")}, row
    assert all(grouped > 0 and dense > 0 for grouped, dense in products.values()), row
    assert row["experts_layer_ms"][0] == round(sum(v[0] for v in products.values()), 1), row
    assert row["head_bf16_ms"] > 0 and row["head_bf16_in_fp32_ms"] > 0, row
