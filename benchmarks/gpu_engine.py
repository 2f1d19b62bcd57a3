"""Device check for the engine on a GPU: greedy correctness with and without CUDA graphs, then
decode and serving timings of a Llama-3-8B-shaped model with random weights (load_format=dummy).

    python benchmarks/gpu_engine.py correctness            # tiny random Llama vs transformers (~30 s)
    python benchmarks/gpu_engine.py timing --dtype bf16    # Llama-3-8B shapes (~1.5 min on an H200, estimated)
    python benchmarks/gpu_engine.py timing --dtype fp8
    python benchmarks/gpu_engine.py PART --dry-run         # CPU: tiny shapes, torch backend, no graphs

correctness: fp32 greedy tokens equal transformers' (near-tie rule) and are identical with CUDA
graphs on and off; bf16 graphs on against off under the near-tie rule; torch._scaled_mm's FP8
product against its dequantized reference; an fp8 model generates through its graphs.
timing: batch-1 decode tokens/s against the HBM roofline (bytes of weights read per step /
4.8 TB/s); output tokens/s and TTFT for one wave of C requests submitted together (C = 1, 16, 64,
256; 512 random prompt tokens, 128 output tokens, eos ignored), CUDA graphs on and off, through
the offline LLMEngine. "Graphs off" is the same engine with its graph runner set aside.

Writes $OUT/gpu_engine_{correctness,bf16,fp8}.json (or --out) after every case; timing cases
still to run when --budget seconds have passed are skipped and listed. Exits 1 when a
correctness case fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HBM_BYTES_PER_S = 4.8e12  # H200
NEAR_TIE = 1e-3

# Llama-3-8B's shapes (no weights: load_format="dummy")
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
    bos_token_id=1,
    eos_token_id=2,
)
TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.5,
    bos_token_id=1,
    eos_token_id=2,
)


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    name = args.part if args.part == "correctness" else args.dtype
    out = args.out or (Path(os.environ["OUT"]) / f"gpu_engine_{name}.json" if os.environ.get("OUT") else None)
    report = Report(out, args.budget)
    report.results.update(part=name, dry_run=args.dry_run, environment=environment())
    try:
        if args.part == "correctness":
            Correctness(report, args.dry_run).run()
        else:
            Timing(report, args.dry_run, args.dtype, args.concurrency, args.torch_layers).run()
    except Exception:  # a crash is a result too: save what there is, then fail the part
        report.results["crash"] = traceback.format_exc()
        print(report.results["crash"])
        report.save()
        return 1
    report.save()
    failed = [c["case"] for c in report.results.get("correctness", []) if not c["ok"]]
    print(f"FAILED: {failed}" if failed else f"{name}: done in {report.elapsed():.0f}s")
    return 1 if failed else 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("part", choices=("correctness", "timing"))
    parser.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="timing: bfloat16, or fp8 weights")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, torch backend, no CUDA graphs")
    parser.add_argument("--budget", type=float, default=1e9, help="seconds after which timing cases are skipped")
    parser.add_argument("--concurrency", type=int, nargs="+", default=(1, 16, 64, 256), help="timing: the waves' sizes")
    parser.add_argument(
        "--torch-layers",
        action="store_true",
        help="timing: the decoder's norms, activation, rotation and fp8 quantization as torch ops, not\n"
        "gpu_layers' kernels (their A/B)",
    )
    parser.add_argument(
        "--out", type=Path, help="JSON results path (default: $OUT/gpu_engine_<correctness|dtype>.json)"
    )
    return parser.parse_args()


class Report:
    def __init__(self, path: Path | None, budget_s: float):
        self.path, self.budget_s, self.started = path, budget_s, time.perf_counter()
        self.results: dict = {"skipped_for_time": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def in_time(self, case: str) -> bool:
        if self.elapsed() < self.budget_s:
            return True
        self.results["skipped_for_time"].append(case)
        print(f"skipped for time: {case}")
        return False

    def check(self, case: str, fn) -> None:
        """One correctness case; a crash counts as a failure and the next case still runs."""
        try:
            result = fn()
        except Exception as e:  # a device run is scarce: report every case
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        self.results.setdefault("correctness", []).append({"case": case, **result})
        detail = result.get("error") or result.get("detail", "")
        print(f"{'ok  ' if result['ok'] else 'FAIL'} {case}: {detail}")
        self.save()

    def save(self) -> None:
        self.results["elapsed_s"] = round(self.elapsed(), 1)
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.results, indent=1, default=str))


# ----------------------------------------------------------------------------------------------
# model directories: a config, a tokenizer covering the whole vocabulary, and (tiny) weights


def write_model_dir(out: Path, shapes: dict, with_weights: bool) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**shapes, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    write_tokenizer(out, shapes["vocab_size"])
    if with_weights:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token per id (no model files are needed on the device)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<0>", bos_token="<1>", eos_token="<2>")
    fast.save_pretrained(out)


def engine(model_dir: Path, dry_run: bool, **overrides):
    from pagoda.engine.args import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine

    settings = dict(model=str(model_dir), seed=0)
    settings.update(dict(device="cpu", attention_backend="torch", kv_cache_memory=0.05) if dry_run else {})
    settings.update(overrides)
    return LLMEngine(EngineArgs(**settings))


def run_wave(eng, prompts: list[list[int]], max_tokens: int) -> dict[str, object]:
    """All prompts submitted at once, stepped to the end: per-request tokens and times."""
    from pagoda.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.monotonic()
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished:
        for update in eng.step():
            if update.finished:
                done[update.request_id] = (update, time.monotonic())
    end = time.monotonic()
    return {"start": start, "end": end, "outputs": [done[i][0] for i in ids], "finished": [done[i][1] for i in ids]}


def kernel_table(fn, replays: int) -> list[str]:
    """The device's kernels over `replays` calls of fn (torch.profiler), the top 12 by total time
    per call: a line each, or the error where the profiler cannot trace them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                fn()
            torch.cuda.synchronize()
        totals: dict[str, list[float]] = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                entry = totals.setdefault(event.name[:90], [0.0, 0])
                entry[0] += event.time_range.elapsed_us() / replays
                entry[1] += 1
        rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
        return [f"{us:9.1f} us/call {n // replays:4d}x  {name}" for name, (us, n) in rows[:12]] + [
            f"{sum(v[0] for v in totals.values()):9.1f} us/call in all, {len(totals)} kernels"
        ]
    except Exception as e:  # a diagnostic: its failure is reported, not fatal
        return [f"{type(e).__name__}: {e}"]


class TritonCompiles:
    """The Triton kernel variants this process compiles (or loads from Triton's disk cache), as they
    happen: each a line of its kernel, the seconds it took and its non-pointer arguments' types
    (Triton compiles a variant per specialization: an integer argument equal to 1 or divisible by
    16 makes its own). A timing wave should find every variant it uses already in memory; one it
    compiles adds its compile time to the wave's TTFT, as it would to a fresh server's first
    requests."""

    def __init__(self):
        self.events: list[str] = []
        self._started: dict[str, float] = {}
        try:
            from triton import knobs
        except ImportError:  # no Triton: nothing compiles
            return
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, *, key, **_) -> bool:
        self._started[str(key)] = time.perf_counter()
        return False  # go on and compile

    def _after(self, *, key, fn, compile, **_) -> None:
        seconds = time.perf_counter() - self._started.pop(str(key), time.perf_counter())
        try:
            self.events.append(f"{fn.name} {seconds:.2f}s ({self._specialization(fn, compile)})")
        except Exception as e:  # another Triton's hook arguments: the compile is still logged, not the launch failed
            self.events.append(f"{getattr(fn, 'name', fn)} {seconds:.2f}s (unread: {type(e).__name__}: {e})")

    @staticmethod
    def _specialization(fn, compile: dict) -> str:
        params = fn.jit_function.params
        constants = {path[0]: value for path, value in compile["constants"].items() if len(path) == 1}
        divisible = {
            path[0]
            for path, attrs in compile["configs"][0].items()
            if any(list(attr) == ["tt.divisibility", 16] for attr in attrs)
        }
        shown = []  # the constexprs, and the integers specialized (equal to 1, divisible by 16)
        for i, param in enumerate(params):
            if param.is_constexpr or (i in constants and constants[i] == 1):
                shown.append(f"{param.name}={constants.get(i)}")
            elif i in divisible and not str(compile["signature"][param.name]).startswith("*"):
                shown.append(f"{param.name}%16")
        return ", ".join(shown)


def graphs_off(eng):
    """A context in which the engine runs every step eagerly (its graph runner set aside)."""
    import contextlib

    @contextlib.contextmanager
    def off():
        runner = eng.core.runner
        saved, runner.cuda_graphs = runner.cuda_graphs, None
        try:
            yield
        finally:
            runner.cuda_graphs = saved

    return off()


# ----------------------------------------------------------------------------------------------
# correctness


class Correctness:
    def __init__(self, report: Report, dry_run: bool):
        import torch

        self.torch, self.report, self.dry_run = torch, report, dry_run
        self.device = "cpu" if dry_run else "cuda"
        if not dry_run and not torch.cuda.is_available():
            raise SystemExit("no CUDA device; use --dry-run for the CPU path")
        self.dir = write_model_dir(Path(tempfile.mkdtemp(prefix="pagoda-tiny-")), TINY, with_weights=True)
        rng = random.Random(0)
        lengths = (5, 17, 33, 64, 9, 120, 3)  # 7 decodes: bucket 8 with a padded lane, shrinking as they finish
        self.prompts = [[rng.randrange(3, TINY["vocab_size"]) for _ in range(n)] for n in lengths]
        self.max_tokens = 24 if dry_run else 48

    def run(self) -> None:
        from transformers import AutoModelForCausalLM

        torch = self.torch
        self.hf = AutoModelForCausalLM.from_pretrained(self.dir, dtype=torch.float32).to(self.device).eval()
        self.expected = [self.hf_greedy(p) for p in self.prompts]
        fp32 = self.engine(dtype="float32")
        self.report.check(
            "fp32 vs transformers, graphs on" if not self.dry_run else "fp32 vs transformers (eager)",
            functools.partial(self.against_reference, fp32),
        )
        self.report.check("structured outputs: the bitmask on the device", self.bitmask_on_device)
        self.report.check("structured outputs: a regex holds", functools.partial(self.regex_holds, fp32))
        del fp32
        self.report.check("fp32 n-gram speculation vs transformers", self.speculative)
        if self.dry_run:
            return
        fp32 = self.engine(dtype="float32")
        # No local may keep a partial past the `del` below: it would keep the engine's GPU memory.
        self.report.check(
            "fp32 vs transformers, graphs off", functools.partial(self.against_reference, fp32, eager=True)
        )
        self.report.check("fp32 graphs on == graphs off", functools.partial(self.on_equals_off, fp32, exact=True))
        del fp32
        self.report.check("fused layer kernels vs torch's ops (bf16, fp16, fp8)", self.fused_layers)
        bf16 = self.engine(dtype="bfloat16")
        self.report.check(
            "bf16 graphs on vs off (near-tie rule)", functools.partial(self.on_equals_off, bf16, exact=False)
        )
        del bf16
        self.report.check("fp8 _scaled_mm vs dequantized reference", self.scaled_mm)
        self.report.check("fp8 model generates through its graphs", self.fp8_generates)

    def bitmask_on_device(self) -> dict:
        """xgrammar's kernel on the device masks exactly the tokens the CPU reference masks."""
        from pagoda.structured.grammar import TokenBitmask

        torch = self.torch
        vocab = TINY["vocab_size"]
        gen = torch.Generator().manual_seed(0)
        bits = torch.randint(-(2**31), 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
        logits = torch.randn(4, vocab, generator=gen)
        masked = {}
        for device in {"cpu", str(self.device)}:
            rows = logits.to(device)
            TokenBitmask(bits, [0, 2, 3], vocab).apply(rows)
            masked[device] = torch.isinf(rows).cpu()
        allowed = (bits[:, :, None] >> torch.arange(32)).flatten(1)[:, :vocab] & 1 == 1
        want = ~allowed
        want[1] = False  # row 1 is not constrained
        ok = all(torch.equal(m, want) for m in masked.values())
        return {"ok": ok, "detail": f"{int(want.sum())} tokens masked on {sorted(masked)}"}

    def regex_holds(self, eng) -> dict:
        """Sampled tokens under a regex of the tiny vocabulary's words stay inside it."""
        from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

        constraint = StructuredOutputsParams(regex="(<1[0-9]>)+")
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, structured_outputs=constraint)
        ids = [eng.add_request(p, params) for p in self.prompts]
        done = {}
        while eng.has_unfinished:
            done.update({u.request_id: u for u in eng.step() if u.finished})
        tokens = [t for i in ids for t in done[i].token_ids]
        ok = bool(tokens) and all(10 <= t <= 19 or t == TINY["eos_token_id"] for t in tokens)
        return {"ok": ok, "detail": f"{len(tokens)} tokens, all in <10>..<19> or eos: {ok}"}

    def engine(self, **settings):
        """A tiny engine: buckets 1..16 (7 prompts replay bucket 8 with a padded lane); little memory.
        gpu_memory_utilization counts all of the process's allocations, so each engine gets 0.3 of
        the GPU beyond what earlier engines still hold; what they still hold is printed."""
        gpu = {}
        if not self.dry_run:
            import gc

            torch = self.torch
            gc.collect()
            torch.cuda.empty_cache()
            held = torch.cuda.memory_allocated() / torch.cuda.get_device_properties(0).total_memory
            print(f"GPU memory still allocated before a new engine: {held:.1%} of the device")
            gpu = {"gpu_memory_utilization": min(0.3 + held, 0.95)}
        return engine(self.dir, self.dry_run, max_model_len=1024, max_num_seqs=16, **gpu, **settings)

    def generate(self, eng, eager: bool = False) -> list[list[int]]:
        import contextlib

        with graphs_off(eng) if eager else contextlib.nullcontext():
            wave = run_wave(eng, self.prompts, self.max_tokens)
        return [o.token_ids for o in wave["outputs"]]

    def hf_greedy(self, prompt: list[int]) -> list[int]:
        """transformers' argmax, token by token over the whole sequence (tiny model: cheap), eos ignored."""
        torch = self.torch
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(self.max_tokens):
                ids.append(int(self.hf(torch.tensor([ids], device=self.device)).logits[0, -1].argmax()))
        return ids[len(prompt) :]

    def margin(self, ids: list[int]) -> float:
        torch = self.torch
        with torch.inference_mode():
            logits = self.hf(torch.tensor([ids], device=self.device)).logits[0, -1].float()
        top = logits.topk(2).values
        return float(top[0] - top[1])

    def compare(self, want: list[list[int]], got: list[list[int]]) -> dict:
        """Equal, or first diverging where the fp32 reference's top-2 margin is below NEAR_TIE."""
        ties, bad = [], []
        for k, (prompt, a, b) in enumerate(zip(self.prompts, want, got)):
            if a == b:
                continue
            i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            m = self.margin(prompt + a[:i])
            (ties if m < NEAR_TIE and len(a) == len(b) else bad).append({"prompt": k, "token": i, "margin": m})
        detail = f"{len(want) - len(ties) - len(bad)}/{len(want)} identical, {len(ties)} near-tie, {len(bad)} wrong"
        return {"ok": not bad, "detail": detail, "near_ties": ties, "wrong": bad}

    def against_reference(self, eng, eager: bool = False) -> dict:
        return self.compare(self.expected, self.generate(eng, eager))

    def on_equals_off(self, eng, exact: bool) -> dict:
        on, off = self.generate(eng), self.generate(eng, eager=True)
        result = self.compare(off, on)
        if exact:
            result["ok"] = on == off
        result["graphs"] = list(eng.core.runner.cuda_graphs.sizes)
        return result

    def fused_layers(self) -> dict:
        """gpu_layers' kernels against the torch ops they replace: the residual sum, the rotation
        and fp8's codes and scales bitwise; SiLU * up and the norm within two representable values,
        the elements that differ counted. (Triton's exp and the norm's sum order can move SiLU's or
        the normalized row's rounding by one value, which its product with up or the weight can
        make two; measured on an H200 at Llama-3-8B's widths: none in bfloat16, up to 0.02% of the
        elements in float16.)"""
        import torch.nn.functional as F

        from pagoda.model_executor import gpu_layers
        from pagoda.model_executor.layers import apply_rotary, rms_norm
        from pagoda.model_executor.quantization import quantize_per_token

        torch = self.torch
        gen = torch.Generator(device="cuda").manual_seed(0)

        def randn(*shape, dtype, scale=1.0):
            return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

        def ulps(got, want):  # differing elements, and the largest distance in representable values
            def ordered(t):  # 16-bit floats' bits as integers in the values' order
                bits = t.view(torch.int16).int()
                return torch.where(bits < 0, -(bits & 0x7FFF), bits)

            return int((got != want).sum()), int((ordered(got) - ordered(want)).abs().max())

        counts, ok = {}, True
        # (hidden, intermediate, query + kv heads, head_dim): Llama-3-8B's, and widths that are no
        # power of two with a rotation past one program's 16 heads
        for hidden, intermediate, heads, head_dim in ((4096, 14336, 40, 128), (5120, 13824, 72, 96)):
            for dtype in (torch.bfloat16, torch.float16):
                name = f"{str(dtype).removeprefix('torch.')} {hidden}"
                for rows in (1, 7, 300):
                    x, res = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype, scale=8)
                    w = randn(hidden, dtype=dtype)
                    normed, stream = gpu_layers.add_rms_norm(x, res, w, 1e-5)
                    norm_diff = ulps(normed, rms_norm(res + x, w, 1e-5))
                    gate_up = randn(rows, 2 * intermediate, dtype=dtype, scale=3)
                    gate, up = gate_up.chunk(2, dim=-1)
                    silu_diff = ulps(gpu_layers.silu_and_mul(gate_up), F.silu(gate) * up)
                    qkv = randn(rows, (heads + 8) * head_dim, dtype=dtype)
                    qk = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
                    positions = torch.randint(0, 8192, (rows,), generator=gen, device="cuda")
                    cos, sin = randn(8192, head_dim, dtype=dtype), randn(8192, head_dim, dtype=dtype)
                    rotated = gpu_layers.rotate(qk, positions, cos, sin)
                    want = apply_rotary(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
                    case = {
                        "sum_equal": bool(torch.equal(stream, res + x)),
                        "rotation_equal": bool(torch.equal(rotated, want)),
                        "norm_differing_elements_max_ulps": norm_diff,
                        "silu_mul_differing_elements_max_ulps": silu_diff,
                    }
                    counts[f"{name} x{rows}"] = case
                    ok &= case["sum_equal"] and case["rotation_equal"] and norm_diff[1] <= 2 and silu_diff[1] <= 2
        for rows in (1, 300):
            x = randn(rows, 14336, dtype=torch.bfloat16, scale=4)
            x[0, :7] = 0
            codes, scale = gpu_layers.quantize_per_token(x)
            want_codes, want_scale = quantize_per_token(x)
            same = bool(
                torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scale, want_scale)
            )
            counts[f"fp8 quantization x{rows}"] = {"codes_and_scales_equal": same}
            ok &= same
        differing = {
            k: (v.get("norm_differing_elements_max_ulps"), v.get("silu_mul_differing_elements_max_ulps"))
            for k, v in counts.items()
        }
        return {"ok": ok, "detail": f"(norm, silu*up) differing elements and max ulps: {differing}", "cases": counts}

    def scaled_mm(self) -> dict:
        from pagoda.model_executor.layers import Linear
        from pagoda.model_executor.quantization import Fp8Linear, fp8_linear_reference

        torch = self.torch
        errors = {}
        for tokens, n_in, n_out in ((1, 4096, 6144), (16, 4096, 28672), (256, 14336, 4096)):
            layer = Linear(n_in, n_out, False, torch.bfloat16, torch.device("cuda"))
            layer.weight.data.normal_(0, 0.02)
            fp8 = Fp8Linear(layer)
            x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16)
            y, ref = fp8(x).float(), fp8_linear_reference(x, fp8)
            errors[f"{tokens}x{n_in}x{n_out}"] = float((y - ref).norm() / ref.norm())
        worst = max(errors.values())
        return {
            "ok": worst < 1e-2,
            "detail": f"worst relative error {worst:.1e} (bf16 output rounding ~4e-3)",
            "errors": errors,
        }

    def speculative(self) -> dict:
        """Greedy tokens with n-gram speculation (unigram matches, so the tiny model's random text
        still gets drafts) equal transformers' under the near-tie rule: verification through the
        device's attention, rollback of rejected drafts."""
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
        eng = self.engine(dtype="float32", speculative_config=spec)
        result = self.against_reference(eng)
        counters = eng.core.scheduler.stats()
        result["detail"] += f"; {counters.spec_num_accepted_tokens}/{counters.spec_num_draft_tokens} drafts accepted"
        result["ok"] = result["ok"] and counters.spec_num_draft_tokens > 0
        return result

    def fp8_generates(self) -> dict:
        eng = self.engine(dtype="bfloat16", quantization="fp8")
        on, off = self.generate(eng), self.generate(eng, eager=True)
        full = all(len(t) == self.max_tokens for t in on)
        same = sum(a == b for a, b in zip(on, off))
        return {"ok": full, "detail": f"{same}/{len(on)} sequences identical with graphs on and off (informational)"}


# ----------------------------------------------------------------------------------------------
# timing


class Timing:
    def __init__(self, report: Report, dry_run: bool, dtype: str, concurrency=(1, 16, 64, 256), torch_layers=False):
        self.report, self.dry_run, self.dtype, self.torch_layers = report, dry_run, dtype, torch_layers
        self.shapes = TINY if dry_run else LLAMA3_8B
        self.concurrency = (1, 4) if dry_run else tuple(concurrency)
        self.prompt_len, self.max_tokens = (16, 4) if dry_run else (512, 128)
        self.rng = random.Random(1)

    def run(self) -> None:
        results = self.report.results
        results.update(
            model="tiny" if self.dry_run else "llama3-8b shapes (dummy weights)",
            dtype=self.dtype,
            prompt_tokens=self.prompt_len,
            output_tokens=self.max_tokens,
            layers="torch ops" if self.torch_layers else "gpu_layers kernels",
        )
        if self.torch_layers:  # the loader then leaves the model's small ops to torch
            from pagoda.model_executor import gpu_layers

            gpu_layers.supported = lambda dtype, device: False
        model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="pagoda-shapes-")), self.shapes, with_weights=False)
        settings = dict(
            load_format="dummy",
            max_model_len=2048 if not self.dry_run else 256,
            max_num_seqs=256,
            max_num_batched_tokens=8192 if not self.dry_run else 256,
            enable_prefix_caching=False,
        )
        if self.dry_run and self.dtype == "fp8":
            results["fp8"] = self.fp8_refused_on_cpu(model_dir, settings)
            return
        if not self.dry_run:
            settings.update(dtype="bfloat16", quantization="fp8" if self.dtype == "fp8" else None)
        compiles = TritonCompiles()
        start = time.perf_counter()
        eng = engine(model_dir, self.dry_run, **settings)
        results["engine"] = self.describe(eng, time.perf_counter() - start)
        results["engine"]["triton_compiles_at_startup"] = list(compiles.events)
        print(f"engine: {results['engine']}")
        self.report.save()
        modes = (True, False) if eng.core.runner.cuda_graphs is not None else (False,)
        compiled_before = len(compiles.events)
        for graphs in modes:  # a first request's lazy setup, before timing
            self.wave(eng, 2, graphs, max_tokens=4)
        results["triton_compiles_in_warm_up_waves"] = compiles.events[compiled_before:]  # none expected either
        for line in results["triton_compiles_in_warm_up_waves"]:
            print(f"  compiled during the warm-up waves: {line}")
        results["waves"] = []
        for concurrency in self.concurrency:
            for graphs in modes:
                case = f"concurrency {concurrency}, graphs {'on' if graphs else 'off'}"
                if not self.report.in_time(case):
                    continue
                compiled_before = len(compiles.events)
                row = self.wave(eng, concurrency, graphs)
                row["triton_compiles"] = compiles.events[compiled_before:]
                results["waves"].append(row)
                print(
                    f"{case}: {row['output_tokens_per_s']:.0f} output tok/s, TTFT mean {row['ttft_mean_ms']:.0f} ms, "
                    f"TPOT mean {row['tpot_mean_ms']:.2f} ms"
                )
                for line in row["triton_compiles"]:
                    print(f"  compiled during the wave: {line}")
                if concurrency == 1:
                    self.batch1(row, graphs)
                    if graphs or eng.core.runner.cuda_graphs is None:
                        results["batch1_anatomy"] = self.batch1_anatomy(eng)
                self.report.save()

    def wave(self, eng, concurrency: int, graphs: bool, max_tokens: int | None = None) -> dict:
        import contextlib

        max_tokens = max_tokens or self.max_tokens
        vocab = self.shapes["vocab_size"]
        prompts = [[self.rng.randrange(3, vocab) for _ in range(self.prompt_len)] for _ in range(concurrency)]
        with contextlib.nullcontext() if graphs else graphs_off(eng):
            w = run_wave(eng, prompts, max_tokens)
        outs = w["outputs"]
        assert all(len(o.token_ids) == max_tokens for o in outs)
        ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
        tpot = (
            [(t - o.metrics.first_token_time) / (max_tokens - 1) for o, t in zip(outs, w["finished"])]
            if max_tokens > 1
            else [0.0]
        )
        wall = w["end"] - w["start"]
        return {
            "concurrency": concurrency,
            "cuda_graphs": graphs,
            "wall_s": wall,
            "output_tokens_per_s": concurrency * max_tokens / wall,
            "ttft_mean_ms": 1e3 * sum(ttft) / len(ttft),
            "ttft_max_ms": 1e3 * max(ttft),
            "tpot_mean_ms": 1e3 * sum(tpot) / len(tpot),
        }

    def batch1(self, row: dict, graphs: bool) -> None:
        """Decode tokens/s of one sequence against the time to stream its weights from HBM once."""
        tokens_per_s = 1e3 / row["tpot_mean_ms"]
        roofline = HBM_BYTES_PER_S / self.report.results["engine"]["weight_bytes_read_per_token"]
        entry = {
            "decode_tokens_per_s": tokens_per_s,
            "roofline_tokens_per_s": roofline,
            "share_of_roofline": tokens_per_s / roofline,
        }
        self.report.results.setdefault("batch1_decode", {})["graphs_on" if graphs else "graphs_off"] = entry
        print(
            f"batch-1 decode, graphs {'on' if graphs else 'off'}: {tokens_per_s:.0f} tok/s = "
            f"{entry['share_of_roofline']:.0%} of the {roofline:.0f} tok/s HBM roofline"
        )

    def batch1_anatomy(self, eng, steps: int = 48) -> dict:
        """Where a batch-1 decode step's time goes: the whole step on the host clock (eng.step(),
        which ends when its token is on the host), the captured forward and the logits' matmul
        with argmax each replayed back to back on the device (CUDA events: device time alone),
        and the host's functions over the same steps (cProfile, the top 15 by own time). The
        step's wall time less the device's is time the device waits for the host."""
        import cProfile
        import io
        import pstats

        import torch

        from pagoda.sampling_params import SamplingParams

        prompt = [self.rng.randrange(3, self.shapes["vocab_size"]) for _ in range(self.prompt_len)]
        eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2 * steps + 4, ignore_eos=True))
        eng.step()  # the prefill
        eng.step()  # the first decode: anything lazy set up
        walls = []
        for _ in range(steps):
            start = time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - start)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(steps):
            eng.step()
        profile.disable()
        while eng.has_unfinished:
            eng.step()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
        walls.sort()
        result = {
            "step_wall_ms_p50": 1e3 * walls[len(walls) // 2],
            "step_wall_ms_min": 1e3 * walls[0],
            "host_profile_top15": text.getvalue().splitlines()[-22:],
        }
        runner = eng.core.runner
        if runner.cuda_graphs is not None:
            graph = runner.cuda_graphs._graphs[1]  # the static buffers still hold the last step's inputs

            def device_ms(fn, n: int = 50) -> float:
                fn()
                torch.cuda.synchronize()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(n):
                    fn()
                end.record()
                end.synchronize()
                return begin.elapsed_time(end) / n

            hidden = graph.output[:1]
            with torch.inference_mode():
                forward = device_ms(graph.run)
                logits = device_ms(lambda: runner.model.compute_logits(hidden).argmax(dim=-1))
            roofline_ms = 1e3 * self.report.results["engine"]["weight_bytes_read_per_token"] / HBM_BYTES_PER_S
            result["forward_kernels_top12"] = kernel_table(graph.run, replays=10)
            result.update(
                forward_device_ms=forward,
                logits_argmax_device_ms=logits,
                roofline_ms=roofline_ms,
                device_share_of_step=(forward + logits) / result["step_wall_ms_p50"],
                device_wait_ms=result["step_wall_ms_p50"] - forward - logits,
            )
        print("batch-1 anatomy: " + ", ".join(f"{k} {v:.3g}" for k, v in result.items() if isinstance(v, float)))
        print("\n".join(result["host_profile_top15"] + result.get("forward_kernels_top12", [])))
        return result

    def describe(self, eng, startup_s: float) -> dict:
        import torch

        runner = eng.core.runner
        params = {n: p.numel() * p.element_size() for n, p in runner.model.named_parameters()}
        embed = params["embed_tokens"]  # a decode reads one row of it
        info = {
            "startup_s": startup_s,
            "model_dtype": str(eng.config.model.dtype).removeprefix("torch."),
            "weight_bytes": sum(params.values()),
            "weight_bytes_read_per_token": sum(params.values()) - embed,
            "kv_cache_tokens": (eng.core.scheduler.kv.pool.num_blocks - 1) * eng.config.cache.block_size,
            "max_model_len": eng.config.model.max_model_len,
            "cuda_graph_sizes": list(runner.cuda_graphs.sizes) if runner.cuda_graphs else None,
            "settings": {
                "max_num_seqs": eng.config.scheduler.max_num_seqs,
                "max_num_batched_tokens": eng.config.scheduler.max_num_batched_tokens,
                "gpu_memory_utilization": eng.config.cache.gpu_memory_utilization,
            },
        }
        info["max_concurrency_at_max_model_len"] = info["kv_cache_tokens"] / info["max_model_len"]
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            info.update(gpu_used_gib=(total - free) / 2**30, gpu_total_gib=total / 2**30)
        return info

    @staticmethod
    def fp8_refused_on_cpu(model_dir: Path, settings: dict) -> dict:
        from pagoda.errors import ConfigError

        try:
            engine(model_dir, True, quantization="fp8", **settings)
        except ConfigError as e:
            print(f"fp8 refused on CPU, as it should be: {e}")
            return {"refused_on_cpu": str(e)}
        raise AssertionError("quantization='fp8' was accepted on CPU")


def environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", memory_gib=props.total_memory / 2**30)
    return env


if __name__ == "__main__":
    sys.exit(main())
