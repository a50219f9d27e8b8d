"""Compiles structured-output constraints with xgrammar on a worker thread, cached by their text.

The vocabulary comes from the model's Hugging Face tokenizer through xgrammar's own
constructor (``TokenizerInfo.from_huggingface``), sized to the model's embedding rows:
ids past the tokenizer's last token are padding that no grammar ever allows. The stop
tokens are the engine's EOS ids, so a grammar allows EOS only where it may end.

JSON schemas and ``json_object`` compile to one layout, ``json.dumps``'s (``", "`` and
``": "``, no other whitespace): a model cannot spend its ``max_tokens`` on whitespace
that xgrammar would otherwise allow without end. Length-bounded strings are rewritten
first (:mod:`pagedllm.engine.json_string_bounds`), so they stay strict JSON.

The compile runs off the engine's step path: xgrammar releases the GIL while it
compiles. A compile cannot be interrupted, so a request that gives up on one (the
engine's timeout) leaves it to finish on the worker, where its result still lands in
the cache for the next request with the same constraint. ``WORKERS`` compiles run at
once (half the CPUs, two to eight), so one slow constraint does not hold up the others.
The workers are daemon threads: a process that exits does not wait for a compile nobody
needs any more.
"""
from __future__ import annotations

import json
import os
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from pagedllm.engine.json_string_bounds import bounded_strings_as_patterns
from pagedllm.core.structured_outputs_params import StructuredOutputsParams

CACHE_ENTRIES = 256
WORKERS = max(2, min(8, (os.cpu_count() or 2) // 2))
# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: ": not the client's business.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarRejected(ValueError):
    """xgrammar refused the constraint; the message names the field and gives xgrammar's reason."""


class GrammarCompiler:
    """Thread-safe: ``submit`` from the engine thread; compiles run on the workers."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids) or None
        self._compiler: xgr.GrammarCompiler | None = None  # built on the worker at first use: large vocabularies take a while
        self._work: queue.SimpleQueue[tuple[StructuredOutputsParams, Future[xgr.CompiledGrammar]] | None] = \
            queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._closed = False
        self._building = threading.Lock()  # the first compiles wait for one shared xgrammar compiler
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, constraint: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar's future, shared with every earlier request for the same constraint."""
        key = constraint.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = Future()
            self._cache[key] = future
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            if not self._workers:  # started at first use: most engines never compile a grammar
                self._workers = [threading.Thread(target=self._serve, name=f"pagedllm-grammar-{i}", daemon=True)
                                 for i in range(WORKERS)]
                for worker in self._workers:
                    worker.start()
        self._work.put((constraint, future))
        return future

    def close(self) -> None:
        """Let the workers end after the compiles in progress; the compiles still queued are cancelled."""
        self._closed = True
        for _ in self._workers:
            self._work.put(None)

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            constraint, future = item
            if self._closed:  # nobody will wait for it
                future.cancel()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._compile(constraint))
            except BaseException as error:  # the waiting request reports it; the worker carries on
                future.set_exception(error)

    def _compile(self, constraint: StructuredOutputsParams) -> xgr.CompiledGrammar:
        with self._building:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            compiler = self._compiler
        kind = constraint.kind
        try:
            if kind == "json":
                schema = bounded_strings_as_patterns(json.loads(constraint.json or ""))
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(constraint.regex or "")
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(constraint.choice or ()))
            return compiler.compile_grammar(constraint.grammar or "")
        except (RuntimeError, ValueError, TypeError) as error:
            reason = _LOCATION.sub("", str(error).strip())
            raise GrammarRejected(f"SamplingParams.structured_outputs.{kind} was rejected by xgrammar: {reason}") \
                from None


def choice_grammar(choices: Iterable[str]) -> str:
    """EBNF whose root is exactly one of ``choices``; each is a JSON-escaped literal, which xgrammar reads."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
