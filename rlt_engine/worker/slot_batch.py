"""The persistent slot batch: every running request's decode state on the device, at fixed
addresses indexed by slot (so a traversal over slots [0, B) is one fixed-shape function that a
CUDA graph can capture).

Slot identity is not request identity: a preempted request's row travels with its snapshot and
lands in whatever slot it resumes into. The host keeps a small mirror of what it needs to pick
static variants (sampling flags, early exits) and the tables' lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlt_engine.core.plan import SlotInit, Tables
from rlt_engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from rlt_engine.structured import mask_words
from rlt_engine.worker.batched_sampler import SEEN_OUTPUT, LogitEdits

MAX_STOP_IDS = 32  # stop token ids per request the device checks


@dataclass
class SlotHost:
    """What the host remembers of a slot: sampling parameters and its tables' length."""

    params: SamplingParams
    early_exit: bool  # may leave before the model depth (exit copies needed)
    blocks: int  # blocks per plane in its tables


class SlotBatch:
    # per-slot device tensors, in snapshot order
    FIELDS = (
        "token",
        "hidden",
        "loop",
        "remaining",
        "position",
        "generated",
        "active",
        "parked",
        "min_loops",
        "max_loops",
        "threshold",
        "max_tokens",
        "min_tokens",
        "stop_ids",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "presence",
        "frequency",
        "repetition",
        "constrained",
        "allowed",
    )

    def __init__(
        self,
        num_slots: int,
        num_planes: int,
        max_blocks: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        vocab_size: int,
    ) -> None:
        def zeros(*shape: int, dt: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, device=device)

        n = num_slots
        self.num_slots, self.max_blocks, self.device = n, max_blocks, device
        self.vocab_size = vocab_size
        self.token = zeros(n)  # the token to embed at loop 0
        self.hidden = zeros(n, hidden_size, dt=dtype)  # input of the next loop (loop > 0)
        self.loop = zeros(n)  # loops finished by the token in flight
        self.remaining = torch.ones(n, dtype=torch.float32, device=device)  # exit mass R
        self.position = zeros(n)  # position of the token in flight
        self.generated = zeros(n)  # tokens emitted so far = RNG counter of the next one
        self.active = zeros(n, dt=torch.bool)  # decoding on the device
        self.parked = zeros(n, dt=torch.bool)  # no-refill: exited, waits for the cohort
        self.min_loops = zeros(n)
        self.max_loops = zeros(n)
        self.threshold = torch.ones(n, dtype=torch.float32, device=device)
        self.max_tokens = zeros(n)
        self.min_tokens = zeros(n)  # stop ids held back while fewer tokens were generated
        self.stop_ids = torch.full((n, MAX_STOP_IDS), -1, dtype=torch.long, device=device)
        self.temperature = zeros(n, dt=torch.float32)
        self.top_k = zeros(n)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.seed = zeros(n)
        self.presence = zeros(n, dt=torch.float32)
        self.frequency = zeros(n, dt=torch.float32)
        self.repetition = torch.ones(n, dtype=torch.float32, device=device)
        # each slot's logit bias (padding: token 0, bias 0), written from its params only where
        # a request has one or the slot's last one had (`_biased`): most admissions write none
        self.bias_ids = zeros(n, MAX_LOGIT_BIAS)
        self.bias_values = zeros(n, MAX_LOGIT_BIAS, dt=torch.float32)
        self._biased: set[int] = set()
        # int32 [slots, vocab] (batched_sampler.LogitEdits.seen), made when the first request
        # that edits logits arrives (before the `logit_edits` variant's graphs that read it;
        # 4 bytes x slots x vocab: 50 MB at 256 slots of Ouro's vocabulary) and kept: only
        # penalized rows' entries are kept true (for the others they change nothing)
        self.seen: torch.Tensor | None = None
        # structured output: a constrained row draws from `allowed` (the bitmask of
        # rlt_engine/structured.py) and is held (inactive) after each token until the host
        # sends the next one (`release`)
        self.constrained = zeros(n, dt=torch.bool)
        self.allowed = zeros(n, mask_words(vocab_size), dt=torch.int32)
        self._masks: dict[int, bytes] = {}  # slot -> mask, until flush
        self.block_tables = zeros(n, num_planes, max_blocks, dt=torch.int32)
        self.host: dict[int, SlotHost] = {}
        self._rows: dict[str, dict[int, object]] = {}  # field -> slot -> value, until flush
        self._tables: dict[int, int] = {}  # flat index into block_tables -> block, until flush

    # -- diffs from the plan -------------------------------------------------------------
    # Inits and clears are row writes kept on the host until `flush`: a scalar `field[slot] =
    # value` on CUDA is a pageable copy that waits for every window in flight (14 such waits
    # per admitted request, each stalling asynchronous scheduling), while a flush is one
    # pinned upload per field group and one `index_copy_` per field, whatever the count.
    # Table appends wait too: with incremental KV a plan at 256 slots appends ~30 blocks, one
    # upload and one copy kernel each before; at the flush they are one of each.
    def init(self, op: SlotInit, depth: int) -> None:
        s, p, c = op.slot, op.params, op.controls
        if len(op.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids per request")
        self.clear(s)
        stop = list(op.stop_token_ids)
        self._write(
            s,
            min_loops=c.min_loops,
            max_loops=c.max_loops,
            # fixed depth as an unreachable threshold, so the device needs no `< 1` test
            threshold=c.exit_threshold if c.exit_threshold < 1.0 else 2.0,
            max_tokens=p.max_tokens,
            min_tokens=p.min_tokens,
            stop_ids=stop + [-1] * (MAX_STOP_IDS - len(stop)),
            temperature=0.0 if p.greedy else p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            seed=_int64(op.seed),
            presence=p.presence_penalty,
            frequency=p.frequency_penalty,
            repetition=p.repetition_penalty,
            constrained=bool(op.token_mask),
        )
        if op.token_mask:
            self._masks[s] = op.token_mask
        self._set_bias(s, p.logit_bias)
        if p.edits_logits:
            self._seen()
        if p.penalized:  # nothing seen yet but the prompt's tokens (the prompt bit)
            seen = self._seen()[s]
            seen.zero_()
            if op.prompt_token_ids:
                ids = upload(torch.tensor(op.prompt_token_ids, dtype=torch.long), self.device)
                seen.index_fill_(0, ids, 1)
        self.host[s] = SlotHost(p, c.may_exit_early(depth), 0)
        self.append(s, op.block_tables)

    def release(self, slot: int, mask: bytes) -> None:
        """A held constrained row runs again, its next token drawn from `mask`."""
        self._masks[slot] = mask
        self._write(slot, active=True)

    def _set_bias(self, slot: int, bias: tuple[tuple[int, float], ...]) -> None:
        if not bias and slot not in self._biased:
            return  # the row is all padding already
        pad = MAX_LOGIT_BIAS - len(bias)
        self._write(
            slot,
            bias_ids=[t for t, _ in bias] + [0] * pad,
            bias_values=[b for _, b in bias] + [0.0] * pad,
        )
        if bias:
            self._biased.add(slot)
        else:
            self._biased.discard(slot)

    def _seen(self) -> torch.Tensor:
        if self.seen is None:
            shape = (self.num_slots, self.vocab_size)
            self.seen = torch.zeros(shape, dtype=torch.int32, device=self.device)
        return self.seen

    def append(self, slot: int, blocks: Tables) -> None:
        host = self.host[slot]
        n = len(blocks[0])
        if host.blocks + n > self.max_blocks:
            raise RuntimeError(f"slot {slot}: block table longer than {self.max_blocks} blocks")
        planes = self.block_tables.shape[1]
        if len(blocks) != planes:
            raise ValueError(f"slot {slot}: {len(blocks)} block tables for {planes} KV planes")
        for plane, table in enumerate(blocks):
            start = (slot * planes + plane) * self.max_blocks + host.blocks
            self._tables.update(zip(range(start, start + n), table, strict=True))  # later wins
        host.blocks += n

    def clear(self, slot: int) -> None:
        """Back to the idle state: an idle slot writes nothing and emits nothing."""
        self._write(
            slot,
            active=False,
            parked=False,
            loop=0,
            position=0,
            generated=0,
            remaining=1.0,
            stop_ids=[-1] * MAX_STOP_IDS,
        )
        self.host.pop(slot, None)

    def _write(self, slot: int, **values: object) -> None:
        for name, value in values.items():
            self._rows.setdefault(name, {})[slot] = value  # a later write to a row wins

    def flush(self) -> None:
        """Put the row writes of inits and clears and the table appends on the device (before
        anything reads them)."""
        groups: dict[tuple[torch.dtype, torch.Size, tuple[int, ...]], list[str]] = {}
        for name, rows in self._rows.items():
            field = getattr(self, name)
            groups.setdefault((field.dtype, field.shape[1:], tuple(rows)), []).append(name)
        for (dtype, _, slots), names in groups.items():
            index = upload(torch.tensor(slots), self.device)
            values = [list(self._rows[name].values()) for name in names]
            columns = upload(torch.tensor(values, dtype=dtype), self.device)
            for name, column in zip(names, columns, strict=True):
                getattr(self, name).index_copy_(0, index, column)
        self._rows.clear()
        if self._masks:
            index = upload(torch.tensor(list(self._masks)), self.device)
            words = torch.frombuffer(bytearray(b"".join(self._masks.values())), dtype=torch.int32)
            self.allowed.index_copy_(0, index, upload(words.view(len(index), -1), self.device))
            self._masks.clear()
        if self._tables:
            entries = torch.tensor([list(self._tables), list(self._tables.values())])
            index, blocks = upload(entries, self.device)
            self.block_tables.view(-1).index_copy_(0, index, blocks.to(torch.int32))
            self._tables.clear()

    def start_decode(
        self,
        slots: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        refill: bool,
        when: torch.Tensor | None = None,
    ) -> None:
        """Prefill ended for `slots` with first tokens `tokens` at `positions` (the prompt
        lengths): they decode from now on, unless that token already ends them (a stop id, or
        max_tokens == 1). `when` ([1] bool, on the device): only if it holds (a riding wave's
        last loop, inside a captured traversal)."""

        def put(field: torch.Tensor, value: torch.Tensor | float | bool) -> None:
            if when is not None:
                field[slots] = torch.where(when, value, field[slots])
            elif isinstance(value, torch.Tensor):
                field[slots] = value
            else:  # `field[slots] = 0` would copy the scalar from pageable memory: a stream sync
                field.index_fill_(0, slots, value)

        ones = torch.ones_like(slots)
        put(self.token, tokens)
        put(self.position, positions)
        put(self.loop, 0)
        put(self.remaining, 1.0)
        put(self.generated, ones)
        # a constrained row waits for its second token's mask
        put(self.active, ~self.finishes(slots, tokens, ones) & ~self.constrained[slots])
        put(self.parked, not refill)

    def finishes(
        self, slots: torch.Tensor | slice, tokens: torch.Tensor, generated: torch.Tensor
    ) -> torch.Tensor:
        """The host's rule (`Scheduler._accept_token`): a stop id, or max_tokens reached."""
        stop = (tokens[:, None] == self.stop_ids[slots]).any(dim=1)
        return stop | (generated >= self.max_tokens[slots])

    # -- preemption ----------------------------------------------------------------------
    def snapshot(self, slot: int) -> tuple[dict[str, torch.Tensor], SlotHost]:
        self.flush()
        state = {name: to_host(getattr(self, name)[slot]) for name in self.FIELDS}
        if self.host[slot].params.penalized:
            state["seen"] = to_host(self._seen()[slot])
        return state, self.host[slot]

    def restore(
        self, slot: int, saved: tuple[dict[str, torch.Tensor], SlotHost], tables: Tables
    ) -> None:
        state, host = saved
        self.flush()  # a pending clear of this slot must not land on the restored row
        for name in self.FIELDS:
            getattr(self, name)[slot] = upload(state[name], self.device)
        if "seen" in state:
            self._seen()[slot] = upload(state["seen"], self.device)
        self._set_bias(slot, host.params.logit_bias)  # (from the params: not in the snapshot)
        self.host[slot] = SlotHost(host.params, host.early_exit, 0)
        self.append(slot, tables)

    # -- static variants of a window -----------------------------------------------------
    def span(self) -> int:
        """Slots [0, span) cover every slot in use."""
        return max(self.host, default=-1) + 1

    def flags(self) -> tuple[bool, bool, int | None, bool]:
        """(any random, any top-k/top-p, logprobs width, any early exit) over slots in use."""
        early = any(h.early_exit for h in self.host.values())
        return (*self.sampling_flags(list(self.host)), early)

    def any_logit_edits(self, slots: list[int] | None = None) -> bool:
        """Whether a bias or a penalty edits the logits of any of `slots` (None: the slots in
        use)."""
        slots = list(self.host) if slots is None else slots
        return any(self.host[i].params.edits_logits for i in slots)

    def logit_edits(self, rows: slice | torch.Tensor, generated: torch.Tensor) -> LogitEdits:
        """The sampler's logit edits of `rows` (a slice keeps the fixed addresses a graph
        needs) drawing their tokens of index `generated` [rows]."""
        return LogitEdits(
            self.presence[rows],
            self.frequency[rows],
            self.repetition[rows],
            self._seen()[rows],
            self.bias_ids[rows],
            self.bias_values[rows],
            self.stop_ids[rows],
            self.min_tokens[rows],
            generated,
            self.constrained[rows],
            self.allowed[rows],
        )

    def hold_constrained(self, b: int, exits: torch.Tensor) -> None:
        """Constrained rows among slots [0, b) that emitted a token (`exits`) wait for the
        host's next mask."""
        self.active[:b].logical_and_(~(exits & self.constrained[:b]))

    def count_output(
        self, rows: slice | torch.Tensor, tokens: torch.Tensor, committed: torch.Tensor
    ) -> None:
        """`tokens` [rows] joins each row's output where `committed` [rows] (bool) holds.
        Written, not accumulated: rows repeated in `rows` (a padded wave repeats its first)
        write the same value."""
        seen = self._seen()
        at = tokens[:, None]
        if isinstance(rows, slice):
            now = seen[rows].gather(1, at)
            seen[rows].scatter_(1, at, now + SEEN_OUTPUT * committed[:, None].to(torch.int32))
        else:
            now = seen[rows, tokens]
            seen.index_put_((rows, tokens), now + SEEN_OUTPUT * committed.to(torch.int32))

    def sampling_flags(self, slots: list[int]) -> tuple[bool, bool, int | None]:
        """The sampler's static variant for these slots: (any random, any top-k/top-p,
        logprobs width)."""
        params = [self.host[i].params for i in slots]
        random_ = [p for p in params if not p.greedy]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return (
            bool(random_),
            any(p.top_k > 0 or p.top_p < 1.0 for p in random_),
            max(logprobs) if logprobs else None,
        )

    def max_context(self, block_size: int) -> int:
        """Keys any slot can see in this window: its tables' capacity."""
        return max((h.blocks for h in self.host.values()), default=0) * block_size


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in host memory without waiting for the stream: on CUDA into pinned
    memory, non-blocking, so a preemption's snapshot does not wait for the windows in flight.
    The host must not read it before the stream has run the copy; the engine never does (a
    snapshot only goes back to the device, through `upload`, behind the copy on the same
    stream)."""
    if tensor.device.type != "cuda":
        return tensor.to("cpu", copy=True)
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return out.copy_(tensor, non_blocking=True)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the stream: on CUDA through pinned memory,
    non-blocking. A plain `.to(device)` from pageable memory synchronises the stream, i.e. waits
    for every window in flight, which stalls asynchronous scheduling at each block append and
    slot init. The pinned block stays reserved until the copy has run (the caching host
    allocator records it on the stream)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _int64(value: int) -> int:
    """Wrap a seed into the signed 64-bit range a tensor holds."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value
