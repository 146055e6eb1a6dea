"""Fine-tuning records: a prompt and its response, or a chat, as text pieces marked trained
or not (data.format; docs/data.md, "Fine-tuning data").

A record becomes a list of (text, trained) pieces; `data prepare` tokenizes each piece on
its own and writes its tokens with the context bit set where the piece is not trained
(data/loader.py), then the eos that ends every document, trained: the model learns where a
response ends. So the loss counts exactly the response's tokens and that eos, whatever the
packing does with the document.

- prompt_response: {"prompt": str, "response": str} -> [(prompt, no), (response, yes)].
- chat: {"messages": [{"role": "system" | "user" | "assistant" | ..., "content": str}, ...]}.
  With the tokenizer's chat template (a "chat_template" in the tokenizer_config.json beside
  the tokenizer.json, as transformers saves it) the conversation is rendered by that
  template, with jinja2's sandbox as transformers does; each assistant turn is what the
  template adds for it after the generation prompt (its header is context), found by
  rendering the growing conversation. Without a template: "role: content" lines, the
  assistant's content and newline trained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scaletrain.errors import UserError

FORMATS = ("text", "prompt_response", "chat")
Pieces = list[tuple[str, bool]]
TEMPLATE_FILE = "tokenizer_config.json"


def detect_format(record: Any, text_field: str) -> str:
    """data.format=auto: what a file is, by its first record's fields."""
    if isinstance(record, dict):
        if "prompt" in record and "response" in record:
            return "prompt_response"
        if "messages" in record and text_field not in record:
            return "chat"
    return "text"


def record_pieces(record: Any, form: str, template: ChatTemplate | None, where: str) -> Pieces:
    """The pieces of one prompt_response or chat record (`where`: file:line, for errors)."""
    if form == "prompt_response":
        if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("prompt", "response")):
            raise UserError(
                f"{where}: record lacks a string 'prompt' and 'response'; accepted for data.format=prompt_response: "
                '{"prompt": "...", "response": "..."} per line'
            )
        return [(record["prompt"], False), (record["response"], True)]
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages or not all(_is_message(m) for m in messages):
        raise UserError(
            f"{where}: record has no list of messages; accepted for data.format=chat: "
            '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]} per line'
        )
    return (template or PLAIN).pieces(messages, where)


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


class ChatTemplate:
    """A Hugging Face chat template, rendered as transformers' apply_chat_template does."""

    def __init__(self, source: str, special: dict[str, str]):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise UserError(f"the tokenizer's chat template refused a record: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.special = special

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return str(self.template.render(messages=messages, add_generation_prompt=generation_prompt, **self.special))

    def pieces(self, messages: list[dict[str, str]], where: str) -> Pieces:
        out: Pieces = []
        done = ""
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                head = self.render(messages[:i], generation_prompt=True) if i else ""
                out.append((self._after(done, head, where), False))
                done = head
            text = self.render(messages[: i + 1], generation_prompt=False)
            out.append((self._after(done, text, where), m["role"] == "assistant"))
            done = text
        return [(t, trained) for t, trained in out if t]

    @staticmethod
    def _after(done: str, text: str, where: str) -> str:
        if not text.startswith(done):
            raise UserError(
                f"{where}: the tokenizer's chat template renders a conversation differently once it grows, so its turns "
                "cannot be told apart; accepted: a template that renders each message after the earlier ones"
            )
        return text[len(done) :]


class _Plain:
    """Without a template: 'role: content' lines."""

    def pieces(self, messages: list[dict[str, str]], where: str) -> Pieces:
        out: Pieces = []
        for m in messages:
            out.append((f"{m['role']}: ", False))
            out.append((m["content"] + "\n", m["role"] == "assistant"))
        return out


PLAIN = _Plain()


def chat_template(tokenizer_json: Path | None) -> ChatTemplate | None:
    """The template saved beside `tokenizer_json` (tokenizer_config.json), if any."""
    if tokenizer_json is None or not (tokenizer_json.parent / TEMPLATE_FILE).is_file():
        return None
    path = tokenizer_json.parent / TEMPLATE_FILE
    try:
        conf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg}); accepted: transformers' tokenizer_config.json") from None
    source = conf.get("chat_template")
    if isinstance(source, list):  # several named templates: the default one
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str):
        return None
    special = {k: _token_text(conf.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return ChatTemplate(source, {k: v for k, v in special.items() if v is not None})


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken as transformers saves it
        value = value.get("content")
    return value if isinstance(value, str) else None
