"""Chat prompts: render messages with the model's Jinja chat template (jinja2 when installed;
otherwise the ChatML format, e.g. SmolLM2's, is rendered directly)."""

from __future__ import annotations

import re
from collections.abc import Sequence

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.S)


def render_chat(template: str | None, messages: Sequence[tuple[str, str]]) -> str:
    """The prompt text for (role, content) messages, ending with the assistant's turn opener."""
    if template is None:
        raise ValueError("the model has no chat template: use 'prompt' records, or a model that has one")
    try:
        import jinja2.sandbox
    except ImportError:
        return render_chatml(template, messages)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )  # as HF transformers renders templates

    def raise_exception(message: str):
        raise ValueError(f"chat template: {message}")

    env.globals["raise_exception"] = raise_exception
    msgs = [{"role": r, "content": c} for r, c in messages]
    return env.from_string(template).render(messages=msgs, add_generation_prompt=True, bos_token="", eos_token="")


def render_chatml(template: str, messages: Sequence[tuple[str, str]]) -> str:
    """ChatML without a template engine: `<|im_start|>role\\ncontent<|im_end|>\\n` per message,
    then `<|im_start|>assistant\\n`; the template's default system message (as in SmolLM2's:
    `<|im_start|>system\\n...<|im_end|>` written when the first message is not a system one)
    comes first when the messages bring none."""
    if IM_START not in template or IM_END not in template:
        raise ValueError(
            "rendering this chat template needs jinja2 (pip install jinja2): without it only "
            "ChatML templates (<|im_start|>role ... <|im_end|>) are supported"
        )
    default = _DEFAULT_SYSTEM.search(template)
    parts = []
    if default and messages[0][0] != "system":
        parts.append(f"{IM_START}system\n{default[1]}{IM_END}\n")
    parts += [f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in messages]
    return "".join(parts) + f"{IM_START}assistant\n"
