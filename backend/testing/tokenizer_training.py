"""Train small byte-level BPE tokenizers on text every machine already has.

The default model and the tests need tokenizers that are small, reproducible
and free to redistribute, so they are trained here rather than downloaded: the
corpus is the Python standard library's own ``.py`` sources (PSF license).

Tokenizer conventions (shared by every tokenizer this module builds):

* Byte-level BPE (GPT-2 style): any byte sequence is encodable, so there is no
  unknown token, and ``decode(encode(text))`` reproduces ``text`` exactly.
  ``add_prefix_space=False`` keeps the first word of a text unchanged.
* One special token, ``<|endoftext|>`` (id 0). It separates documents in
  packed training data, so it serves as ``bos`` (a prompt then looks like the
  start of a fresh document), ``eos`` (the model learned to emit it where a
  document ends) and ``pad`` (padded positions are masked anyway).
* Encoding with special tokens prepends ``<|endoftext|>`` (like Llama's bos);
  decode with ``skip_special_tokens=True`` to get the plain text back.
* Offsets are not trimmed: in source code whitespace is content, so a token's
  offsets cover exactly the characters it encodes.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Collection, Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
_MIN_VOCAB = len(pre_tokenizers.ByteLevel.alphabet()) + 1

# Not library source: third-party packages, a build-specific generated module,
# and the interpreter's build configuration directory.
_SKIPPED_TOP_LEVEL = ("site-packages", "config-", "_sysconfigdata")
# Test suites are large and dominated by fixtures; library code is the better
# example of ordinary Python.
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, out_dir: Path | None = None
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts``.

    Deterministic: the same texts in the same order give the same vocabulary
    and merges. When ``out_dir`` is given the tokenizer is written there with
    ``save_pretrained`` so ``AutoTokenizer.from_pretrained(out_dir)`` loads it.
    """
    if vocab_size < _MIN_VOCAB:
        raise ValueError(
            f"vocab_size must be at least {_MIN_VOCAB} (256 bytes + {ENDOFTEXT}), got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    eot_id = tokenizer.token_to_id(ENDOFTEXT)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{ENDOFTEXT} $A",
                pair=f"{ENDOFTEXT} $A {ENDOFTEXT} $B",
                special_tokens=[(ENDOFTEXT, eot_id)],
            ),
        ]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    if out_dir is not None:
        wrapped.save_pretrained(str(out_dir))
    return wrapped


def python_stdlib_texts(
    exclude: Collection[str] = (),
    limit_bytes: int | None = None,
    *,
    include: Collection[str] | None = None,
) -> list[str]:
    """The running interpreter's standard library ``.py`` sources, sorted by path.

    ``exclude`` holds dotted module names (``"json"``, ``"email.mime"``); a file
    is left out when its module is one of them or lives inside one, which is how
    whole modules are held out for evaluation. ``include``, when given, keeps
    only files inside the named modules (to read the held-out set back). Test
    suites and site-packages are never included. ``limit_bytes`` stops before the UTF-8 size of the returned
    texts would exceed it. Files that are not valid UTF-8 are skipped.
    """
    if limit_bytes is not None and limit_bytes < 0:
        raise ValueError(f"limit_bytes must be non-negative, got {limit_bytes}")
    # A bare string is a Collection[str] of characters, never what was meant.
    if isinstance(exclude, str):
        raise ValueError(f"exclude must be a collection of module names, not the string {exclude!r}")
    if isinstance(include, str):
        raise ValueError(f"include must be a collection of module names, not the string {include!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded = tuple(exclude)
    included = None if include is None else tuple(include)
    texts: list[str] = []
    total = 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        relative = path.relative_to(root)
        if relative.parts[0].startswith(_SKIPPED_TOP_LEVEL) or _TEST_DIRS.intersection(relative.parts[:-1]):
            continue
        module = _module_name(relative)
        if _is_within(module, excluded) or (included is not None and not _is_within(module, included)):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        size = len(text.encode("utf-8"))
        if limit_bytes is not None and total + size > limit_bytes:
            break
        texts.append(text)
        total += size
    return texts


def _module_name(relative: Path) -> str:
    parts = relative.with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_within(module: str, names: tuple[str, ...]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)
