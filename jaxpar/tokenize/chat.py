"""Chats as training text: each message rendered with the tokenizer's chat template (the
`chat_template` of its tokenizer_config.json, a Jinja template, as Hugging Face checkpoints ship
it), or, without one, as `role: content` lines; the assistant's messages are what the loss counts.

With a template the conversation is rendered prefix by prefix: before each assistant message the
messages so far with the generation prompt (what the model is given), then with that message
(what it must write). The difference is the response. A template whose renderings are not
prefixes of each other cannot be cut so, and is refused in one sentence.
"""

from __future__ import annotations

from jaxpar.data.token_folder import special_token
from jaxpar.errors import DataError

ASSISTANT = "assistant"


class ChatFormat:
    """Messages -> [(text, is_response)] pieces, by the chat template of the tokenizer's settings
    (its tokenizer_config.json: jaxpar.data.token_folder.tokenizer_settings) when they have one."""

    def __init__(self, settings: dict):
        template = settings.get("chat_template")
        self.template = _compiled(template) if isinstance(template, str) else None
        # what templates refer to
        self.tokens = {key: special_token(settings, key) or "" for key in ("bos_token", "eos_token")}

    def pieces(self, messages: list[dict]) -> list[tuple[str, bool]]:
        if self.template is None:
            return [piece for m in messages for piece in ((f"{m['role']}: ", False),
                                                          (m["content"] + "\n", m["role"] == ASSISTANT))]
        pieces, done = [], ""
        for i, message in enumerate(messages):
            if message["role"] != ASSISTANT:
                continue
            given, written = self._render(messages[:i], True), self._render(messages[:i + 1], False)
            if not (given.startswith(done) and written.startswith(given)):
                raise DataError("the tokenizer's chat template does not render a conversation as prefixes of "
                                "itself, so its responses cannot be told from its prompts.")
            pieces += [(given[len(done):], False), (written[len(given):], True)]
            done = written
        whole = self._render(messages, False)
        return pieces + [(whole[len(done):], False)] if whole.startswith(done) else pieces

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.tokens)
        except TemplateError as e:
            raise DataError(f"the tokenizer's chat template failed on a conversation: {e}.") from None


def _compiled(source: str):
    """The template in a sandbox, as transformers renders it (blocks trimmed, raise_exception)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    try:
        return environment.from_string(source)
    except TemplateError as e:
        raise DataError(f"the tokenizer's chat_template is not a Jinja template ({e}).") from None
