"""Chat template rendering with the globals Hugging Face templates use."""

from __future__ import annotations

import pytest

from mooncaked.model.chat_template import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError


def test_chatml_with_and_without_generation_prompt() -> None:
    template = ChatTemplate(CHATML_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert template.render(messages) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                         "<|im_start|>assistant\n")
    assert not template.render(messages, add_generation_prompt=False).endswith("assistant\n")


def test_hf_globals_bos_eos_tojson_and_generation_block() -> None:
    source = ("{{ bos_token }}{% for m in messages %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}"
              "{% endfor %}{{ eos_token }}{% if tools %}{{ tools | length }}{% endif %}")
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    text = template.render([{"role": "user", "content": "café"}], tools=[{"name": "f"}])
    assert text == '<s>"café"</s>1'


def test_raise_exception_surfaces_as_chat_template_error() -> None:
    source = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        ChatTemplate(source).render([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize("messages", [[], [{"content": "no role"}]])
def test_bad_messages_are_rejected(messages: list[dict[str, str]]) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(CHATML_TEMPLATE).render(messages)


def test_broken_template_fails_at_compile_time() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for x in %}")


def test_sandbox_blocks_attribute_escape() -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render([{"role": "user", "content": ""}])
