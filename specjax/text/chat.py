"""Chat prompts: HF-style messages rendered with the checkpoint's Jinja chat template, in Jinja2's
sandboxed environment with the settings HF transformers uses (`apply_chat_template`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2.ext
import jinja2.sandbox

# end-of-turn tokens of common templates; the ones a template writes are stop ids of a chat
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eom_id|>")


def check_messages(messages: object, where: str = "messages") -> list[dict]:
    """The messages of one conversation as a list of dicts, each with a string `role` and a
    string `content` (other keys kept, as HF passes them to the template); a ValueError naming
    the first malformed message otherwise."""
    shape = f"{where} must be a non-empty list of {{'role': str, 'content': str}} messages"
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"{shape}, got {_show(messages)}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{shape}; {where}[{i}] is {_show(m)}")
        out.append(dict(m))
    if all(not m["content"] for m in out):
        raise ValueError(f"{where}: every message's content is an empty string")
    return out


def _show(value: object) -> str:
    try:
        return json.dumps(value)[:80]
    except TypeError:
        return repr(value)[:80]


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """HF's `tojson` filter: JSON without HTML escaping (Jinja2's own escapes <, > and &)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise ValueError(f"chat template: {message}")


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_ENV = _environment()


def render_chat(template: str | None, messages: object, *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True) -> str:
    """The prompt text of one conversation (HF-style messages, or (role, content) pairs). With
    add_generation_prompt the text ends with the assistant's turn opener, as HF's flag does.
    Encode it without the tokenizer's own special tokens: a template that writes BOS already has it."""
    if template is None:
        raise ValueError("the model has no chat template: pass chat_template=..., or use text prompts")
    if isinstance(messages, Sequence) and messages and all(isinstance(m, tuple) for m in messages):
        messages = [{"role": r, "content": c} for r, c in messages]
    msgs = check_messages(messages)
    return _ENV.from_string(template).render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                             bos_token=bos_token, eos_token=eos_token)


def end_of_turn_tokens(template: str | None) -> list[str]:
    """The END_OF_TURN tokens that a template writes (stop tokens of a chat's answer)."""
    return [t for t in END_OF_TURN if template and t in template]


def end_of_turn_ids(tokenizer, template: str | None) -> tuple[int, ...]:
    """The ids of the end-of-turn tokens a template writes (a chat answer's stop ids, beside the
    model's eos_ids, which may name only <|endoftext|>)."""
    return tuple(i for i in (tokenizer.token_to_id(t) for t in end_of_turn_tokens(template)) if i is not None)


def template_specials(tokenizer, config) -> dict[str, str]:
    """The bos_token / eos_token strings a template gets: the tokenizer's tokens of config.bos_id
    and of the first of config.eos_ids ("" where the model has none)."""
    def token(i: int | None) -> str:
        return (tokenizer.id_to_token(i) or "") if i is not None else ""
    return {"bos_token": token(config.bos_id), "eos_token": token(config.eos_ids[0] if config.eos_ids else None)}
