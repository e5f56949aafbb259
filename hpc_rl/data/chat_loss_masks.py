"""A chat's token ids and its SFT loss mask (1 on the assistant turns), from the tokenizer's own chat template.

Owns `ChatLossMasks`: each message (a run of consecutive tool / observation messages counts as one, as chat
templates wrap them together) is rendered by the chat template on its own and the pieces are concatenated,
which is how slime's `MultiTurnLossMaskGenerator` builds SFT samples. Two renderings, slime's
`--loss-mask-type` names:

    qwen    the message alone; the template's preamble (a default system prompt, GLM's `[gMASK]<sop>`) is
            kept on the first message only
    qwen3   the message after a probe user turn, as it sits in a conversation (Qwen3's template then gives
            an assistant turn its empty `<think>` block, as slime's qwen3 masks do)

Nothing here knows a model family: the template's pieces are found by rendering probe chats (the preamble,
one user turn, the generation prompt), so Qwen3's, GLM-4's or any other template works. Of an assistant
message, what the generation prompt would have produced (the common prefix of the two: `<|im_start|>assistant\n`,
`<|assistant|>\n`) is masked out and the rest is trained. A template that closes no assistant turn (GLM: the
model ends its turn by emitting the next role token, which is among its stop tokens) would never teach the
model to stop, so a stop token right after an assistant turn is trained too, and a chat that ends on such a
turn gets the tokenizer's EOS appended (trained). A message with `step_loss_mask` != 1 is not trained (slime's).

Not here: reading the data (`data.prompts`), cutting a chat into a sample (`rollout.sft`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

PROBE_TEXT = "FOR CALCULATING LOSS MASK ONLY"
TOOL_ROLES = ("tool", "observation")
MaskRendering = Literal["qwen", "qwen3"]
"""The loss-mask renderings (slime's --loss-mask-type; the config field's type)."""
MASK_RENDERINGS: tuple[str, ...] = get_args(MaskRendering)


class ChatTemplateError(ValueError):
    """The chat template renders a message in a way that cannot be cut into per-message pieces."""


@dataclass(frozen=True)
class MaskedChat:
    """A chat as one token sequence with a loss mask (1 = trained) of the same length."""

    token_ids: list[int]
    loss_mask: list[int]

    @property
    def response_length(self) -> int:
        """Tokens from the first trained one to the end (slime's response: what the trainer scores)."""
        return len(self.loss_mask) - self.loss_mask.index(1) if 1 in self.loss_mask else 0


def _starts_with(values: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(values) >= len(prefix) and list(values[: len(prefix)]) == list(prefix)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def message_groups(messages: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Each message alone, except consecutive tool results, which form one group."""
    groups: list[list[dict[str, Any]]] = []
    for message in messages:
        if groups and message.get("role") in TOOL_ROLES and groups[-1][-1].get("role") in TOOL_ROLES:
            groups[-1].append(message)
        else:
            groups.append([message])
    return groups


class ChatLossMasks:
    """`masked(messages, tools)` -> MaskedChat, for one tokenizer (anything with transformers'
    `apply_chat_template` and `__call__`) and rendering (`qwen` | `qwen3`)."""

    def __init__(self, tokenizer: Any, *, rendering: str = "qwen", stop_token_ids: Iterable[int] = ()) -> None:
        if rendering not in MASK_RENDERINGS:
            raise ValueError(f"loss mask rendering {rendering!r} is not one of {', '.join(MASK_RENDERINGS)}")
        self.tokenizer, self.rendering = tokenizer, rendering
        self.eos_token_id: int | None = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_ids = set(stop_token_ids) | ({self.eos_token_id} if self.eos_token_id is not None else set())
        probe = {"role": "user", "content": PROBE_TEXT}
        self.probe = probe
        one = self._render([probe])
        two = self._render([probe, probe])
        if not _starts_with(two, one):
            raise ChatTemplateError("the chat template renders a first user turn differently once a second follows; "
                                    "its messages cannot be cut apart")
        self.probe_turn = two[len(one):]
        """One user turn in the middle of a chat."""
        self.probe_alone = one
        """A chat of one user turn: the template's preamble, then that turn."""
        self.preamble = one[: len(one) - len(self.probe_turn)] if one[len(one) - len(self.probe_turn):] == \
            self.probe_turn else []
        """What the template puts before the first message (a default system prompt, [gMASK]<sop>)."""
        self.generation_prompt = self._render([probe], add_generation_prompt=True)[len(one):]

    def _render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = False) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                                 add_generation_prompt=add_generation_prompt, return_dict=False)
        return list(ids)

    def _piece(self, group: list[dict[str, Any]], first: bool, tools: list[dict[str, Any]] | None) -> list[int]:
        """The tokens `group` adds to a chat (tools are the first piece's business, as slime passes them)."""
        if self.rendering == "qwen":
            ids = self._render(group, tools=tools if first else None)
            if not first and group[0].get("role") != "system" and _starts_with(ids, self.preamble):
                ids = ids[len(self.preamble):]
            return ids
        if first:
            ids = self._render([*group, self.probe], tools=tools)
            if ids[len(ids) - len(self.probe_turn):] != self.probe_turn:
                raise ChatTemplateError(f"cannot cut the first message ({group[0].get('role')}) from the probe turn "
                                        f"after it")
            return ids[: len(ids) - len(self.probe_turn)]
        ids = self._render([self.probe, *group])
        if not _starts_with(ids, self.probe_alone):
            raise ChatTemplateError(f"the chat template moves a {group[0].get('role')} message before the user turn "
                                    f"it follows (GLM renders every system message first): put it first")
        return ids[len(self.probe_alone):]

    def masked(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> MaskedChat:
        token_ids: list[int] = []
        loss_mask: list[int] = []
        open_turn = False  # the last piece was an assistant turn with no stop token in it
        for index, group in enumerate(message_groups(messages)):
            ids = self._piece(group, index == 0, tools)
            ids_mask = [0] * len(ids)
            if open_turn and ids and ids[0] in self.stop_token_ids:
                ids_mask[0] = 1  # the role token that ends the assistant turn before it
            message = group[0]
            open_turn = False
            if message.get("role") == "assistant":
                header = _common_prefix(ids, self.generation_prompt)
                if message.get("step_loss_mask", 1) == 1:
                    ids_mask = [0] * header + [1] * (len(ids) - header)
                    open_turn = not any(token in self.stop_token_ids for token in ids[header:])
            token_ids += ids
            loss_mask += ids_mask
        if open_turn and self.eos_token_id is not None:
            token_ids.append(self.eos_token_id)
            loss_mask.append(1)
        return MaskedChat(token_ids=token_ids, loss_mask=loss_mask)

    def spans(self, chat: MaskedChat) -> list[list[int]]:
        """The trained runs of token ids, in order (for tests and logs)."""
        runs: list[list[int]] = []
        current: list[int] = []
        for token, mask in zip(chat.token_ids, chat.loss_mask):
            if mask:
                current.append(token)
            elif current:
                runs.append(current)
                current = []
        if current:
            runs.append(current)
        return runs
