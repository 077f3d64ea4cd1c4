"""The step's sampler: every sampling row of the batch processed together in tensors.

::

    raw logits [rows, vocab]  (one row per sequence; 1 + drafts for a speculative decode)
      ├─ logprobs: log_softmax(raw)                        (vLLM's default raw_logprobs)
      └─ processed = raw
           ├─ repetition penalty (prompt + output), frequency and presence (output only)
           ├─ logit_bias                                    one index_put_ for the batch
           ├─ min_tokens: stop ids -> -inf while the output is shorter
           ├─ grammar bitmask -> -inf where a token is not allowed
           ├─ greedy rows: argmax
           └─ random rows: / temperature, min_p, top-k, top-p (per-row values as tensors),
              softmax, then one multinomial draw per sequence with its own generator

Only the draw is a loop over sequences, because each seeded sequence owns its generator (so its
tokens do not depend on its batch-mates). A speculative sequence (``drafts``) draws its rows one
at a time and stops at the first token that differs from its draft: its generator then advances
once per token it keeps, exactly as plain decoding would, so drafting never changes a seeded
sequence's tokens (the rows after a rejection are never drawn, and they get no token).
A sequence whose distribution depends on its history
(penalties, min_tokens, a grammar) has exactly one row: the engine does not draft for it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.engine import layer_ops
from pagedkv.engine.outputs import TokenLogprob
from pagedkv.engine.row_views import joined_rows
from pagedkv.engine.sampler import SamplingParams
from pagedkv.errors import InvariantViolation

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SampleInput:
    """One sequence's rows in the step and what its processors need.

    ``bitmask`` (int32 ``[ceil(vocab / 32)]``, bit ``t`` set iff token ``t`` is allowed) comes
    from the sequence's grammar matcher; ``stop_ids`` are suppressed until the output has
    ``params.min_tokens`` tokens.
    """

    logits: torch.Tensor  # float32 [rows, vocab]
    params: SamplingParams
    generator: torch.Generator
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    stop_ids: Sequence[int] = ()
    bitmask: torch.Tensor | None = None
    drafts: Sequence[int] = ()  # the inputs of rows 1.. (a speculative decode's drafts)


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """One token per row; ``logprobs`` (one per row) when the params asked for them. A
    sequence whose processed logits allow no token, or are not finite, gets ``error`` and no
    tokens: it fails alone, its batch-mates are sampled as usual."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


def sample_batch(inputs: Sequence[SampleInput], *, finite: bool = False) -> list[SampleOutput]:
    """Sample every row of ``inputs``; results in the order of ``inputs``. ``finite``: the
    caller has checked that every row's max is finite (``step_faults.nonfinite_requests``,
    which the engine runs on every step), so where no processor changes the logits the
    sampler's own check of them (one more pass over the step's logits) is skipped."""
    if not inputs:
        return []
    counts = [e.logits.shape[0] for e in inputs]
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    raw = joined_rows([e.logits for e in inputs])  # a view where the rows are adjacent
    x = _processed(raw, inputs, starts)
    errors = [None] * len(inputs) if finite and x is raw else _unsampleable(x, starts, counts)
    if any(errors):
        x = x.clone() if x is raw else x
        for i, err in enumerate(errors):
            if err is not None:  # a neutral row so the batch's draw goes on
                x[starts[i] : starts[i] + counts[i]] = 0.0
    tokens = _draw(x, inputs, starts, counts)
    logprobs = _logprobs(raw, inputs, starts, counts, tokens)
    return [
        SampleOutput(t, lp) if err is None else SampleOutput([], None, err)
        for t, lp, err in zip(tokens, logprobs, errors, strict=True)
    ]


def _unsampleable(x: torch.Tensor, starts: list[int], counts: list[int]) -> list[str | None]:
    """Per sequence: why no token can be drawn from its rows (None: one can). One reduction
    for the batch: a row's max is NaN iff the row holds a NaN (``amax`` propagates it),
    ``+inf`` iff it holds ``+inf`` and no NaN, and ``-inf`` iff every entry is ``-inf``."""
    native = layer_ops.row_max(x)  # amax's values in one vectorised pass
    row_max = x.amax(dim=-1).tolist() if native is None else native
    if all(-math.inf < v < math.inf for v in row_max):  # False for NaN too
        return [None] * len(starts)
    out: list[str | None] = []
    for s, c in zip(starts, counts, strict=True):
        rows = row_max[s : s + c]
        if any(math.isnan(v) or v == math.inf for v in rows):
            out.append("the logits are not finite")
        elif any(v == -math.inf for v in rows):
            out.append("no token is allowed (grammar mask, bias and min_tokens exclude all)")
        else:
            out.append(None)
    return out


# ---------------------------------------------------------------------- processors
def _processed(raw: torch.Tensor, inputs: Sequence[SampleInput], starts: list[int]) -> torch.Tensor:
    """``raw`` with penalties, bias, min_tokens and grammar masks applied (``raw`` itself, not
    a copy, when no sequence uses any of them)."""
    pen = [i for i, e in enumerate(inputs) if e.params.has_penalties]
    bias = [i for i, e in enumerate(inputs) if e.params.logit_bias]
    short = [
        i for i, e in enumerate(inputs) if e.stop_ids and len(e.output_ids) < e.params.min_tokens
    ]
    masked = [i for i, e in enumerate(inputs) if e.bitmask is not None]
    if not (pen or bias or short or masked):
        return raw
    for i in {*pen, *short, *masked}:
        if inputs[i].logits.shape[0] != 1:
            raise InvariantViolation("a history-dependent sequence was given draft rows")
    x = raw.clone()
    if pen:
        _apply_penalties(x, [inputs[i] for i in pen], [starts[i] for i in pen])
    if bias:
        _apply_logit_bias(x, inputs, bias, starts)
    if short:
        rows = [starts[i] for i in short for _ in inputs[i].stop_ids]
        cols = [t for i in short for t in inputs[i].stop_ids]
        x[torch.tensor(rows), torch.tensor(cols)] = _NEG_INF
    if masked:
        rows_t = torch.tensor([starts[i] for i in masked])
        masks = torch.stack([inputs[i].bitmask for i in masked])  # type: ignore[misc]
        allowed = unpack_bitmask(masks, x.shape[1]).to(x.device)
        x[rows_t] = x[rows_t].masked_fill(~allowed, _NEG_INF)
    return x


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 ``[rows, words]`` (bit ``t % 32`` of word ``t // 32``) -> bool ``[rows, vocab]``."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def _padded(seqs: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(s) for s in seqs))
    out = torch.full((len(seqs), width), pad, dtype=torch.long)
    for r, s in enumerate(seqs):  # one bulk copy per sequence, not per token
        if s:
            out[r, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out.to(device)


def _apply_penalties(x: torch.Tensor, entries: list[SampleInput], rows: list[int]) -> None:
    """vLLM's penalties: repetition over prompt and output tokens first, then frequency
    (times the token's output count) and presence (once if it occurs in the output)."""
    vocab, dev = x.shape[1], x.device
    rows_t = torch.tensor(rows, device=dev)
    out = _padded([e.output_ids for e in entries], vocab, dev)
    counts = torch.zeros((len(entries), vocab + 1), dtype=x.dtype, device=dev)
    counts.scatter_add_(1, out, torch.ones_like(out, dtype=x.dtype))
    counts = counts[:, :vocab]
    prompt = _padded([e.prompt_ids for e in entries], vocab, dev)
    seen = torch.zeros((len(entries), vocab + 1), dtype=torch.bool, device=dev)
    seen.scatter_(1, prompt, True)
    seen = seen[:, :vocab] | (counts > 0)

    def col(name: str) -> torch.Tensor:
        vals = [float(getattr(e.params, name)) for e in entries]
        return torch.tensor(vals, dtype=x.dtype, device=dev).unsqueeze(1)

    sub = x[rows_t]
    rep = torch.where(seen, col("repetition_penalty"), torch.ones_like(sub))
    sub = torch.where(sub > 0, sub / rep, sub * rep)
    sub = sub - col("frequency_penalty") * counts - col("presence_penalty") * (counts > 0)
    x[rows_t] = sub


def _apply_logit_bias(
    x: torch.Tensor, inputs: Sequence[SampleInput], which: list[int], starts: list[int]
) -> None:
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i in which:
        e = inputs[i]
        for r in range(starts[i], starts[i] + e.logits.shape[0]):
            for tok, b in e.params.logit_bias:
                rows.append(r)
                cols.append(tok)
                vals.append(b)
    idx = (torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device))
    x.index_put_(idx, torch.tensor(vals, dtype=x.dtype, device=x.device), accumulate=True)


# ---------------------------------------------------------------------- the draw
def _draw(
    x: torch.Tensor, inputs: Sequence[SampleInput], starts: list[int], counts: list[int]
) -> list[list[int]]:
    tokens: list[list[int]] = [[] for _ in inputs]
    greedy = [i for i, e in enumerate(inputs) if e.params.is_greedy]
    if greedy:
        if len(greedy) == len(inputs):  # every row, in order: no gather
            native = layer_ops.argmax_rows(x)
            flat = x.argmax(dim=-1).tolist() if native is None else native
        else:
            rows = torch.tensor(
                [r for i in greedy for r in range(starts[i], starts[i] + counts[i])]
            )
            flat = x[rows.to(x.device)].argmax(dim=-1).tolist()
        pos = 0
        for i in greedy:
            tokens[i] = [int(t) for t in flat[pos : pos + counts[i]]]
            pos += counts[i]
    rand = [i for i, e in enumerate(inputs) if not e.params.is_greedy]
    if not rand:
        return tokens
    rows = torch.tensor([r for i in rand for r in range(starts[i], starts[i] + counts[i])])
    probs = _filtered_probs(
        x[rows.to(x.device)], [inputs[i] for i in rand], [counts[i] for i in rand]
    )
    pos = 0
    for i in rand:
        part = probs[pos : pos + counts[i]]
        gen, drafts = inputs[i].generator, inputs[i].drafts
        if not drafts:
            drawn = torch.multinomial(part, 1, generator=gen)[:, 0]
            tokens[i] = [int(t) for t in drawn.tolist()]
        else:  # row by row until a draft is rejected (the module docstring)
            for j in range(counts[i]):
                tok = int(torch.multinomial(part[j : j + 1], 1, generator=gen)[0, 0])
                tokens[i].append(tok)
                if j >= len(drafts) or tok != drafts[j]:
                    break
        pos += counts[i]
    return tokens


def _filtered_probs(y: torch.Tensor, entries: list[SampleInput], counts: list[int]) -> torch.Tensor:
    """Temperature, min_p, top-k and top-p with per-row values, then softmax."""
    dev, vocab = y.device, y.shape[1]

    def per_row(vals: list[float]) -> torch.Tensor:
        rep = torch.tensor(counts, device=dev)
        return torch.tensor(vals, dtype=y.dtype, device=dev).repeat_interleave(rep).unsqueeze(1)

    y = y / per_row([e.params.temperature for e in entries])
    if any(e.params.min_p > 0 for e in entries):
        p = torch.softmax(y, dim=-1)
        floor = p.max(dim=-1, keepdim=True).values * per_row([e.params.min_p for e in entries])
        y = y.masked_fill(p < floor, _NEG_INF)
    ks = [e.params.top_k if 0 < e.params.top_k < vocab else 0 for e in entries]
    if any(ks):
        k_rows = per_row([float(k or vocab) for k in ks]).long()
        kth = torch.sort(y, dim=-1, descending=True).values.gather(1, k_rows - 1)
        y = y.masked_fill(y < kth, _NEG_INF)
    if any(e.params.top_p < 1.0 for e in entries):
        # a row with top_p == 1 gets a bound no mass reaches (float rounding can make the
        # cumulative mass reach 1.0 before the last token)
        p_rows = per_row([e.params.top_p if e.params.top_p < 1.0 else 2.0 for e in entries])
        sorted_y, order = torch.sort(y, dim=-1, descending=True)
        probs = torch.softmax(sorted_y, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        drop = before >= p_rows
        drop[:, 0] = False  # the best token always (a top_p below float32's range is 0.0)
        sorted_y = sorted_y.masked_fill(drop, _NEG_INF)
        y = torch.full_like(y, _NEG_INF).scatter(-1, order, sorted_y)
    return torch.softmax(y, dim=-1)


# ---------------------------------------------------------------------- logprobs
def _logprobs(
    raw: torch.Tensor,
    inputs: Sequence[SampleInput],
    starts: list[int],
    counts: list[int],
    tokens: list[list[int]],
) -> list[list[TokenLogprob] | None]:
    """Raw logprobs of each sampled token and the top ``params.logprobs`` of its row; one
    log_softmax and one topk for every row that asked, one transfer to Python."""
    want = [i for i, e in enumerate(inputs) if e.params.logprobs is not None]
    out: list[list[TokenLogprob] | None] = [None for _ in inputs]
    if not want:
        return out
    rows = torch.tensor([r for i in want for r in range(starts[i], starts[i] + len(tokens[i]))])
    lp = torch.log_softmax(raw[rows.to(raw.device)].float(), dim=-1)
    sampled = torch.tensor([t for i in want for t in tokens[i]], device=lp.device)
    chosen = lp.gather(1, sampled.unsqueeze(1))[:, 0].tolist()
    k = max(int(inputs[i].params.logprobs or 0) for i in want)
    top_vals: list[list[float]] = [[] for _ in chosen]
    top_ids: list[list[int]] = [[] for _ in chosen]
    if k:
        top = lp.topk(k, dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    pos = 0
    for i in want:
        ki = int(inputs[i].params.logprobs or 0)
        recs = []
        for j, tok in enumerate(tokens[i]):
            r = pos + j
            pairs = tuple(zip(top_ids[r][:ki], top_vals[r][:ki], strict=True))
            recs.append(TokenLogprob(tok, float(chosen[r]), pairs))
        out[i] = recs
        pos += len(tokens[i])
    return out


def token_logprobs(rows: torch.Tensor, targets: Sequence[int], k: int) -> list[TokenLogprob]:
    """Raw logprobs of ``targets[i]`` under row ``i`` and the row's top ``k`` (prompt
    logprobs: row ``i`` is the position before ``targets[i]``)."""
    lp = torch.log_softmax(rows.float(), dim=-1)
    idx = torch.tensor(list(targets), device=lp.device).unsqueeze(1)
    chosen = lp.gather(1, idx)[:, 0].tolist()
    tops: list[tuple[tuple[int, float], ...]] = [() for _ in chosen]
    if k:
        top = lp.topk(k, dim=-1)
        tops = [
            tuple(zip(i, v, strict=True))
            for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        ]
    return [
        TokenLogprob(int(t), float(c), top) for t, c, top in zip(targets, chosen, tops, strict=True)
    ]
