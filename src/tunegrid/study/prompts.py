"""A record's training text: tunegrid's own shapes (data.fields) or the layout a fine-tuning tool builds from it
(data.layout), one copy for the dataset rule, the recipe importer and its fidelity check.

`data.layout` names what axolotl (alpaca and its prompt styles, alpaca_chat, alpaca_instruct and its
load_no_prompt without the system line, oasst, context_qa.load_v2, the custom `type:` mapping with
field_instruction, field_input, field_output, field_system, system_prompt, format, no_input_format, system_format;
input_output) or TRL (prompt_completion) trains on, as axolotl's prompters (src/axolotl/prompters.py,
prompt_strategies/user_defined.py, alpaca_chat.py, alpaca_instruct.py, context_qa.py, input_output.py) and
TRL's SFTTrainer lay it out. `normalize` writes such a record as its text and its pieces, each marked trained or
not (`tunegrid.dataset.template_turns` reads them), so a cell trains on exactly the tool's text, the loss on the
response unless data.loss_on is all (axolotl's train_on_inputs). Chats (chat_template, sharegpt, messages) are
rendered by the checkpoint's chat template: `tool_text` is None for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tunegrid.dataset import template_turns

ALPACA_SYSTEM = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                 "Write a response that appropriately completes the request.")  # fmt: skip
ALPACA_SYSTEM_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."  # noqa: E501
)
# axolotl's AlpacaPrompter prompt styles: (turn_format, turn_no_input_format, system_format)
STYLES = {
    "instruct": ("### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
                 "### Instruction:\n{instruction}\n\n### Response:\n", "{system}\n\n"),
    "chat": ("USER: {instruction}\n{input}\nASSISTANT:", "USER: {instruction}\nASSISTANT:", "SYSTEM: {system}\n"),
    "chatml": ("<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>system\n{system}<|im_end|>\n"),
    "phi": ("<|user|>\n{instruction}<|end|>{input}<|assistant|>", "<|user|>\n{instruction}<|end|>\n<|assistant|>\n",
            "<|system|>\n{system}<|end|>\n"),
}  # fmt: skip
SHAREGPT = ("sharegpt", "sharegpt_simple", "sharegpt_jokes")
CUSTOM_KEYS = ("field_instruction", "field_input", "field_output", "field_system", "system_prompt", "format",
               "no_input_format", "system_format")  # fmt: skip
SEGMENTS = "input_output"  # axolotl's template-free type: segments of text, each trained or not (its label)
PROMPT_COMPLETION = "prompt_completion"  # TRL's prompt-completion records: the prompt, then the completion
# ShareGPT's role names (what axolotl's chat_template reader maps by default) as the chat roles
ROLE_NAMES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}


def field_map(data: dict[str, Any]) -> dict[str, str]:
    return dict(data.get("fields") or {})


def message_view(message: Any, fields: dict[str, str]) -> Any:
    """One message as {role, content} when data.fields names other keys (role: from, content: value)."""
    role_key, content_key = fields.get("role", "role"), fields.get("content", "content")
    if (role_key, content_key) == ("role", "content") or not isinstance(message, dict):
        return message
    role = message.get(role_key)
    return {"role": ROLE_NAMES.get(role, role), "content": message.get(content_key)}


@dataclass(frozen=True)
class Instruction:
    """An axolotl instruction prompter: the fields it reads and how it lays out the prompt."""

    instruction: str = "instruction"
    input: str = "input"
    output: str = "output"
    system_field: str = ""  # a record's own system prompt (custom mapping: field_system)
    system: str = ""  # the system prompt with an input (alpaca's), or the custom mapping's system_prompt
    system_no_input: str = ""
    turn: str = STYLES["instruct"][0]
    turn_no_input: str = STYLES["instruct"][1]
    system_format: str = STYLES["instruct"][2]
    given: dict[str, Any] = field(default_factory=dict)

    def fields(self) -> tuple[str, ...]:
        """The fields every record must hold (input and system are optional)."""
        return (self.instruction, self.output)

    def parse(self, record: dict[str, Any]) -> tuple[str, str, str]:
        text_in = str(record.get(self.input) or "") if self.input else ""
        return str(record[self.instruction]), text_in, str(record.get(self.output) or "")

    def build(self, record: dict[str, Any]) -> tuple[str, str]:
        instruction, text_in, response = self.parse(record)
        system = self.system if text_in else self.system_no_input
        if self.system_field and self.system_field in record:
            system = str(record[self.system_field] or "")
        head = self.system_format.format(system=system) if system else ""
        if text_in:
            return head + self.turn.format(instruction=instruction, input=text_in), response
        return head + self.turn_no_input.format(instruction=instruction), response


@dataclass(frozen=True)
class ContextQaV2(Instruction):
    """axolotl's context_qa.load_v2: "Context: …\\nQuestion: …\\n" as the instruction, "Answer: …" the response."""

    def fields(self) -> tuple[str, ...]:
        return ("context", "question", "answer")

    def parse(self, record: dict[str, Any]) -> tuple[str, str, str]:
        return f"Context: {record['context']}\nQuestion: {record['question']}\n", "", f"Answer: {record['answer']}"


def alpaca(style: str = "instruct", *, instruction: str = "instruction", output: str = "output") -> Instruction:
    turn, no_input, system_format = STYLES[style]
    return Instruction(instruction=instruction, input="input" if instruction == "instruction" else "",
                       output=output, system=ALPACA_SYSTEM, system_no_input=ALPACA_SYSTEM_NO_INPUT, turn=turn,
                       turn_no_input=no_input, system_format=system_format)  # fmt: skip


def oasst() -> Instruction:  # axolotl's OpenAssistantPromptTokenizingStrategy: the alpaca prompter, no input
    return alpaca(instruction="INSTRUCTION", output="RESPONSE")


def custom(mapping: dict[str, Any]) -> Instruction:
    """axolotl's user-defined type (UserDefinedDatasetConfig's defaults; prompt_strategies/user_defined.py: a
    record's field_system where it holds one, and system_prompt only where no field_system is named)."""
    system_field = str(mapping.get("field_system") or "")
    system = "" if system_field else str(mapping.get("system_prompt") or "")
    return Instruction(
        instruction=str(mapping.get("field_instruction") or "instruction"),
        input=str(mapping.get("field_input") or "input"), output=str(mapping.get("field_output") or "output"),
        system_field=system_field, system=system, system_no_input=system,
        turn=str(mapping.get("format") or "{instruction} {input} "),
        turn_no_input=str(mapping.get("no_input_format") or "{instruction} "),
        system_format=str(mapping.get("system_format") or "{system}"), given=dict(mapping),
    )  # fmt: skip


def instruction_of(kind: Any) -> Instruction | None:
    """The prompter of an axolotl dataset type (or custom mapping); None for a type that is none of them."""
    if isinstance(kind, dict):
        return custom(kind)
    if not isinstance(kind, str):
        return None
    if kind == "oasst":
        return oasst()
    if kind in ("alpaca_chat", "alpaca_chat.load"):
        return alpaca("chat")
    if kind == "alpaca_chat.load_qa":
        return alpaca("chat", instruction="question", output="answer")
    if kind in ("alpaca_instruct", "alpaca_instruct.load"):
        return alpaca("instruct")
    if kind == "alpaca_instruct.load_no_prompt":  # axolotl's UnpromptedPrompter: alpaca without its system line
        return replace(alpaca("instruct"), system="", system_no_input="")
    if kind == "context_qa.load_v2":
        return ContextQaV2(input="", turn="{instruction}\n{input}", turn_no_input="{instruction}", system_format="")
    base, _, style = kind.partition(":")
    if base == "alpaca" and (style or "instruct") in STYLES:
        return alpaca(style or "instruct")
    return None


def known_layout(layout: Any) -> bool:
    return layout in (SEGMENTS, PROMPT_COMPLETION) or instruction_of(layout) is not None


def layout_fields(layout: Any) -> tuple[str, ...]:
    """The fields each record of a layout must hold."""
    if layout == SEGMENTS:
        return ("segments",)
    if layout == PROMPT_COMPLETION:
        return ("prompt", "completion")
    prompter = instruction_of(layout)
    return prompter.fields() if prompter is not None else ()


def layout_pieces(layout: Any, record: dict[str, Any]) -> list[tuple[str, bool]]:
    """The text the tool trains on for one record, in pieces marked trained (the response) or not (the prompt)."""
    if layout == SEGMENTS:
        return [(str(s["text"]), bool(s.get("label", True))) for s in record["segments"]]
    if layout == PROMPT_COMPLETION:
        return [(str(record["prompt"]), False), (str(record["completion"]), True)]
    prompter = instruction_of(layout)
    if prompter is None:
        raise ValueError(f"config key 'data.layout': {layout!r} is no layout tunegrid builds")
    prompt, response = prompter.build(record)
    return [(prompt, False), (response, True)]


def normalize(record: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """One record in the shape a cell reads: the layout's text and pieces where data.layout names one; else chats
    keep role/content only, pairs become instruction/response, raw text stays text."""
    layout = data.get("layout")
    if layout:
        pieces = layout_pieces(layout, record)
        return {"text": "".join(text for text, _ in pieces), "pieces": [[text, trained] for text, trained in pieces]}
    fields = field_map(data)
    if "text" in fields:
        return {"text": str(record[fields["text"]])}
    if "messages" in fields:
        messages = [message_view(m, fields) for m in record[fields["messages"]]]
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}
    return {"instruction": str(record[fields["prompt"]]), "response": str(record[fields["response"]])}


def tool_text(kind: Any, record: dict[str, Any], text_field: str = "text") -> tuple[str, str] | None:
    """(prompt, response) the recipe's tool trains on for one record; ("", text) for raw text; None for chats."""
    if kind in ("completion", "text"):
        return "", str(record[text_field])
    if kind == SEGMENTS or known_layout(kind):
        pieces = layout_pieces(kind, record)
        untrained = 0 if kind == SEGMENTS else 1
        return "".join(t for t, _ in pieces[:untrained]), "".join(t for t, _ in pieces[untrained:])
    return None


def study_text(data: dict[str, Any], record: dict[str, Any]) -> str | None:
    """What a cell trains on for one record, through the dataset rule's own code (`normalize`) and the cell's reading
    of it (`template_turns`); None for a chat, which the checkpoint's chat template renders."""
    written = normalize(record, data)
    if "messages" in written:
        return None
    return "".join(text for text, _ in template_turns(written))
