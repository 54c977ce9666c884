"""vLLM behind the ``Generator`` interface (``--engine vllm``), run out of process.

vLLM pins its own transformers, so it runs as a worker (:mod:`mta.generation.vllm_worker`) in its
own environment (``.venv-vllm`` or ``MTA_VLLM_PYTHON``), fed token ids over a pipe; mta tokenises,
truncates, seeds (vLLM's per-request ``seed``) and decodes as for its own engine. Greedy decoding
gives the HF engine's tokens up to near-ties; sampled rows agree in distribution, not row for row
(tests/test_vllm_engine.py), so the two engines' predictions never share a directory. On a CPU it
runs eagerly unless ``MTA_VLLM_COMPILE=1``; ``VLLM_CPU_KVCACHE_SPACE`` (2 GiB) and
``VLLM_CPU_OMP_THREADS_BIND`` are set unless the environment sets them. ARCHITECTURE.md, "3. evaluate".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import IO, Any

import torch

from mta.errors import MtaError
from mta.generation.generator import Completion, eos_token_ids
from mta.generation.sampling import SamplingParams

PYTHON_ENV = "MTA_VLLM_PYTHON"
COMPILE_ON_CPU = "MTA_VLLM_COMPILE"  # 1: compile on a CPU too (minutes at start, then faster)
DEFAULT_PYTHON = Path(".venv-vllm") / "bin" / "python"  # make install-vllm, from the repository root
WORKER = Path(__file__).with_name("vllm_worker.py")
ENGINES = ("hf", "vllm")
HF = "hf"
ENGINE_KEY = "engine"  # what a claim (generation.json, a pairs journal's settings) names the engine
# A claim written before engines were recorded: the HF engine made it.
UNRECORDED = {ENGINE_KEY: HF}
START_TIMEOUT_S = 900.0  # first start of a large model on a slow disk
REPLY_TIMEOUT_ENV = "MTA_VLLM_REPLY_TIMEOUT_S"  # seconds a request may take before the worker counts as hung
REPLY_TIMEOUT_S = 3600.0  # its default: a request of REQUEST_ROWS long generations on a slow CPU
FINISH_REASONS = ("stop", "length")
REQUEST_ROWS = 256  # prompts sent at a time: vLLM batches them itself; the bar moves per request
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
INSTALL_HINT = (
    "build it with `make install-vllm` (a .venv-vllm beside .venv, about 3.5 GB), or set "
    f"{PYTHON_ENV} to the python of an environment where vLLM is installed"
)


def vllm_python() -> Path:
    """The Python of the vLLM environment: ``$MTA_VLLM_PYTHON``, else ``.venv-vllm/bin/python``
    under the current directory; ``MtaError`` saying how to get one when there is none."""
    given = os.environ.get(PYTHON_ENV)
    path = Path(given).expanduser() if given else DEFAULT_PYTHON.absolute()  # not resolve(): a venv's python is a link
    if not path.is_file():
        where = f"{PYTHON_ENV}={given}" if given else f"no {DEFAULT_PYTHON} here and {PYTHON_ENV} is not set"
        raise MtaError(f"--engine vllm needs the vLLM environment ({where} is not a Python); {INSTALL_HINT}")
    return path


def vllm_available() -> bool:
    """Whether ``--engine vllm`` can run here: the environment exists and holds vLLM."""
    try:
        vllm_version(str(vllm_python()))
    except MtaError:
        return False
    return True


@cache
def vllm_version(python: str) -> str:
    """``vllm-cpu 0.32.0`` (the distribution and its version) of the environment of ``python``,
    read from its package metadata without importing vLLM (a tenth of a second)."""
    code = (
        "import importlib.metadata as m\n"
        "names = [d.metadata['Name'] for d in m.distributions()]\n"
        "found = [n for n in names if n and n.lower() in ('vllm', 'vllm-cpu')]\n"
        "print(f'{found[0].lower()} {m.version(found[0])}' if found else '')\n"
    )
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise MtaError(f"cannot run {python} ({error}); {INSTALL_HINT}") from error
    version = done.stdout.strip()
    if done.returncode != 0 or not version:
        raise MtaError(f"{python} has no vLLM installed; {INSTALL_HINT}")
    return version


def engine_name(engine: str) -> str:
    """What artefacts record: ``hf``, or the vLLM distribution and version (``vllm-cpu 0.32.0``)."""
    if engine not in ENGINES:
        raise MtaError(f"unknown engine '{engine}'; choose from {', '.join(ENGINES)}")
    return HF if engine == HF else vllm_version(str(vllm_python()))


def worker_environment(device: torch.device) -> dict[str, str]:
    """The worker's environment: this one, with vLLM's CPU settings filled in where unset, and on
    a GPU the device this process uses as the worker's only visible one."""
    env = dict(os.environ)
    env.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    if device.type == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", core_list())
    elif device.type == "cuda" and device.index is not None:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[device.index] if visible else str(device.index)
    return env


def core_list() -> str:
    """The cores this process may run on, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` reads them
    (``0-1``; ``0,2,5`` when not contiguous). Its default leaves a core to its scheduler."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


@dataclass(frozen=True)
class EngineSettings:
    """How the vLLM engine is started: ``tensor_parallel_size`` GPUs per engine; ``enforce_eager``
    (None: compiled on a GPU; on a CPU, where compiling costs minutes, eager unless the
    environment sets ``MTA_VLLM_COMPILE=1``); ``max_model_len`` (None: the model's own)."""

    tensor_parallel_size: int = 1
    enforce_eager: bool | None = None
    max_model_len: int | None = None

    def eager_on(self, device: torch.device) -> bool:
        """Whether the engine runs eagerly on ``device``."""
        if self.enforce_eager is not None:
            return self.enforce_eager
        return device.type == "cpu" and os.environ.get(COMPILE_ON_CPU) != "1"


def reply_timeout_s() -> float:
    """Seconds a request may take before the worker counts as hung (``MTA_VLLM_REPLY_TIMEOUT_S``,
    default one hour)."""
    given = os.environ.get(REPLY_TIMEOUT_ENV)
    if not given:
        return REPLY_TIMEOUT_S
    try:
        seconds = float(given)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise MtaError(f"{REPLY_TIMEOUT_ENV}={given!r}: give the seconds a vLLM request may take, a number > 0")
    return seconds


def _end_with_parent() -> None:
    """In the worker, before it runs: the kernel sends it SIGKILL when mta dies (SIGTERM, SIGKILL),
    so no worker outlives the process that started it (Linux; elsewhere the worker ends at the
    end of its stdin)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class WorkerReplyError(MtaError):
    """A worker's reply that breaks the protocol: nothing of it is used."""


def checked_reply(
    reply: Any, *, worker: str, ready: bool = False, prompts: int = 0, vocab_size: int | None = None
) -> list[dict[str, Any]]:
    """The one check of what the vLLM worker answers (:mod:`mta.generation.vllm_worker`'s
    protocol): ``{"ready": true, ...}`` when ``ready``, else ``{"outputs": [...]}`` with exactly
    ``prompts`` objects, each ``token_ids`` a list of ints in ``0 .. vocab_size - 1`` and
    ``finish_reason`` ``stop`` or ``length``. Returns the outputs; a reply that breaks any of it is
    one ``WorkerReplyError`` naming ``worker`` and the first problem, before anything of it is
    decoded, scored or journalled."""

    def refused(problem: str) -> WorkerReplyError:
        return WorkerReplyError(
            f"the vLLM worker ({worker}) broke the protocol: {problem}; nothing of its reply was used"
        )

    if not isinstance(reply, dict):
        raise refused(f"its reply is a JSON {type(reply).__name__}, not an object")
    if ready:
        if reply.get("ready") is not True:
            raise refused(f'its first reply is {json.dumps(reply)[:120]}, not {{"ready": true}}')
        return []
    outputs = reply.get("outputs")
    if not isinstance(outputs, list):
        raise refused(f"its reply has no 'outputs' list (it has {sorted(reply)})")
    if len(outputs) != prompts:
        raise refused(f"{len(outputs)} outputs for {prompts} prompts")
    for index, output in enumerate(outputs):
        if not isinstance(output, dict):
            raise refused(f"output {index} is a JSON {type(output).__name__}, not an object")
        ids, reason = output.get("token_ids"), output.get("finish_reason")
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise refused(f"output {index}'s token_ids is {str(ids)[:80]}, not a list of integers")
        if ids and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)):
            bad = next(i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size))
            limit = f"0 .. {vocab_size - 1}" if vocab_size is not None else "0 or more"
            raise refused(f"output {index} holds token id {bad}, outside the vocabulary ({limit})")
        if reason not in FINISH_REASONS:
            raise refused(f"output {index}'s finish_reason is {reason!r}, not one of {', '.join(FINISH_REASONS)}")
    return outputs


class VLLMEngine:
    """One vLLM worker process holding ``checkpoint``; a context manager (the process ends on exit,
    at once when the block fails; with mta too, even killed).

    startup_s: seconds from launch to ready (import, load, KV cache); version: ``vllm-cpu 0.32.0``."""

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
        settings: EngineSettings | None = None,
        vocab_size: int | None = None,
    ):
        self.checkpoint, self.dtype, self.device = str(checkpoint), dtype, device
        self.vocab_size = vocab_size  # ids at or past it are refused (None: any id >= 0)
        self.seed, self.settings = seed, settings or EngineSettings()
        self.python = vllm_python()
        self.version = vllm_version(str(self.python))
        self.startup_s = 0.0
        self.process: subprocess.Popen[str] | None = None
        self._stderr: deque[str] = deque(maxlen=40)

    def __enter__(self) -> VLLMEngine:
        self.start()
        return self

    def __exit__(self, kind: Any, *exc_info: Any) -> None:
        self.close(at_once=kind is not None)

    def start(self) -> None:
        if self.dtype not in DTYPES:
            raise MtaError(f"--engine vllm runs fp32, bf16 or fp16, not {self.dtype}")
        eager = self.settings.eager_on(self.device)
        started = time.perf_counter()
        self.process = subprocess.Popen(
            [str(self.python), str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=worker_environment(self.device),
            preexec_fn=_end_with_parent,
        )
        threading.Thread(target=self._drain, args=(self.process.stderr,), daemon=True).start()
        self._send(
            {
                "model": str(Path(self.checkpoint).resolve()) if Path(self.checkpoint).exists() else self.checkpoint,
                "dtype": DTYPES[self.dtype],
                "seed": self.seed,
                "tensor_parallel_size": self.settings.tensor_parallel_size,
                "max_model_len": self.settings.max_model_len,
                "enforce_eager": eager,
                # vLLM 0.32 on a CPU: a seeded request whose prefill is split over steps rewinds
                # its torch.Generator's offset, which a CPU generator does not have ("CPU
                # Generator does not use offset"): prefills stay whole there.
                "extra": {"enable_chunked_prefill": False} if self.device.type == "cpu" else {},
            }
        )
        reply = self._receive(START_TIMEOUT_S, "starting")
        self.startup_s = time.perf_counter() - started
        if "error" in reply:
            raise self._failure(f"vLLM could not load {self.checkpoint}: {reply.get('error')}")
        checked_reply(reply, ready=True, worker=self.worker)

    def complete(self, prompts: Sequence[list[int]], seeds: Sequence[int], params: dict[str, Any]) -> list[dict]:
        """vLLM's outputs (``token_ids``, ``finish_reason``) of ``prompts``, in order."""
        self._send({"prompts": [list(p) for p in prompts], "seeds": list(seeds), "params": params})
        reply = self._receive(reply_timeout_s(), "generating")
        if "error" in reply:
            raise self._failure(f"vLLM failed on {self.checkpoint}: {reply.get('error')}")
        return checked_reply(reply, prompts=len(prompts), vocab_size=self.vocab_size, worker=self.worker)

    @property
    def worker(self) -> str:
        """The worker as the messages name it: its Python and script, and its pid."""
        pid = f" pid {self.process.pid}" if self.process is not None else ""
        return f"{self.python} {WORKER}{pid}"

    def close(self, *, at_once: bool = False) -> None:
        """End the worker: asked to (an empty line) and given a minute, or at once (``at_once``: an
        error, Ctrl-C), when nothing more is wanted from it."""
        process, self.process = self.process, None
        if process is None:
            return
        if at_once:
            process.kill()
            process.wait()
            return
        try:
            if process.poll() is None and process.stdin is not None:
                process.stdin.write("\n")
                process.stdin.close()
            process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()

    def _send(self, payload: dict[str, Any]) -> None:
        assert self.process is not None and self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(payload) + "\n")
            self.process.stdin.flush()
        except OSError as error:
            raise self._failure(f"the vLLM worker is gone ({error})") from error

    def _receive(self, timeout: float | None, doing: str) -> dict[str, Any]:
        assert self.process is not None and self.process.stdout is not None
        answer: list[str] = []
        reader = threading.Thread(target=lambda: answer.append(self.process.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        worker = self.worker
        if reader.is_alive():
            self.close(at_once=True)
            setting = f" ({REPLY_TIMEOUT_ENV})" if doing == "generating" else ""
            raise self._failure(
                f"the vLLM worker ({worker}) did not answer within {timeout:.0f} s{setting} while {doing}"
            )
        if not answer or not answer[0].strip():
            self.process.wait(timeout=60)
            raise self._failure(f"the vLLM worker ended while {doing} (exit {self.process.returncode})")
        try:
            reply = json.loads(answer[0])
        except ValueError as error:
            self.close(at_once=True)
            raise MtaError(
                f"the vLLM worker ({worker}) answered a line that is not JSON while {doing} ({error}: "
                f"{answer[0][:120]!r}); nothing of it was used"
            ) from None
        if not isinstance(reply, dict):
            self.close(at_once=True)
            raise MtaError(
                f"the vLLM worker ({worker}) answered a JSON {type(reply).__name__}, not an object, while "
                f"{doing}; nothing of it was used"
            )
        return reply

    def _drain(self, stream: IO[str] | None) -> None:
        """Keep the worker's last lines of stderr (vLLM's log) for an error message."""
        if stream is None:
            return
        for line in stream:
            self._stderr.append(line.rstrip())
            if os.environ.get("MTA_VLLM_LOG"):
                print(line, end="", file=sys.stderr)

    def _failure(self, message: str) -> MtaError:
        tail = "\n".join(line for line in self._stderr if line)[-2000:]
        return MtaError(f"{message}{chr(10) + 'its log ends:' + chr(10) + tail if tail else ''}")


class VLLMGenerator:
    """:class:`~mta.generation.generator.Generator` on a started :class:`VLLMEngine`: one request
    of up to ``request_rows`` prompts at a time (vLLM schedules the batch itself)."""

    def __init__(
        self, engine: VLLMEngine, params: SamplingParams, stop_ids: Sequence[int], *, request_rows: int = REQUEST_ROWS
    ):
        self.engine, self.params = engine, params
        self.stop_ids = sorted({*stop_ids, *params.stop_token_ids})
        self.request_rows = request_rows

    def wire_params(self) -> dict[str, Any]:
        """The request's sampler: ``SamplingParams`` as the worker hands it to vLLM."""
        params = self.params
        return {
            "temperature": params.temperature,
            "top_k": params.top_k,
            "top_p": params.top_p,
            "max_tokens": params.max_new_tokens,
            "min_tokens": params.min_new_tokens,
            "stop_token_ids": self.stop_ids,
        }

    def generate(self, prompts: Sequence[list[int]], row_seeds: Sequence[int]) -> Iterator[list[Completion]]:
        """One completion per prompt (``row_seeds[i]`` seeds prompt i), a request at a time."""
        if len(prompts) != len(row_seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(row_seeds)} seeds")
        stops = set(self.stop_ids)
        wire = self.wire_params()
        for start in range(0, len(prompts), self.request_rows):
            positions = range(start, min(start + self.request_rows, len(prompts)))
            outputs = self.engine.complete([prompts[i] for i in positions], [row_seeds[i] for i in positions], wire)
            completions = []
            for position, output in zip(positions, outputs, strict=True):
                ids = list(output["token_ids"])
                finished = output["finish_reason"] == "stop"
                if finished and ids and ids[-1] in stops:
                    ids = ids[:-1]  # Completion holds the ids before the stop token
                completions.append(Completion(position, ids, finished))
            yield completions


@contextmanager
def vllm_generation(
    checkpoint: str | Path,
    tokenizer: Any,
    params: SamplingParams,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None = None,
    enforce_eager: bool | None = None,
) -> Iterator[VLLMGenerator]:
    """A :class:`VLLMGenerator` on ``checkpoint`` for the span of the block (the engine started,
    then stopped): its stop ids the model's generation config's EOS and the tokenizer's, as the
    HF engine's; ``max_model_len``: the longest prompt + completion asked for (sizes the cache);
    ``enforce_eager``: as :class:`EngineSettings`."""
    from transformers import AutoConfig, GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(checkpoint)
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        config = GenerationConfig()
    model_config = AutoConfig.from_pretrained(checkpoint)
    vocab_size = getattr(model_config.get_text_config(), "vocab_size", None) or len(tokenizer)
    settings = EngineSettings(max_model_len=max_model_len, enforce_eager=enforce_eager)
    with VLLMEngine(checkpoint, dtype=dtype, device=device, settings=settings, vocab_size=vocab_size) as engine:
        yield VLLMGenerator(engine, params, eos_token_ids(config, tokenizer))
