"""Issue 21: SFT loss masks equal the assistant spans of multi-turn chats, with tools, for Qwen3's and GLM's
chat templates (tiny tokenizers carrying the real templates: tests/unit/chat_tokenizers.py)."""

from __future__ import annotations

import pytest

from hpc_rl.data.chat_loss_masks import ChatLossMasks, ChatTemplateError, message_groups
from tests.unit.chat_tokenizers import chat_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "terminal", "description": "Run a command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
CALL = {"type": "function", "function": {"name": "terminal", "arguments": {"command": "ls"}}}
QWEN3_CHAT = [
    {"role": "system", "content": "SYS"},
    {"role": "user", "content": "USER ONE"},
    {"role": "assistant", "content": "I WILL CALL terminal", "tool_calls": [CALL]},
    {"role": "tool", "name": "terminal", "content": "a.txt"},
    {"role": "tool", "name": "terminal", "content": "b.txt"},
    {"role": "assistant", "content": "FINAL ANSWER"},
    {"role": "user", "content": "USER TWO"},
    {"role": "assistant", "content": "SECOND"},
]
QWEN3_CALL = 'I WILL CALL terminal\n<tool_call>\n{"name": "terminal", "arguments": {"command": "ls"}}\n</tool_call>'
GLM_CHAT = [
    {"role": "system", "content": "SYS"},
    {"role": "user", "content": "USER ONE"},
    {"role": "assistant", "metadata": "terminal", "content": '{"command": "ls"}'},
    {"role": "observation", "content": "a.txt"},
    {"role": "assistant", "content": "FINAL ANSWER"},
    {"role": "user", "content": "USER TWO"},
    {"role": "assistant", "content": "SECOND"},
]


def spans(family: str, rendering: str, chat: list[dict], tools: list[dict] | None = TOOLS) -> tuple[list[str], str]:
    tokenizer, stops = chat_tokenizer(family)
    masks = ChatLossMasks(tokenizer, rendering=rendering, stop_token_ids=stops)
    masked = masks.masked(chat, tools)
    assert len(masked.token_ids) == len(masked.loss_mask)
    return [tokenizer.decode(span) for span in masks.spans(masked)], tokenizer.decode(masked.token_ids)


def test_qwen3_template_masks_every_assistant_turn_and_nothing_else() -> None:
    trained, text = spans("qwen3", "qwen3", QWEN3_CHAT)
    think = "<think>\n\n</think>\n\n"  # Qwen3's template gives a final assistant turn its (empty) think block
    assert trained == [think + QWEN3_CALL + "<|im_end|>\n", think + "FINAL ANSWER<|im_end|>\n",
                       think + "SECOND<|im_end|>\n"]
    assert text.startswith("<|im_start|>system\nSYS\n\n# Tools")  # tools and system in the first turn, untrained
    assert "<tool_response>\na.txt\n</tool_response>\n<tool_response>\nb.txt" in text  # one user turn, untrained
    assert "<|im_start|>assistant\n" not in "".join(trained)  # the generation prompt is the prompt's


def test_qwen_rendering_is_the_template_of_each_message_alone() -> None:
    """slime's default (loss_mask_type qwen): no think block; on Qwen3's template, the whole chat equals the
    template's own rendering but for the last turn's think block."""
    trained, text = spans("qwen3", "qwen", QWEN3_CHAT)
    assert trained == [QWEN3_CALL + "<|im_end|>\n", "FINAL ANSWER<|im_end|>\n", "SECOND<|im_end|>\n"]
    tokenizer, _ = chat_tokenizer("qwen3")
    full = tokenizer.apply_chat_template(QWEN3_CHAT, tools=TOOLS, tokenize=False)
    assert full == text.replace("<|im_start|>assistant\nSECOND", "<|im_start|>assistant\n<think>\n\n</think>\n\nSECOND")


@pytest.mark.parametrize("rendering", ["qwen", "qwen3"])
def test_glm_template_trains_the_turn_and_the_role_token_that_ends_it(rendering: str) -> None:
    trained, text = spans("glm4", rendering, GLM_CHAT)
    # GLM closes no assistant turn: the next role token (a stop token in its config) ends it, so it is trained;
    # the chat's end gets the EOS. The tool call's function name (metadata) is the model's to write.
    assert trained == ['terminal\n{"command": "ls"}<|observation|>', "FINAL ANSWER<|user|>", "SECOND<|endoftext|>"]
    assert text.startswith("[gMASK]<sop><|system|>\n你是一个名为 ChatGLM 的人工智能助手")
    tokenizer, _ = chat_tokenizer("glm4")
    assert text == tokenizer.apply_chat_template(GLM_CHAT, tools=TOOLS, tokenize=False) + "<|endoftext|>"


def test_a_message_kept_out_by_step_loss_mask_and_a_chat_without_tools() -> None:
    chat = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "DRAFT", "step_loss_mask": 0},
            {"role": "user", "content": "AGAIN"}, {"role": "assistant", "content": "FINAL"}]
    assert spans("qwen3", "qwen", chat, tools=None)[0] == ["FINAL<|im_end|>\n"]
    assert spans("glm4", "qwen", chat, tools=None)[0] == ["FINAL<|endoftext|>"]


def test_response_starts_at_the_first_trained_token() -> None:
    tokenizer, stops = chat_tokenizer("qwen3")
    masked = ChatLossMasks(tokenizer, rendering="qwen", stop_token_ids=stops).masked(QWEN3_CHAT[:3], TOOLS)
    first = masked.loss_mask.index(1)
    assert masked.response_length == len(masked.token_ids) - first
    assert tokenizer.decode(masked.token_ids[:first]).endswith("<|im_start|>assistant\n")


def test_tool_results_group_and_a_misplaced_glm_system_message_is_an_error() -> None:
    assert [len(g) for g in message_groups(QWEN3_CHAT)] == [1, 1, 1, 2, 1, 1, 1]
    tokenizer, stops = chat_tokenizer("glm4")
    masks = ChatLossMasks(tokenizer, rendering="qwen3", stop_token_ids=stops)
    with pytest.raises(ChatTemplateError, match="renders every system message first"):
        masks.masked([{"role": "user", "content": "Q"}, {"role": "system", "content": "LATE"},
                      {"role": "assistant", "content": "A"}])
    with pytest.raises(ValueError, match="is not one of"):
        ChatLossMasks(tokenizer, rendering="qwen3_5")
