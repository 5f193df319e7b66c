"""LLMEngine: one scheduler, one model runner, stepped by every front door (CLI, Python, HTTP)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import torch

from rlt_engine.config import EngineConfig
from rlt_engine.core.block_manager import BlockManager
from rlt_engine.core.exit_rule import LoopControls
from rlt_engine.core.plan import PrefillChunk, SlotInit, StepPlan
from rlt_engine.core.request import Request
from rlt_engine.core.scheduler import Scheduler
from rlt_engine.detokenizer import IncrementalDetokenizer
from rlt_engine.models.loader import load_model
from rlt_engine.models.resolve import default_model, resolve_model_dir
from rlt_engine.models.tokenizer import has_tokenizer_files, load_tokenizer, stop_token_ids
from rlt_engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from rlt_engine.sampling_params import SamplingParams
from rlt_engine.worker.decode import Flags
from rlt_engine.worker.memory_plan import (
    DEFAULT_CUDA_RESERVE_BYTES,
    profile_kv_budget,
    resolve_memory_plan,
)
from rlt_engine.worker.model_runner import ModelRunner

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StepFailedError(RuntimeError):
    """The worker failed on a step; the requests it touched were aborted and freed, the
    engine stays usable for everything else."""


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
            self.model_dir, dtype=self.dtype, device=self.device, load_format=mc.load_format
        )
        self.model_config = self.model.config
        if has_tokenizer_files(self.model_dir):  # a broken tokenizer is an error, not "none"
            self.tokenizer = load_tokenizer(self.model_dir)
            self.default_stop_ids = stop_token_ids(self.tokenizer, self.model_config)
        else:
            self.tokenizer = None  # dummy weights from a bare config: token-id prompts only
            self.default_stop_ids = self.model_config.eos_token_ids
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
        self.scheduler = Scheduler(
            config.scheduler, self.blocks, depth, cache, config.execution.decode_window
        )
        self.runner = self._make_runner(self.num_blocks)
        self._requests: dict[str, tuple[Request, IncrementalDetokenizer | None]] = {}
        self._ids = itertools.count()

    def _make_runner(self, num_blocks: int) -> ModelRunner:
        cache = self.config.cache
        planes = 1 if cache.kv_layout == "shared" else self.model_config.num_loops
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
                SamplingParams(max_tokens=2, temperature=1.0, top_p=0.9, logprobs=20),
                0,
                self._controls(SamplingParams()),
                (),
                rows,
                tuple(
                    tuple(range(p * per_plane, (p + 1) * per_plane))
                    for p in range(runner.slots.block_tables.shape[1])
                ),
            )
            chunk = PrefillChunk("profile", 0, 0, (0,) * rows, last=True)
            runner.execute(StepPlan(slot_inits=(init,), prefill=((chunk,),)))
            # the widest decode traversal: every slot, every sampling variant, exit copies
            runner.traversal(runner.slots.num_slots, Flags(True, True, 20, True))

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
    ) -> str:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self._encode(prompt)
        req = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            controls=self._controls(params),
            stop_token_ids=self._stop_ids(params),
            seed=params.seed if params.seed is not None else random.getrandbits(63),
        )
        max_len = self.model_config.max_position_embeddings
        if req.max_positions > max_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the model's context of {max_len} positions"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model directory has none")
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        self.scheduler.add(req)
        self._requests[request_id] = (req, detok)
        return request_id

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

    def _controls(self, p: SamplingParams) -> LoopControls:
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
        self._flush_if_idle()
        return self._output(*entry, new_text="")

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
        return self.scheduler.has_unfinished()

    # -- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step (prefill chunks and a decode window); outputs for requests that got
        tokens or finished."""
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        try:
            result = self.runner.execute(plan)
        except Exception as exc:
            failed = self.scheduler.fail_plan()
            for req in failed:
                self._requests.pop(req.request_id, None)
            ids = ", ".join(r.request_id for r in failed) or "none"
            raise StepFailedError(
                f"a step failed and was rolled back ({exc}); aborted: {ids}"
            ) from exc
        outputs = []
        for req in self.scheduler.update(plan, result, self._hits_stop_string):
            req_entry = self._requests.get(req.request_id)
            if req_entry is None or req_entry[0] is not req:
                continue
            detok = req_entry[1]
            new_text = detok.take_new(final=req.finished) if detok is not None else ""
            outputs.append(self._output(req, detok, new_text))
            if req.finished:
                del self._requests[req.request_id]
        self._flush_if_idle()
        return outputs

    def _hits_stop_string(self, req: Request) -> bool:
        """Feed the newest token to the request's detokenizer: True = a stop string ended it."""
        entry = self._requests.get(req.request_id)
        if entry is None or entry[0] is not req or entry[1] is None:
            return False
        return entry[1].push(req.output_token_ids[-1])

    def _flush_if_idle(self) -> None:
        """With nothing left to run, no further plan would carry the pending slot frees and
        snapshot drops to the worker: send them now so nothing lingers on the device."""
        if not self.scheduler.has_unfinished():
            idle = self.scheduler.bookkeeping_plan()
            if idle is not None:
                self.runner.execute(idle)

    def _output(
        self, req: Request, detok: IncrementalDetokenizer | None, new_text: str
    ) -> RequestOutput:
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = [
                TokenLogprob(s.token_id, s.logprob or 0.0, s.top_logprobs or ())
                for s in req.samples
            ]
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=detok.text if detok is not None else "",
            exit_depths=list(req.exit_depths),
            finished=req.finished,
            finish_reason=req.finish_reason,
            new_text=new_text,
            logprobs=logprobs,
            metrics=RequestMetrics(req.arrival_time, req.first_token_time, req.finish_time),
        )
