"""LLMEngine: one scheduler, one model runner, stepped by every front door (CLI, Python, HTTP)."""

from __future__ import annotations

import itertools
import os
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from rlt_engine.checkpoints.loader import load_model
from rlt_engine.checkpoints.resolve import default_model, resolve_model_dir
from rlt_engine.config import EngineConfig
from rlt_engine.core.block_manager import BlockManager
from rlt_engine.core.exit_rule import LoopControls
from rlt_engine.core.plan import PrefillChunk, Sample, SlotInit, Stage, StepPlan
from rlt_engine.core.request import Request
from rlt_engine.core.scheduler import Scheduler
from rlt_engine.detokenizer import IncrementalDetokenizer
from rlt_engine.engine_info import EngineInfo
from rlt_engine.models.tokenizer import has_tokenizer_files, load_tokenizer, stop_token_ids
from rlt_engine.outputs import EngineStats, RequestMetrics, RequestOutput, TokenLogprob
from rlt_engine.sampling_params import SamplingParams
from rlt_engine.structured import Grammars, Matcher
from rlt_engine.worker.decode import Flags
from rlt_engine.worker.memory_plan import (
    DEFAULT_CUDA_RESERVE_BYTES,
    profile_kv_budget,
    resolve_memory_plan,
)
from rlt_engine.worker.model_runner import Launched, ModelRunner

# A/B switch (benchmarks/README.md): prefill waves riding decode windows (1, the default) or
# running before them (0)
RIDE_WAVES = os.environ.get("RLT_RIDE_WAVES", "1") != "0"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StepFailedError(RuntimeError):
    """The worker failed on a step; the requests it touched (`request_ids`) were aborted and
    freed, the engine stays usable for everything else."""

    def __init__(self, message: str, request_ids: tuple[str, ...]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


@dataclass(eq=False)
class _Tracked:
    """The engine's side of a request: its detokenizer and what its outputs have sent."""

    req: Request
    detok: IncrementalDetokenizer | None
    grammar: Matcher | None = None  # structured output: where the output is in its grammar
    sent: int = 0  # output tokens already handed out in RequestOutputs
    error: str | None = None  # set when this request's host-side processing failed


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if mc.device == "auto" else mc.device
        )
        dtype = mc.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = _DTYPES[dtype]
        self.model_name, self.notice = (mc.model, None) if mc.model else default_model()
        self.model_dir: Path = resolve_model_dir(self.model_name, mc.revision, mc.load_format)
        self.model = load_model(
            self.model_dir, dtype=self.dtype, device=self.device, load_format=mc.load_format,
            max_model_len=mc.max_model_len,
        )  # fmt: skip
        self.model_config = self.model.config
        if has_tokenizer_files(self.model_dir):  # a broken tokenizer is an error, not "none"
            self.tokenizer = load_tokenizer(self.model_dir)
            self.default_stop_ids = stop_token_ids(self.tokenizer, self.model_config)
        else:
            self.tokenizer = None  # dummy weights from a bare config: token-id prompts only
            self.default_stop_ids = self.model_config.eos_token_ids
        self._grammar_compiler: Grammars | None = None  # made by the first structured request
        depth = self.model_config.num_loops
        cache = config.cache
        self.memory_plan = resolve_memory_plan(
            self.model_config,
            device_type=self.device.type,
            block_size=cache.block_size,
            dtype_bytes=self.dtype.itemsize,
            kv_layout=cache.kv_layout,
            num_blocks=cache.num_blocks,
            kv_cache_memory=cache.kv_cache_memory,
            profile=self._profile_kv_budget,
            weight_bytes=sum(
                t.numel() * t.element_size() for t in self.model.state_dict().values()
            ),
            max_num_seqs=config.scheduler.max_num_seqs,
        )
        self.num_planes = self.memory_plan.num_planes
        self.num_blocks = self.memory_plan.num_blocks
        self.blocks = BlockManager(
            self.num_blocks, cache.block_size, self.num_planes, cache.enable_prefix_caching
        )
        asynchronous = config.execution.async_scheduling
        self.async_scheduling = self.device.type == "cuda" if asynchronous is None else asynchronous
        self.runner = self._make_runner(self.num_blocks)
        self.scheduler = Scheduler(
            config.scheduler,
            self.blocks,
            depth,
            cache,
            config.execution.decode_window,
            lookahead=2 if self.async_scheduling else 1,
            ride_waves=RIDE_WAVES,
            max_ride_rows=self.runner.max_ride_rows,
        )
        self.runner.capture_graphs(self._default_flags())
        self._launched: deque[tuple[StepPlan, Launched]] = deque()  # oldest first
        self._requests: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._decode_rows = 0
        self.info = self._describe()

    def _default_flags(self) -> list[Flags]:
        """Decode-graph variants of requests with default sampling parameters: greedy (the
        API's default) and temperature sampling (the OpenAI server's default)."""
        early = self.loop_controls(SamplingParams()).may_exit_early(self.model_config.num_loops)
        return [Flags(False, False, None, early), Flags(True, False, None, early)]

    def _describe(self) -> EngineInfo:
        cfg, execution, plan = self.model_config, self.config.execution, self.memory_plan
        defaults = self.loop_controls(SamplingParams())
        device_name = "cpu"
        if self.device.type == "cuda":
            device_name = torch.cuda.get_device_name(self.device)
        impl = type(self.runner.kv).__name__.removesuffix("PagedAttention").lower()
        return EngineInfo(
            model=self.model_name,
            model_dir=str(self.model_dir),
            model_type=cfg.model_type,
            num_loops=cfg.num_loops,
            max_model_len=cfg.max_position_embeddings,
            vocab_size=cfg.vocab_size,
            has_tokenizer=self.tokenizer is not None,
            device=str(self.device),
            device_name=device_name,
            dtype=str(self.dtype).removeprefix("torch."),
            kv_layout=plan.kv_layout.value,
            num_planes=plan.num_planes,
            num_blocks=plan.num_blocks,
            block_size=plan.block_size,
            kv_cache=plan.describe(),
            max_num_seqs=self.config.scheduler.max_num_seqs,
            attention_backend=execution.attention_backend,
            attention_impl=impl,
            cuda_graphs=self.runner.graphs is not None,
            decode_window=execution.decode_window,
            kernels=self._kernel_switches(impl),
            default_min_loops=defaults.min_loops,
            default_max_loops=defaults.max_loops,
            default_exit_threshold=defaults.exit_threshold,
            notice=self.notice,
            graphs_at_start=self.runner.captures.graphs,
            graph_capture_s_at_start=self.runner.captures.seconds,
        )

    def _kernel_switches(self, impl: str) -> dict[str, bool | str]:
        from rlt_engine.kernels import pdl, small_gemm

        triton = impl == "triton"
        mode = small_gemm.dispatch_mode(self.device) if triton else "cublas"
        table = small_gemm.serving_table(self.device) if mode != "cublas" else None
        return {
            "pdl": triton and pdl.enabled(self.device),
            "small_gemm": mode,
            # the GPU the table was tuned on: another GPU of its layout may take it
            "small_gemm_table": "" if table is None else table["device"],
            "fused_rows": self.runner.traversal.fused,
        }

    def _make_runner(self, num_blocks: int) -> ModelRunner:
        cache = self.config.cache
        planes = cache.kv_layout.num_planes(self.model_config.num_loops)
        per_plane = -(-self.model_config.max_position_embeddings // cache.block_size)
        return ModelRunner(
            self.model,
            num_blocks,
            cache.block_size,
            num_slots=self.config.scheduler.max_num_seqs,
            max_blocks=max(1, min(per_plane, num_blocks // planes)),
            num_planes=planes,
            refill=self.config.scheduler.refill,
            execution=self.config.execution,
        )

    def _profile_kv_budget(self) -> int:
        """CUDA: KV bytes left under gpu_memory_utilization after the largest possible step
        (a full token budget of prefill through every loop, then a decode traversal of every
        slot with every sampling variant on)."""
        sched = self.config.scheduler
        # a full token budget, but never past the model's context (the decode step after it
        # writes one more position)
        rows = min(sched.max_num_batched_tokens, self.model_config.max_position_embeddings - 1)
        block_size = self.config.cache.block_size
        # the decode traversal after the full prefill writes position `rows`: one more slot
        num_blocks = self.model_config.num_loops * -(-(rows + 1) // block_size)

        def run_max_step() -> None:
            runner = self._make_runner(num_blocks)
            per_plane = num_blocks // self.model_config.num_loops
            init = SlotInit(
                0,
                SamplingParams(
                    max_tokens=2, temperature=1.0, top_p=0.9, logprobs=20, repetition_penalty=1.1
                ),
                0,
                self.loop_controls(SamplingParams()),
                (),
                rows,
                tuple(
                    tuple(range(p * per_plane, (p + 1) * per_plane))
                    for p in range(runner.slots.block_tables.shape[1])
                ),
                (0,) * rows,
            )
            chunk = PrefillChunk("profile", 0, 0, (0,) * rows, last=True)
            runner.execute(StepPlan(slot_inits=(init,), prefill=((chunk,),)))
            # the widest decode traversal: every slot, every sampling variant (penalties, whose
            # `seen` table it makes), exit copies
            runner.traversal(runner.slots.num_slots, Flags(True, True, 20, True, logit_edits=True))

        return profile_kv_budget(
            self.device,
            gpu_memory_utilization=self.config.cache.gpu_memory_utilization,
            run_max_step=run_max_step,
            reserve_bytes=DEFAULT_CUDA_RESERVE_BYTES,
        )

    # -- requests ------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; returns its id. `arrival_time` (time.monotonic()): when it reached
        the caller (a server's queue), if earlier than now."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self._encode(prompt)
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must lie in [0, {vocab})")
        req = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            controls=self.loop_controls(params),
            stop_token_ids=self._stop_ids(params),
            seed=params.seed if params.seed is not None else random.getrandbits(63),
        )
        if arrival_time is not None:
            req.arrival_time = min(arrival_time, req.arrival_time)
        max_len = self.model_config.max_position_embeddings  # max_model_len where given
        if req.max_positions > max_len:
            limit = f"the model's context of {max_len} positions"
            if self.config.model.max_model_len is not None:
                limit = f"max_model_len={max_len}"
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"{limit}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model directory has none")
        grammar = None
        if params.structured is not None:
            grammar = self._grammars().matcher(params.structured, sorted(req.stop_token_ids))
            req.token_mask = grammar.mask()  # the first token's, sent with its SlotInit
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                params.stop,
                params.min_tokens,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            )
        self.scheduler.add(req)
        self._requests[request_id] = _Tracked(req, detok, grammar)
        return request_id

    def _grammars(self) -> Grammars:
        """The grammar compiler of this model's tokenizer, made at the first structured
        request."""
        if self.tokenizer is None:
            raise ValueError("structured output needs a tokenizer; this model directory has none")
        if self._grammar_compiler is None:
            self._grammar_compiler = Grammars(self.tokenizer, self.model_config.vocab_size)
        return self._grammar_compiler

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        return ids

    def loop_controls(self, p: SamplingParams) -> LoopControls:
        """The request's loop controls with this model's defaults filled in, validated: the
        one place defaults are resolved (min 1, max the depth, the config's exit threshold)."""
        depth = self.model_config.num_loops
        controls = LoopControls(
            min_loops=p.min_loops if p.min_loops is not None else 1,
            max_loops=p.max_loops if p.max_loops is not None else depth,
            exit_threshold=(
                p.exit_threshold
                if p.exit_threshold is not None
                else self.model_config.early_exit_threshold
            ),
        )
        controls.validate(depth)
        return controls

    def _stop_ids(self, p: SamplingParams) -> frozenset[int]:
        defaults = () if p.ignore_eos else self.default_stop_ids
        return frozenset((*defaults, *(p.stop_token_ids or ())))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return None
        self.scheduler.abort(request_id)
        self.settle()
        return self._output(entry, new_text="")

    def stats(self) -> EngineStats:
        sched, prefix, size = self.scheduler, self.blocks.stats, self.config.cache.block_size
        return EngineStats(
            num_running=len(sched.running) + len(sched.retiring),  # retiring: last tokens due
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            blocks_used=self.blocks.num_used,
            blocks_total=self.num_blocks,
            prefix_queried_tokens=prefix.queried_blocks * size,
            prefix_hit_tokens=prefix.hit_blocks * size,
            preemptions=sched.num_preemptions,
            decode_rows=self._decode_rows,
            graphs_captured=self.runner.captures.graphs,
            graph_capture_s=self.runner.captures.seconds,
        )

    def cache_stats(self) -> dict[str, float | int]:
        """KV pool occupancy, prefix-cache hits and preemptions so far."""
        prefix = self.blocks.stats
        return {
            "blocks_used": self.blocks.num_used,
            "blocks_total": self.num_blocks,
            "prefix_queried_blocks": prefix.queried_blocks,
            "prefix_hit_blocks": prefix.hit_blocks,
            "prefix_hit_rate": prefix.hit_rate,
            "preemptions": self.scheduler.num_preemptions,
        }

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still running or waiting. With none left, the finished
        requests' bookkeeping goes to the worker here (`settle`), after `step` has returned
        their final outputs."""
        if self.scheduler.has_unfinished():
            return True
        self.settle()
        return False

    # -- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step (prefill chunks and a decode window); outputs for requests that got
        tokens or finished. With async scheduling the step launches the next plan, then
        applies the previous one's results (so outputs come one window late). A request whose
        detokenizer or stop matching raises finishes alone, with finish_reason "error"; a
        failed worker step raises StepFailedError."""
        self.settle()
        plan = self.scheduler.schedule()
        if plan is not None:
            self._decode_rows = self._count_decoding() if plan.decode_traversals else 0
            self._guarded(lambda: self._launched.append((plan, self.runner.launch(plan))))
        # async: keep the newest plan running while the host works on the one before it
        keep = 1 if self.async_scheduling and plan is not None else 0
        outputs = []
        while len(self._launched) > keep:
            outputs += self._apply_oldest()
        # the last requests' bookkeeping (their slots' frees on the device: ~1 ms of uploads
        # and copies on an H100) waits for `settle`, so their final outputs, which it would
        # hold back, go out first
        return outputs

    def _apply_oldest(self) -> list[RequestOutput]:
        plan, launched = self._launched[0]
        result = self._guarded(lambda: self.runner.collect(launched))
        self._launched.popleft()
        outputs = []
        for req in self.scheduler.update(plan, result, self._after_token):
            entry = self._requests.get(req.request_id)
            if entry is None or entry.req is not req:
                continue
            new_text = ""
            if entry.detok is not None and entry.error is None:
                try:
                    new_text = entry.detok.take_new(final=req.finished)
                except Exception as exc:
                    entry.error = f"detokenization failed: {type(exc).__name__}: {exc}"
            if entry.error is not None and not req.finished:
                self.scheduler.abort(req.request_id)
            outputs.append(self._output(entry, new_text))
            if req.finished or entry.error is not None:
                del self._requests[req.request_id]
        return outputs

    def _guarded(self, work):  # type: ignore[no-untyped-def]
        """Run worker code; on failure abort what the plans in flight touched (their device
        state is unknown) and raise StepFailedError."""
        try:
            return work()
        except Exception as exc:
            self._launched.clear()
            failed = self.scheduler.fail_plan()
            for req in failed:
                self._requests.pop(req.request_id, None)
            ids = tuple(r.request_id for r in failed)
            raise StepFailedError(
                f"a step failed and was rolled back ({exc}); aborted: {', '.join(ids) or 'none'}",
                ids,
            ) from exc

    def _count_decoding(self) -> int:
        return sum(r.stage is Stage.DECODE for r in self.scheduler.running)

    def _after_token(self, req: Request) -> bool:
        """Feed the newest token to the request's grammar (whose next mask the next plan
        sends) and detokenizer: True = a stop string ended it (or either failed, which ends
        this request with an error)."""
        entry = self._requests.get(req.request_id)
        if entry is None or entry.req is not req:
            return False
        if entry.error is not None:
            return True
        token = req.output_token_ids[-1]
        if entry.grammar is not None and not req.finished:
            try:
                entry.grammar.accept(token)
                req.token_mask = entry.grammar.mask()
            except Exception as exc:
                entry.error = f"structured output failed: {type(exc).__name__}: {exc}"
                return True
        if entry.detok is None:
            return False
        if token in req.stop_token_ids and not req.params.include_stop_str_in_output:
            return False  # a stop token's text is left out (vLLM's), special or not
        try:
            return entry.detok.push(token)
        except Exception as exc:
            entry.error = f"stop-string matching failed: {type(exc).__name__}: {exc}"
            return True

    def settle(self) -> None:
        """With nothing left to run, no further plan would carry the pending slot frees and
        snapshot drops to the worker: send them now so nothing lingers on the device (after
        the plans still in flight, whose results concern finished requests only). A no-op
        while requests remain; `has_unfinished_requests`, `step`, `abort_request` and
        `LLM.generate` call it."""
        if not self.scheduler.has_unfinished():
            while self._launched:
                self._apply_oldest()
            idle = self.scheduler.bookkeeping_plan()
            if idle is not None:
                self.runner.execute(idle)

    def _output(self, entry: _Tracked, new_text: str) -> RequestOutput:
        req, start = entry.req, entry.sent
        entry.sent = len(req.output_token_ids)
        want_logprobs = req.params.logprobs is not None
        finished = req.finished or entry.error is not None
        out = RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            new_token_ids=req.output_token_ids[start:],
            new_exit_depths=req.exit_depths[start:],
            new_text=new_text,
            new_logprobs=_logprobs(req.samples[start:]) if want_logprobs else None,
            num_tokens=len(req.output_token_ids),
            finished=finished,
            finish_reason="error" if entry.error is not None else req.finish_reason,
            metrics=RequestMetrics(req.arrival_time, req.first_token_time, req.finish_time),
            error=entry.error,
        )
        if req.params.prompt_logprobs is not None and (finished or (start == 0 < entry.sent)):
            out.prompt_logprobs = [None, *_logprobs(req.prompt_samples)]
        if finished:
            out.token_ids = list(req.output_token_ids)
            out.exit_depths = list(req.exit_depths)
            out.text = entry.detok.text if entry.detok is not None else ""
            out.logprobs = _logprobs(req.samples) if want_logprobs else None
        return out


def _logprobs(samples: list[Sample]) -> list[TokenLogprob]:
    return [
        TokenLogprob(s.token_id, s.logprob or 0.0, s.top_logprobs or (), s.rank) for s in samples
    ]
