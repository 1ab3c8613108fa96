"""A recipe's training text as its tool builds it from a record, and the study's reading of the dataset type.

`tool_text` is what axolotl (alpaca and its prompt styles, oasst, the custom `type:` mapping with field_instruction,
field_input, field_output, field_system, system_prompt, format, no_input_format, system_format; completion;
input_output) or TRL (dataset_text_field, prompt-completion) trains on for one record: (prompt, response) or
raw text, as axolotl's prompters (src/axolotl/prompters.py, prompt_strategies/user_defined.py, alpaca_w_system.py)
and TRL's SFTTrainer lay them out; chats (chat_template, sharegpt, messages) are rendered by the checkpoint's
chat template and are None here. `study_text` is what tunegrid's records train on for the same record, so
`recipe_fidelity` can compare the two and the header can say where they differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tunegrid.dataset import PROMPT_TEMPLATE

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

    def build(self, record: dict[str, Any]) -> tuple[str, str]:
        text_in = str(record.get(self.input) or "") if self.input else ""
        system = self.system if text_in else self.system_no_input
        if self.system_field and self.system_field in record:
            system = str(record[self.system_field] or "")
        head = self.system_format.format(system=system) if system else ""
        if text_in:
            prompt = head + self.turn.format(instruction=record[self.instruction], input=text_in)
        else:
            prompt = head + self.turn_no_input.format(instruction=record[self.instruction])
        return prompt, str(record.get(self.output) or "")


def alpaca(style: str = "instruct") -> Instruction:
    turn, no_input, system_format = STYLES.get(style, STYLES["instruct"])
    return Instruction(system=ALPACA_SYSTEM, system_no_input=ALPACA_SYSTEM_NO_INPUT, turn=turn,
                       turn_no_input=no_input, system_format=system_format)  # fmt: skip


def oasst() -> Instruction:  # axolotl's OpenAssistantPromptTokenizingStrategy: the alpaca prompter, no input
    return Instruction(instruction="INSTRUCTION", input="", output="RESPONSE", system=ALPACA_SYSTEM,
                       system_no_input=ALPACA_SYSTEM_NO_INPUT)  # fmt: skip


def custom(mapping: dict[str, Any]) -> Instruction:
    """axolotl's user-defined type (UserDefinedDatasetConfig's defaults)."""
    system = str(mapping.get("system_prompt") or "")
    return Instruction(
        instruction=str(mapping.get("field_instruction") or "instruction"),
        input=str(mapping.get("field_input") or "input"), output=str(mapping.get("field_output") or "output"),
        system_field=str(mapping.get("field_system") or "system"), system=system, system_no_input=system,
        turn=str(mapping.get("format") or "{instruction} {input} "),
        turn_no_input=str(mapping.get("no_input_format") or "{instruction} "),
        system_format=str(mapping.get("system_format") or "{system}"), given=dict(mapping),
    )  # fmt: skip


def instruction_of(kind: Any) -> Instruction | None:
    if isinstance(kind, dict):
        return custom(kind)
    if kind == "oasst":
        return oasst()
    if isinstance(kind, str) and kind.split(":")[0] == "alpaca":
        return alpaca(kind.partition(":")[2] or "instruct")
    return None


def tool_text(kind: Any, record: dict[str, Any], text_field: str = "text") -> tuple[str, str] | None:
    """(prompt, response) the recipe's tool trains on for one record; ("", text) for raw text; None for chats."""
    prompter = instruction_of(kind)
    if prompter is not None:
        return prompter.build(record)
    if kind in ("completion", "text"):
        return "", str(record[text_field])
    if kind == "input_output":
        return "", "".join(str(s["text"]) for s in record["segments"])
    if kind == "prompt_completion" and isinstance(record.get("prompt"), str):  # TRL: the prompt, then the completion
        return str(record["prompt"]), str(record["completion"])
    return None


def study_text(fields: dict[str, str], record: dict[str, Any]) -> tuple[str, str] | None:
    """What tunegrid trains on for one record (without a chat template: the project's prompt template)."""
    if "text" in fields:
        return "", str(record[fields["text"]])
    if "messages" in fields:
        return None
    return PROMPT_TEMPLATE.format(instruction=record[fields["prompt"]]), str(record[fields["response"]])
