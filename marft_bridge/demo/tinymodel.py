"""Tiny causal LMs built in-process: a character-level tokenizer with a chat template and a small
Llama, saved as a normal transformers directory. Tests, benchmarks and the demo use them instead of
downloading anything.
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "<|im_end|>", "<|im_start|>"]
CHARS = list(string.printable[:-5]) + ["\n"]  # printable ASCII without \t\r\x0b\x0c, plus newline

# ChatML (transformers renders it with trim_blocks, hence the {{ '\\n' }} after block tags).
# Messages without tools, tool calls or tool results render exactly as they always have
# (``<|im_start|>role\ncontent<|im_end|>\n``; warm-started models were trained on it). Tools follow
# Qwen2.5 / Hermes, the format vLLM's ``--tool-call-parser hermes`` reads: the tool definitions in
# the system turn inside ``<tools>...</tools>`` (one JSON object a line), each assistant tool call
# as a ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`` block, and consecutive tool
# results as one user turn of ``<tool_response>...</tool_response>`` blocks. ``arguments`` may be
# a dict (rendered with tojson) or the OpenAI wire form, a JSON string (rendered as it is).
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "{{ tools_preamble }}{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}{{ tools_instructions }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if tools and loop.first and m['role'] == 'system' %}"  # already in the tools system turn
    "{% elif m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant"
    "{% if m['content'] %}{{ '\\n' }}{{ m['content'] }}{% endif %}"
    "{% for tc in m['tool_calls'] %}{% set f = tc['function'] if tc['function'] is defined else tc %}"
    '{{ "\\n" }}<tool_call>\n{"name": "{{ f[\'name\'] }}", "arguments": '
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
).replace("{{ tools_preamble }}", TOOLS_PREAMBLE).replace("{{ tools_instructions }}", TOOLS_INSTRUCTIONS)


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast``: one token per ASCII character, ``<|im_end|>`` as EOS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + sorted(set(CHARS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_positions: int = 1024,
) -> Path:
    """Write a randomly initialised tiny Llama and its tokenizer to ``path`` and return the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
