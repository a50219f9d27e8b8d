"""The OpenAI door's torch-free tokenizer renders and encodes exactly as transformers' AutoTokenizer does."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pagedllm.core.model_source import DEFAULT_MODEL_DIR
from pagedllm.serving.openai.chat_tokenizer import ChatTokenizer

TOOL_TEMPLATE = (
    "{{ bos_token }}{%- if tools %}<|system|>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PLAIN_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
MESSAGES = [{"role": "system", "content": "Be brief. Ünïcödé ✓"}, {"role": "user", "content": "hi  there\n\tok"},
            {"role": "assistant", "content": "yes"}, {"role": "user", "content": '{"json": "quotes \\" "}'}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather, °C",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TEXTS = ["", "hello world", "  leading spaces", "Ünïcödé ✓ 日本語", "<|endoftext|>inside", "a\nb\r\nc\t"]


def _with_template(source: Path, target: Path, how: str) -> Path:
    shutil.copytree(source, target)
    if how == "jinja-file":
        (target / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    else:
        config_file = target / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["chat_template"] = ([{"name": "default", "template": PLAIN_TEMPLATE},
                                    {"name": "tool_use", "template": TOOL_TEMPLATE}] if how == "named" else TOOL_TEMPLATE)
        config_file.write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("how", ["jinja-file", "config-string", "named"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "default"])
def test_render_and_encode_match_autotokenizer(tiny_model_dir: Callable[[str], Path], tmp_path: Path, arch: str,
                                               how: str) -> None:
    folder = _with_template(DEFAULT_MODEL_DIR if arch == "default" else tiny_model_dir(arch), tmp_path / arch, how)
    ours, theirs = ChatTokenizer.load(folder), AutoTokenizer.from_pretrained(folder)
    for tools in (None, TOOLS):
        expected = theirs.apply_chat_template(MESSAGES, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.render(MESSAGES, tools) == expected
    for text in TEXTS:
        assert ours.encode(text) == theirs(text).input_ids
    assert ours.bos_token == theirs.bos_token


def test_a_tokenizer_without_a_template_or_a_default_says_so(tiny_model_dir: Callable[[str], Path],
                                                            tmp_path: Path) -> None:
    folder = _with_template(tiny_model_dir("llama"), tmp_path / "named", "named")
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = [{"name": "tool_use", "template": TOOL_TEMPLATE}]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no default"):
        ChatTokenizer.load(folder).render(MESSAGES, None)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        ChatTokenizer.load(folder)
